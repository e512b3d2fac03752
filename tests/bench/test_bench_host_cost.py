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

from bench.host_cost import calls as host_cost
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
    "all_reduce_q4": "dist.all_reduce",
    "all_reduce_q4 prepared": "all_reduce_q4",
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


def _row(name: str, launcher: str, host_us: float, synced_us: float) -> host_cost.Row:
    return host_cost.Row(name, 1 << 20, host_us, synced_us, "x.clone()", 10.0, 20.0, launcher=launcher)


def test_launchers_side_by_side_with_ratios_to_the_first() -> None:
    """The launcher table pairs each call's rows by name, size and yardstick and divides by the first launcher's."""
    rows = [_row("quantize int8", "cupy", 20.0, 40.0), _row("all_gather_q8", "cupy", 80.0, 100.0),
            _row("quantize int8", "driver", 10.0, 30.0), _row("all_gather_q8", "driver", 60.0, 90.0)]
    compared = host_cost._launcher_rows(rows, ["cupy", "driver"])
    assert [(c["name"], c["base"], c["cupy host_us"], c["driver host_us"]) for c in compared] == [
        ("quantize int8", "x.clone()", 20.0, 10.0), ("all_gather_q8", "x.clone()", 80.0, 60.0)]
    assert [c["driver/cupy host"] for c in compared] == [0.5, 0.75]
    assert [c["driver/cupy synced"] for c in compared] == [0.75, 0.9]
    assert host_cost._launcher_rows(rows[:2], ["cupy"]) == []
    table = host_cost.markdown(compared)
    assert table[0].startswith("| name | numel | base | cupy host_us | cupy synced_us | driver host_us")
    assert "| quantize int8 | 1048576 | x.clone() | 20.00 | 40.00 | 10.00 | 30.00 | 0.50 | 0.75 |" in table


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--launcher", "driver"], "needs --device cuda"),
])
def test_launcher_option_is_checked(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        host_cost._parse(argv)
    assert message in capsys.readouterr().err
