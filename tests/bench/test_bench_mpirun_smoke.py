"""A 2-rank mpirun run of bench.collectives at tiny sizes: JSON shape and #wrong == 0."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.collectives.report import JSON_KEYS

MPIRUN = Path(sys.executable).parent / "mpirun"


def _mpirun() -> str:
    if MPIRUN.exists():
        return str(MPIRUN)
    found = shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun not found next to the interpreter nor on PATH (pip install mpich)")
    return found


@pytest.mark.slow
def test_mpirun_two_ranks(tmp_path, checkout_env):
    out = tmp_path / "rows.json"
    env = dict(checkout_env, ZCOMM_LOCAL_SIZE="1")
    argv = [_mpirun(), "-n", "2", sys.executable, "-m", "bench.collectives",
            "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "-d", "bfloat16",
            "--stages", "1,2", "--json", str(out)]  # fmt: skip
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks = 2 node(s) x 1 (mpich)" in result.stdout
    rows = json.loads(out.read_text())
    assert all(tuple(row) == JSON_KEYS for row in rows)
    baselines = {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}
    expected = baselines | {"all_gather_q8", "reduce_scatter_q4:stages=1", "reduce_scatter_q4:stages=2",
                            "all_reduce_q4:stages=1", "all_reduce_q4:stages=2", "all_reduce_q4_g4:stages=1",
                            "all_reduce_q4_g4:stages=2"}
    assert {row["op"] for row in rows} == expected
    assert sorted({row["size_bytes"] for row in rows}) == [4096, 16384]
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["wire_bytes"] is None
        bus_factor = 1.0 if row["op"].startswith("all_reduce") else 0.5  # nccl-tests': 2 (n-1)/n vs (n-1)/n
        assert row["time_us"] > 0 and row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor)
        quantized = row["op"] not in baselines
        assert (row["payload_bytes"] < row["logical_bytes"]) == quantized
