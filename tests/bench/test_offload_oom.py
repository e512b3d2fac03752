"""bench.offload_oom: jobs in a memory cgroup, reported as completed or killed by the OOM killer.

Needs root and the cgroup-v1 memory controller (CI runs as root); a tiny GPT-2 keeps it short.
What the benchmark measures on the real model is in ``bench/results``; nothing here asserts a time.
"""

from __future__ import annotations

import os

import pytest

from bench import offload_oom

TINY = ["--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--seq-len", "16", "--steps", "2"]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or not offload_oom.CGROUP_ROOT.is_dir(),
                                 reason="needs root and the cgroup-v1 memory controller")]


def test_a_job_over_its_limit_is_reported_killed_and_its_cgroup_removed(tmp_path):
    args = offload_oom.build_parser().parse_args(["--nvme-path", str(tmp_path), *TINY])
    result = offload_oom._run_job("none", args, 150 * 2**20, tmp_path)  # less than the ranks' interpreters
    assert result["exit"] != 0 and result["oom_kills"] > 0
    assert result["peak"] <= 150 * 2**20
    assert not list(offload_oom.CGROUP_ROOT.glob(f"zcomm_offload_oom_{os.getpid()}_*"))


def test_every_job_completes_under_a_generous_limit_and_the_swap_files_go(tmp_path, capsys):
    offload_oom.main(["--nvme-path", str(tmp_path), "--limit", "4G", "--no-baseline", *TINY])
    table = capsys.readouterr().out
    for mode in offload_oom.MODES:
        assert f"| {mode} | 4.0 GiB | completed |" in table
    assert "not evaluated" in table  # no baseline, so no compute time to compare with
    assert list(tmp_path.iterdir()) == []
