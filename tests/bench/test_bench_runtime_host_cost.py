"""``python -m bench.host_cost --runtime`` runs, prints a row per configuration and writes what it measured."""

from __future__ import annotations

import json

from bench.host_cost import runtime as runtime_host_cost


def test_prints_a_row_per_config_and_writes_the_counts(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert runtime_host_cost.main(["--configs", "zero3", "zeropp", "--layers", "4", "--width", "8", "--warmup", "2",
                                   "--steps", "2", "--rounds", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| zero3 |" in printed and "| zeropp |" in printed and "beyond zero3" in printed
    results = json.loads(out.read_text())["results"]
    assert len(results["zeropp"]["step_ms"]) == 2
    # 4 units: a forward gather each (qwZ's chain on zcomm's worker), a bucket each (qgZ's)
    assert results["zeropp"]["functions"]["worker all_gather_q8.py:_chain"] == 4
    assert results["zeropp"]["functions"]["worker reduce_scatter_q4.py:_chain"] == 4
    assert results["zero3"]["calls"]["forward"]["main"] > 0 and "worker" not in results["zero3"]["calls"]["forward"]
