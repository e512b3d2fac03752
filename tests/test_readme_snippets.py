"""The README's two snippets run as written, on 2 gloo ranks under torchrun.

Each ```python block of README.md that calls ``init_process_group`` is written to a file and
launched with ``torchrun --nproc-per-node 2``, once as one node and once as two nodes of
one rank (``ZCOMM_LOCAL_SIZE=1``), so the inter-node paths run too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNIPPETS = [block for block in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
            if "init_process_group" in block]  # fmt: skip


def test_the_readme_has_a_collectives_and_a_runtime_snippet():
    assert len(SNIPPETS) == 2
    assert "zcomm.reduce_scatter_q4" in SNIPPETS[0] and "zero_runtime.initialize" in SNIPPETS[1]


@pytest.mark.slow
@pytest.mark.parametrize("local_size", ["2", "1"])
@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=["collectives", "runtime"])
def test_snippet_runs_as_written_on_two_gloo_ranks(index, local_size, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(SNIPPETS[index])
    env = dict(os.environ, ZCOMM_LOCAL_SIZE=local_size, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if index == 0:  # every rank prints its byte counts: across nodes only when there are two
        crossed = re.findall(r"inter_bytes=(\d+)", result.stdout)
        assert len(crossed) == 4 and all((int(b) > 0) == (local_size == "1") for b in crossed), result.stdout
    else:
        assert result.stdout.count("MemoryReport") == 2 and "MiB" in result.stdout
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
        assert len(losses) == 2 and all(0 < loss < 2 for loss in losses), result.stdout
