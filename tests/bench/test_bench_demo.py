"""bench.demo: its summary arithmetic, the results it keeps (markdown, JSON, plot) and its
argument handling, on rows written here (the training runs themselves are benchmarks)."""

import json
from pathlib import Path

import pytest

from bench import demo
from bench.train.report import COLUMN_LEGEND


def _row(config, seconds, wire, status="ok", note=""):
    return {"config": config, "model": "tinygpt", "status": status, "note": note, "median_step_s": seconds,
            "wire_tx_bytes_per_step": wire, "tokens_per_s": None if seconds is None else 256 / seconds,
            "wire_time_s": None, "wire_fraction": None, "memory_bytes": None if seconds is None else 2**21,
            "first_loss": 5.4, "last_loss": 3.6, "val_loss": 3.5}  # fmt: skip


def test_summary_reports_speedup_and_wire_ratio_against_each_other_config():
    lines = demo.training_summary([_row("zero3", 0.9, 40e6), _row("zeropp", 0.3, 5e6), _row("fsdp2", 0.6, 40e6)])
    assert lines == [
        "zeropp vs zero3 : step time 3.00x faster, inter-node wire bytes 0.125x",
        "zeropp vs fsdp2 : step time 2.00x faster, inter-node wire bytes 0.125x",
    ]


def test_summary_without_wire_counters_or_zeropp():
    assert demo.training_summary([_row("zero3", 1.0, None), _row("zeropp", 0.5, None)]) == [
        "zeropp vs zero3 : step time 2.00x faster"
    ]
    assert demo.training_summary([_row("zero3", 1.0, 1.0), _row("zeropp", 0.5, 1.0, status="skipped")]) == [
        "zeropp did not run: no comparison"
    ]


def test_summary_compares_our_stage3_with_deepspeed_and_names_only_unexpected_failures():
    expected = _row("deepspeed-zeropp", None, None, status="expected failure", note="CUDA-only (it raised X)")
    broken = _row("fsdp2", None, None, status="failed", note="fully_shard raised ValueError: x")
    lines = demo.training_summary(
        [_row("zero3", 1.2, 40e6), _row("zeropp", 0.2, 5e6), _row("deepspeed-z3", 1.0, 30e6), expected, broken]
    )
    assert lines == [
        "zeropp vs zero3 : step time 6.00x faster, inter-node wire bytes 0.125x",
        "zeropp vs deepspeed-z3: step time 5.00x faster, inter-node wire bytes 0.167x",
        "zero3 vs deepspeed-z3: step time 1.20x slower, inter-node wire bytes 1.333x",
        "not run: fsdp2 (failed); the table says why",  # the expected failure is in its table row only
    ]


@pytest.mark.parametrize("argv", [["bogus"], ["training", "collectives"]])
def test_unknown_job_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2 and "usage" in capsys.readouterr().err


def test_demo_trains_deepspeed_and_its_zeropp_keys_alongside_ours():
    assert {"zero3", "zeropp", "fsdp2", "deepspeed-z3", "deepspeed-zeropp"} <= set(demo.TRAIN_CONFIGS)
    assert "--dtype" not in demo.TRAINING  # bench.train's auto precision decides, and says why


def _payload(rows):
    meta = {"num_nodes": 2, "local_size": 2, "link_bytes_per_s": 24.5e6, "cpu": "Test CPU", "device": "cpu",
            "torch": "2.13.0+cpu", "deepspeed": None, "precision": "fp32", "precision_reason": "auto: no bf16",
            "params": {"tinygpt": 3_241_472}, "args": {"batch": 4, "seq_len": 64, "steps": 20, "warmup": 3}}
    return {"meta": meta, "results": rows}


def test_kept_results_hold_the_table_every_column_explained_the_ratios_and_a_plot(tmp_path):
    rows = [_row("zero3", 0.9, 40e6), _row("zeropp", 0.3, 5e6),
            _row("deepspeed-zeropp", None, None, status="expected failure", note="CUDA-only (it raised X)")]
    (tmp_path / "train.json").write_text(json.dumps(_payload(rows)))
    summary = demo.keep_results(tmp_path, "make demo")
    assert summary == ["zeropp vs zero3 : step time 3.00x faster, inter-node wire bytes 0.125x"]
    text = (tmp_path / "results.md").read_text()
    assert "| zeropp | 300.0 | 853 | 5.000 | n/a | n/a | 2.00 | 5.4000 | 3.6000 | 3.5000 |" in text
    assert "| deepspeed-zeropp | expected failure: CUDA-only (it raised X) |" in text
    assert text.count("expected failure") == 1  # said once
    for line in COLUMN_LEGEND:
        assert f"- {line}" in text
    header = next(line for line in text.splitlines() if line.startswith("| config"))
    explained = " ".join(COLUMN_LEGEND)
    for column in header.strip("| ").split(" | "):
        assert column.split()[0] in explained, column  # every column has its line
    assert "196 Mbit/s measured" in text and "Test CPU" in text and "3,241,472 parameters" in text
    assert "- zeropp vs zero3 : step time 3.00x faster" in text
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_names_the_folder_it_kept_and_says_the_results_are_there(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_run(argv):  # stands in for the launch: bench.train writes its JSON where it is told
        launched.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(_payload([_row("zero3", 0.9, 4e7),
                                                                             _row("zeropp", 0.3, 5e6)])))
        return 0

    monkeypatch.setattr(demo, "_run", fake_run)
    monkeypatch.setattr(demo, "missing_prerequisite", lambda: None)
    assert demo.main(["--out", str(tmp_path / "kept")]) == 0
    out = capsys.readouterr().out
    kept = (tmp_path / "kept").resolve()
    assert f"results go to {kept}" in out
    assert f"# results kept in {kept}/: train.json, results.md, demo.png" in out
    assert "--plot-dir" in launched[0] and str(kept) == launched[0][launched[0].index("--plot-dir") + 1]


def test_a_failed_run_keeps_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "_run", lambda argv: 3)
    monkeypatch.setattr(demo, "missing_prerequisite", lambda: None)
    assert demo.main(["--out", str(tmp_path)]) == 3
    assert "the training run failed (status 3)" in capsys.readouterr().err


def test_default_folder_is_new_per_run_and_names_its_utc_time():
    assert demo.default_out_dir(0.0) == Path("demo-results/19700101-000000Z")
