"""The link-rate sweep's report from fake measurements (no launches), and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.train import sweep
from bench.train.sweep import claim_pairs, claim_verdict, load_runs, markdown_table

RATES = ("100mbit", "200mbit", "400mbit", "800mbit", "1600mbit", "unlimited")


def _model_step_s(config: str, bps: float) -> float:
    """A fake but shaped like the real thing: compute plus bytes over the link."""
    compute, wire_bytes = {"zero3": (0.5, 40e6), "zeropp": (0.5, 5e6), "fsdp2": (0.6, 40e6)}[config]
    return compute + wire_bytes * 8 / bps


def _result(rate: str, link_bps: float, configs: dict[str, str]) -> dict:
    rows = []
    for config, status in configs.items():
        if status != "ok":
            rows.append({"config": config, "model": "tinygpt", "status": status, "note": f"{config} is missing"})
            continue
        step = _model_step_s(config, link_bps)
        wire = {"zero3": 40e6, "zeropp": 5e6, "fsdp2": 40e6}[config]
        rows.append({"config": config, "model": "tinygpt", "status": "ok", "note": "", "median_step_s": step,
                     "wire_tx_bytes_per_step": wire, "wire_fraction": wire * 8 / link_bps / step})
    meta = {"link_bytes_per_s": link_bps / 8, "cpu": "AMD EPYC", "device": "cpu", "torch": "2.13.0+cpu",
            "deepspeed": None, "precision": "fp32", "precision_reason": "auto: no native bf16",
            "num_nodes": 2, "local_size": 2, "params": {"tinygpt": 3_300_000},
            "args": {"batch": 4, "seq_len": 64, "steps": 10, "warmup": 3}}
    return {"meta": meta, "results": rows}


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    configs = {"zero3": "ok", "zeropp": "ok", "fsdp2": "ok", "deepspeed-z3": "skipped"}
    for rate in RATES:
        bps = 5e9 if rate == "unlimited" else 0.97 * float(rate.removesuffix("mbit")) * 1e6
        (tmp_path / f"rate-{rate}-run1.json").write_text(json.dumps(_result(rate, bps, configs)))
    (tmp_path / "sweep.md").write_text("Command:\n\n    python -m bench.train.sweep --out-dir X\n")
    return tmp_path


def _runs(directory: Path):
    return load_runs({rate: sorted(directory.glob(f"rate-{rate}-run*.json")) for rate in RATES})


def test_runs_are_ordered_by_rate_with_unlimited_last(sweep_dir: Path) -> None:
    assert [run.rate for run in _runs(sweep_dir)] == list(RATES)


def test_table_has_every_rate_and_config_and_the_skip_note(sweep_dir: Path) -> None:
    table = markdown_table(_runs(sweep_dir))
    header, rule, *rows = table.splitlines()
    assert header.startswith("| config | 100mbit (97) | 200mbit (194) |") and "unlimited (5000)" in header
    zero3 = next(row for row in rows if row.startswith("| `zero3` |"))
    # zero3 at 100 Mbit/s (97 measured): 0.5 s compute + 40 MB at 97 Mbit/s.
    step_ms = 1e3 * _model_step_s("zero3", 97e6)
    assert f"| {step_ms:.0f} (" in zero3 and zero3.endswith("| 40-40 |")
    assert "| `deepspeed-z3` | skipped | skipped |" in table
    assert "- `deepspeed-z3`: deepspeed-z3 is missing" in table


def test_claim_pairs_compare_zeropp_with_the_baseline_at_four_times_the_rate(sweep_dir: Path) -> None:
    pairs = claim_pairs(_runs(sweep_dir), "zero3")
    assert [(pair.slow, pair.fast) for pair in pairs] == [("100mbit", "400mbit"), ("200mbit", "800mbit"),
                                                          ("400mbit", "1600mbit")]  # fmt: skip
    first = pairs[0]
    assert first.ratio == pytest.approx(_model_step_s("zeropp", 97e6) / _model_step_s("zero3", 388e6))
    # zeropp sends 8x fewer bytes: zero3 needs about 8x the rate to match it (log-log
    # interpolation between measured points overestimates a little on this convex curve).
    sign, rate = first.equivalent
    assert sign == "=" and 7.5 < rate / 97e6 < 9.5
    # With equal compute, zeropp @ r against zero3 @ 4r is a win: the claim holds.
    verdict = claim_verdict(_runs(sweep_dir), tolerance=0.10)
    assert "against `zero3`: **holds** (3 of 3 pairs)" in verdict
    assert "against `deepspeed-z3`: no (r, 4r) pair where both ran: not checked" in verdict


def test_claim_fails_when_zeropp_is_no_faster(sweep_dir: Path) -> None:
    for path in sweep_dir.glob("rate-*-run*.json"):
        result = json.loads(path.read_text())
        steps = {row["config"]: row for row in result["results"]}
        steps["zeropp"]["median_step_s"] = steps["zero3"]["median_step_s"]
        path.write_text(json.dumps(result))
    verdict = claim_verdict(_runs(sweep_dir), tolerance=0.10)
    assert "against `zero3`: **does not hold** (0 of 3 pairs)" in verdict
    assert "zero3 needs 1.0x the link rate" in verdict


def test_a_second_launch_keeps_the_best_median_per_cell_and_lists_all(sweep_dir: Path) -> None:
    first = json.loads((sweep_dir / "rate-200mbit-run1.json").read_text())
    slower = json.loads(json.dumps(first))
    slower["meta"]["link_bytes_per_s"] *= 1.1
    for row in slower["results"]:
        if row["status"] == "ok":
            row["median_step_s"] *= 2 if row["config"] == "zero3" else 0.5
    (sweep_dir / "rate-200mbit-run2.json").write_text(json.dumps(slower))
    runs = _runs(sweep_dir)
    run = next(run for run in runs if run.rate == "200mbit")
    zero3 = _model_step_s("zero3", 194e6)
    assert run.rows()["zero3"]["median_step_s"] == pytest.approx(zero3)
    assert run.rows()["zeropp"]["median_step_s"] == pytest.approx(_model_step_s("zeropp", 194e6) / 2)
    assert run.all_steps("zero3") == pytest.approx([zero3, 2 * zero3])
    assert run.link_bps == pytest.approx(194e6 * 1.05)
    table = markdown_table(runs)
    assert "Cells: best of 2 launches' median step ms" in table
    assert f"| {zero3 * 1e3:.0f} / {2 * zero3 * 1e3:.0f} |" in table


def test_from_json_writes_the_report_and_a_log_log_plot(sweep_dir: Path) -> None:
    assert sweep.main(["--from-json", "--out-dir", str(sweep_dir)]) == 0
    report = (sweep_dir / "sweep.md").read_text()
    assert "python -m bench.train.sweep --out-dir X" in report
    assert "hardware: AMD EPYC" in report and "precision: fp32" in report
    assert (sweep_dir / "step_time_vs_link_rate.png").stat().st_size > 0


def test_launch_command_runs_bench_train_on_the_simulated_cluster(tmp_path: Path) -> None:
    args = sweep.build_parser().parse_args(["--out-dir", str(tmp_path), "--", "--steps", "5"])
    command = sweep.launch_command("200mbit", 2, ["zero3", "zeropp"], args)
    assert command[1:9] == ["-m", "bench.simcluster", "--num-nodes", "2", "--local-size", "2", "--rate", "200mbit"]
    tail = command[command.index("--") + 1:]
    assert tail[1:] == ["-m", "bench.train", "--configs", "zero3", "zeropp", "--steps", "5", "--json",
                        str(tmp_path / "rate-200mbit-run2.json")]  # fmt: skip


@pytest.mark.parametrize("argv", [["--rates", "fast"], ["--configs", "zero9"]])
def test_bad_rates_and_configs_are_usage_errors(tmp_path: Path, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        sweep.main([*argv, "--out-dir", str(tmp_path), "--from-json"])
    assert info.value.code == 2
