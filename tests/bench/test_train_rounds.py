"""``bench.train --rounds``: the round order, the pairing of ratios, the loss check and the rounds table.

Pure functions on made-up rounds (no training): a launch of 2 configurations x 2 rounds is
in test_bench_train_smoke.py.
"""

from __future__ import annotations

import pytest

from bench.harness.precision import Precision
from bench.train.loop import ConfigResult
from bench.train.report import RunFacts, format_report
from bench.train.rounds import RoundPlan, attach_ratios, combine, paired_ratios, round_record
from bench.train.suite import build_parser, chosen


def _record(round: int, step_s: float, *, losses=(3.0, 2.5), wire=None, memory=100) -> dict:
    run = ConfigResult(config="x", model="tinygpt", median_step_s=step_s, step_times_s=[9.0, step_s],
                       wire_tx_bytes_per_step=wire, wire_rx_bytes_per_step=wire, wire_busiest_bytes_per_step=wire,
                       memory_bytes=memory, train_losses=list(losses), val_curve=[(2, losses[-1] + 0.25)])  # fmt: skip
    return round_record(run, round=round, position=0)


def _row(config: str, records: list[dict], model: str = "tinygpt") -> ConfigResult:
    first = ConfigResult(config=config, model=model, median_step_s=records[0]["median_step_s"],
                         train_losses=records[0]["train_losses"], val_curve=records[0]["val_curve"])  # fmt: skip
    return combine(first, records, tokens_per_step=64, link_bytes_per_s=None)


def _facts(device: str) -> RunFacts:
    return RunFacts(cpu="test cpu", device=device, precision=Precision("fp32", "asked"), link_bytes_per_s=None,
                    deepspeed=None, engine_configs={})  # fmt: skip


