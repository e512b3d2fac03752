"""``python -m bench.train.convergence``: gaps per seed, seed statistics, the files it writes."""

from __future__ import annotations

import json
import statistics

import pytest

from bench.train.convergence import gap_percent, load_runs, main, seed_summaries


def _write(path, seed, rows):
    results = [{"config": name, "status": "ok", "val_curve": [[50, curve[0]], [100, curve[1]]]}
               for name, curve in rows.items()]
    path.write_text(json.dumps({"meta": {"args": {"seed": seed}}, "results": results}))
    return path


def test_gaps_are_per_seed_and_seed_statistics_are_sample_ones(tmp_path):
    a = _write(tmp_path / "s0.json", 0, {"zero3": (3.0, 2.0), "zeropp": (3.1, 2.02)})
    b = _write(tmp_path / "s1.json", 1, {"zero3": (3.0, 2.2), "zeropp": (3.1, 2.2)})
    runs = load_runs([a, b])
    gaps = {(r.config, r.seed): gap_percent(r, runs) for r in runs}
    assert gaps[("zeropp", 0)] == pytest.approx(1.0)
    assert gaps[("zeropp", 1)] == pytest.approx(0.0)
    summary = {s.config: s for s in seed_summaries(runs)}
    assert summary["zero3"].mean == pytest.approx(2.1)
    assert summary["zero3"].stdev == pytest.approx(statistics.stdev([2.0, 2.2]))
    main([str(a), str(b), "--out-dir", str(tmp_path / "out")])
    text = (tmp_path / "out" / "convergence.md").read_text()
    assert "| zeropp | 0 | 3.1000 | 2.0200 | +1.00% |" in text
    assert (tmp_path / "out" / "val_loss_vs_step.png").stat().st_size > 0


def test_a_configuration_twice_for_one_seed_is_an_error(tmp_path):
    a = _write(tmp_path / "a.json", 0, {"zero3": (3.0, 2.0)})
    b = _write(tmp_path / "b.json", 0, {"zero3": (3.0, 2.0)})
    with pytest.raises(ValueError, match="zero3 seed 0 appears in more than one file"):
        load_runs([a, b])
