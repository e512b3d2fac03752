"""bench.demo's summary arithmetic and argument handling (the runs themselves are benchmarks)."""

import pytest

from bench import demo


def _row(config, seconds, wire, status="ok"):
    return {"config": config, "status": status, "median_step_s": seconds, "wire_tx_bytes_per_step": wire}


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


@pytest.mark.parametrize("argv", [["bogus"], ["training", "collectives"]])
def test_unknown_job_is_a_usage_error(argv, capsys):
    assert demo.main(argv) == 2
    assert "usage" in capsys.readouterr().err


def test_summary_compares_our_stage3_with_deepspeed_and_says_why_rows_did_not_run():
    failed = dict(_row("deepspeed-zeropp", None, None, status="failed"),
                  note="deepspeed.initialize raised ValueError: x")  # fmt: skip
    lines = demo.training_summary(
        [_row("zero3", 1.2, 40e6), _row("zeropp", 0.2, 5e6), _row("deepspeed-z3", 1.0, 30e6), failed]
    )
    assert lines == [
        "zeropp vs zero3 : step time 6.00x faster, inter-node wire bytes 0.125x",
        "zeropp vs deepspeed-z3: step time 5.00x faster, inter-node wire bytes 0.167x",
        "zero3 vs deepspeed-z3: step time 1.20x slower, inter-node wire bytes 1.333x",
        "deepspeed-zeropp failed: deepspeed.initialize raised ValueError: x",
    ]


def test_demo_trains_deepspeed_and_its_zeropp_keys_alongside_ours():
    assert {"zero3", "zeropp", "fsdp2", "deepspeed-z3", "deepspeed-zeropp"} <= set(demo.TRAIN_CONFIGS)
    assert "--dtype" not in demo.TRAINING  # bench.train's auto precision decides, and says why