def test_rounds_alternate_forward_and_backward() -> None:
    plan = RoundPlan(rounds=4, baseline="b", configs=("a", "b", "c"))
    assert [plan.order(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["c", "b", "a"]] * 2
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        RoundPlan(rounds=0, baseline="a", configs=("a",))
    with pytest.raises(ValueError, match="--baseline 'x' is not one of"):
        RoundPlan(rounds=2, baseline="x", configs=("a", "b"))


def test_cli_baseline_defaults_to_the_first_configuration() -> None:
    args = build_parser().parse_args(["--configs", "fsdp2", "zero3"])
    assert chosen(args)[2] == RoundPlan(rounds=1, baseline="fsdp2", configs=("fsdp2", "zero3"))
    args = build_parser().parse_args(["--configs", "fsdp2", "zero3", "--rounds", "3", "--baseline", "zero3"])
    assert chosen(args)[2].baseline == "zero3"


def test_ratios_pair_the_same_round() -> None:
    # Round 2 ran everything twice as slow: unpaired medians would mix it in, paired ones cancel it.
    base = _row("zero3", [_record(1, 1.0), _record(2, 2.0), _record(3, 1.0)])
    other = _row("zeropp", [_record(1, 1.1), _record(2, 2.4), _record(3, 1.05)])
    assert paired_ratios({1: 1.1, 2: 2.4, 3: 1.05}, {1: 1.0, 3: 1.0}) == pytest.approx([1.1, 1.05])
    rows = [base, other]
    attach_ratios(rows, "zero3")
    assert other.paired_ratios == pytest.approx([1.1, 1.2, 1.05])
    assert other.ratio_to_baseline == pytest.approx(1.1)
    assert (other.ratio_min, other.ratio_max) == pytest.approx((1.05, 1.2))
    assert base.paired_ratios == [1.0, 1.0, 1.0] and base.baseline == "zero3"
    # Over rounds the step is the median of the rounds' medians, with their range.
    assert (other.median_step_s, other.min_step_s, other.max_step_s) == (1.1, 1.05, 2.4)
    assert other.tokens_per_s == pytest.approx(64 / 1.1)


def test_ratios_stay_within_a_model_and_skip_failed_rows() -> None:
    rows = [_row("zero3", [_record(1, 1.0)], "tinygpt"), _row("zeropp", [_record(1, 3.0)], "tinygpt"),
            _row("zero3", [_record(1, 2.0)], "hf-gpt2"), _row("zeropp", [_record(1, 3.0)], "hf-gpt2"),
            ConfigResult(config="fsdp2", model="tinygpt", status="failed", note="boom")]  # fmt: skip
    attach_ratios(rows, "zero3")
    assert [row.ratio_to_baseline for row in rows] == [1.0, 3.0, 1.0, 1.5, None]


def test_combined_wire_and_memory() -> None:
    row = combine(
        ConfigResult(config="zeropp", model="tinygpt", median_step_s=2.0),
        [_record(1, 2.0, wire=100.0, memory=5), _record(2, 1.0, wire=104.0, memory=7), _record(3, 4.0, wire=101.0)],
        tokens_per_step=8,
        link_bytes_per_s=50.0,
    )
    assert row.wire_tx_bytes_per_step == row.wire_busiest_bytes_per_step == 101.0 and row.memory_bytes == 100
    assert row.wire_time_s == pytest.approx(101.0 / 50.0) and row.wire_fraction == pytest.approx(101.0 / 50.0 / 2.0)
    no_wire = combine(ConfigResult(config="zero3", model="tinygpt", median_step_s=1.0),
                      [_record(1, 1.0), _record(2, 1.0)], tokens_per_step=8, link_bytes_per_s=50.0)  # fmt: skip
    assert no_wire.wire_tx_bytes_per_step is None and no_wire.wire_time_s is None


def test_rounds_that_disagree_are_flagged() -> None:
    same = _row("zero3", [_record(1, 1.0), _record(2, 1.0)])
    differs = _row("zeropp", [_record(1, 1.0), _record(2, 1.0, losses=(3.0, 2.5 + 3e-6))])
    assert same.loss_max_diff == 0.0 and differs.loss_max_diff == pytest.approx(3e-6)
    assert _row("fsdp2", [_record(1, 1.0)]).loss_max_diff is None  # one round: nothing to compare
    rows = [same, differs]
    attach_ratios(rows, "zero3")
    text = format_report(rows, _facts("cpu"), rounds=2, baseline="zero3").splitlines()
    table = text[text.index(next(l for l in text if l.startswith("over 2 rounds"))) + 2 :]
    assert table[0].split() == ["zero3", "tinygpt", "2", "1000.0", "1000.0", "1000.0", "1.000x", "1.000-1.000x", "0"]
    assert table[1].split()[-2:] == ["3e-06", "!"]
    flagged = [l for l in text if l.startswith("! ")]
    assert len(flagged) == 1 and flagged[0].startswith("! zeropp (tinygpt): its rounds trained different losses")
    assert "something in this run is not deterministic" in flagged[0]
    on_gpu = format_report(rows, _facts("cuda:0"), rounds=2, baseline="zero3")
    assert "nondeterministic kernels" in on_gpu


def test_one_round_prints_the_table_of_before() -> None:
    rows = [_row("zero3", [_record(1, 1.0)])]
    text = format_report(rows, _facts("cpu"))
    assert "ratios paired" not in text and "loss diff" not in text and "ratio range" not in text


def test_suite_runs_rounds_in_alternating_order_and_stops_a_failed_configuration(monkeypatch) -> None:
    from types import SimpleNamespace

    from bench.train import suite
    from bench.train.configs import select_configs
    from bench.train.models import GPTConfig

    ran = []

    def fake_run_once(launch, config, model, spec, label):
        ran.append((config.name, label))
        index = sum(name == config.name for name, _ in ran)  # this configuration's round
        if config.name == "fsdp2" and index == 2:
            return ConfigResult(config=config.name, model=model, status="failed", note="boom")
        step = {"zero3": 1.0, "fsdp2": 1.5}[config.name] * index
        return ConfigResult(config=config.name, model=model, median_step_s=step, step_times_s=[step],
                            train_losses=[3.0], val_curve=[(1, 2.0)])  # fmt: skip

    monkeypatch.setattr(suite, "run_once", fake_run_once)
    configs = select_configs(["zero3", "fsdp2"])
    plan = RoundPlan(rounds=3, baseline="zero3", configs=("zero3", "fsdp2"))
    shape = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    launch = SimpleNamespace(settings=SimpleNamespace(batch=2, seq_len=8), facts=SimpleNamespace(link_bytes_per_s=None))
    rows, params = suite.run_rounds(launch, ["tinygpt"], shape, configs, plan)
    assert ran == [("zero3", "tinygpt: zero3 (round 1 of 3)"), ("fsdp2", "tinygpt: fsdp2 (round 1 of 3)"),
                   ("fsdp2", "tinygpt: fsdp2 (round 2 of 3)"), ("zero3", "tinygpt: zero3 (round 2 of 3)"),
                   ("zero3", "tinygpt: zero3 (round 3 of 3)")]  # fmt: skip
    zero3, fsdp2 = rows
    assert [(r["round"], r["position"]) for r in zero3.rounds] == [(1, 0), (2, 1), (3, 0)]
    assert zero3.median_step_s == 2.0 and zero3.ratio_to_baseline == 1.0
    assert fsdp2.status == "failed" and fsdp2.note == "round 2 of 3: boom"
    assert [r["round"] for r in fsdp2.rounds] == [1] and fsdp2.ratio_to_baseline is None
    assert params["tinygpt"] > 0
