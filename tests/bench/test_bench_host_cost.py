"""bench.host_cost on CPU: every row next to its yardstick, ratios from the same run, the JSON.

A smoke run at one small size with a tiny time budget, in a subprocess (the benchmark makes
its own one-rank process group). The numbers are not checked, only that each row was
measured (positive times) and that the ratios are those of the printed times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cuda_support import REPO

EXPECTED_ROWS = {
    "quantize int8": "x.clone()",
    "dequantize int8 x4": "x.clone()",
    "reorder_quantize int4 4 chunks": "x.clone()",
    "dequant_reduce int4 x4": "x.clone()",
    "dequant_reduce requant int4 x4": "x.clone()",
    "all_gather_q8": "dist.",
    "reduce_scatter_q4 1 stage": "dist.",
    "reduce_scatter_q4 4 stages": "dist.",
}


def test_cpu_run_measures_every_row(tmp_path) -> None:
    report = tmp_path / "host.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.host_cost", "--device", "cpu", "--sizes", "1K", "--budget", "0.01",
         "--min-calls", "2", "--json", str(report), "--profile", str(tmp_path / "profile.txt")],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(report.read_text())["rows"]
    found = {}
    for row in rows:
        assert row["host_us"] > 0 and row["synced_us"] > 0 and row["base_host_us"] > 0, row
        assert row["host_ratio"] == pytest.approx(row["host_us"] / row["base_host_us"])
        found.setdefault(row["name"], []).append(row["base"])
    for name, base in EXPECTED_ROWS.items():
        assert any(b.startswith(base) for b in found[name]), (name, found.get(name))
    assert "reduce_scatter_q4 1 stage" in found["reduce_scatter_q4 4 stages"]
    assert "quantize int8" in done.stdout and "# targets" in done.stdout
    profile = (tmp_path / "profile.txt").read_text()
    for name in ("all_gather_q8", "reduce_scatter_q4 1 stage", "reduce_scatter_q4 4 stages"):
        assert f"## {name}, 1K elements, 100 calls" in profile
