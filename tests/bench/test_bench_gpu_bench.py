"""``make gpu-bench`` (``python -m bench.gpu_check --bench``) on a CPU machine: the CPU part runs, the GPU
parts are planned right.

The host-cost tool is written by others; here a small stand-in with its declared CLI
(``--device {cpu,cuda} --sizes LIST --json PATH``) checks the wiring: the command the plan
builds, the JSON the report reads, the exit status. The GPU parts' commands are parsed by
the real tools' parsers, so a flag that does not exist fails here, not on a GPU lease.
"""

from __future__ import annotations

import os

import pytest
import torch

import bench.kernels as kernels
from bench.gpu_check import driver, report
from bench.gpu_check import speed_plan as plan
from bench.train import suite as train_cli
from bench.train.models import TinyGPT

_FAKE_HOST_COST = '''
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
parser.add_argument("--sizes", default="1M,16M")
parser.add_argument("--json", required=True)
args = parser.parse_args()
rows = [{"op": op, "size": size, "device": args.device, "host_us": 1.5, "sync_us": 2.25}
        for size in args.sizes.split(",") for op in ("quantize", "clone")]
json.dump({"rows": rows}, open(args.json, "w"))
print("measured", len(rows), "rows")
'''


@pytest.fixture
def fake_tool(tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "fake_host_cost.py").write_text(_FAKE_HOST_COST)
    monkeypatch.syspath_prepend(str(tools))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tools), os.environ.get("PYTHONPATH")])))
    return "fake_host_cost"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_on_a_cpu_machine_the_cpu_part_runs_and_the_exit_says_no_gpu(tmp_path, fake_tool):
    out = tmp_path / "bench"
    assert driver.main(["--bench", "--out", str(out)], host_cost=fake_tool) == driver.EXIT_NO_GPU
    text = (out / "report.md").read_text()
    assert text.startswith("# zcomm gpu-bench: COMPLETE, CPU part only (no GPU) (1 of 1 parts passed)")
    assert "| op | size | device | host_us | sync_us |" in text and "| quantize | 1M | cpu | 1.5 | 2.25 |" in text
    assert "16M" not in text.split("## Host cost")[1].split("## Kernel")[0]  # the CPU part stays small
    assert "(no GPU: not measured)" in text and f"| torch | {torch.__version__} |" in text
    assert sorted(p.name for p in out.iterdir()) == ["environment.json", "host-cost-cpu.log", "host_cost_cpu.json", "report.md"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_missing_tool_is_named_and_fails_the_run(tmp_path):
    out = tmp_path / "bench"
    assert driver.main(["--bench", "--out", str(out)], host_cost="no_such_tool_zcomm") == driver.EXIT_FAILED
    text = (out / "report.md").read_text()
    assert "INCOMPLETE" in text.splitlines()[0]
    assert "No module named no_such_tool_zcomm" in text  # the failed part's log tail


def _args(stage, module: str) -> list[str]:
    argv = list(stage.argv)
    return argv[argv.index(module) + 1 :]


def test_the_gpu_plan_fits_its_budget_and_its_commands_parse(tmp_path, fake_tool):
    stages = plan.plan(tmp_path, gpu=True, host_cost=fake_tool)
    names = [s.name for s in stages]
    assert names == ["host-cost-cuda", "train", "kernels", "kernel-variants"]
    assert sum(s.limit_s for s in stages) + 10 <= plan.TOTAL_BUDGET_S <= 4 * 60
    host = _args(stages[0], fake_tool)
    assert host[:4] == ["--device", "cuda", "--sizes", "1M,16M"] and host[4] == "--json"
    assert host[-2:] == ["--launcher", "cupy,driver"]
    train = train_cli.build_parser().parse_args(_args(stages[1], "bench.train"))
    configs, _, rounds = train_cli.chosen(train)
    assert [c.name for c in configs] == list(plan.TRAIN_CONFIGS)
    assert rounds.rounds == plan.TRAIN_ROUNDS >= 2 and rounds.baseline == "zero3"
    assert {name for pair in plan.TRAIN_PAIRS for name in pair} <= set(plan.TRAIN_CONFIGS)
    shape = train_cli.model_config(train)
    assert (shape.d_model, shape.n_layers, shape.n_heads, shape.seq_len, train.batch, train.dtype) == (1024, 12, 16, 512, 8, "bf16")
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyGPT(shape).parameters())
    assert 140e6 < params < 180e6
    sweep = kernels.build_parser().parse_args(_args(stages[2], "bench.kernels"))
    assert sweep.sweep and not sweep.quick and sweep.json.endswith("kernels.json")
    variants = kernels.build_parser().parse_args(_args(stages[3], "bench.kernels"))
    assert variants.variants and not variants.quick and variants.output.endswith("variants.md")


def test_the_variants_decisions_are_reported(tmp_path):
    (tmp_path / "variants.md").write_text("# Kernel variants on X\n\n## Decisions\n\n| row | decision |\n| a | **keep** |\n")
    assert report._tool_report(tmp_path, "variants", "variants.md") == [
        "", "### Decisions", "", "| row | decision |", "| a | **keep** |"]
    assert report._tool_report(tmp_path / "none", "variants", "variants.md") == ["(the variants part wrote no variants.md)"]


def test_report_tables_from_rows_and_training():
    assert report.rows_table([{"a": 1, "b": 0.123456}, {"a": 2, "c": None}]) == [
        "| a | b | c |", "|---|---|---|", "| 1 | 0.1235 | - |", "| 2 | - | - |"]


def test_training_table_gives_ratios_to_zero3(tmp_path):
    # A train.json written before rounds: one round, ratios of the medians.
    import json

    rows = [{"config": "zero3", "status": "ok", "median_step_s": 0.04, "val_loss": 2.5, "train_losses": [3.0, 2.6], "note": ""},
            {"config": "zeropp", "status": "ok", "median_step_s": 0.09, "val_loss": 2.51, "train_losses": [3.0, 2.61], "note": ""},
            {"config": "fsdp2", "status": "failed", "median_step_s": None, "val_loss": None, "train_losses": [], "note": "boom"}]
    (tmp_path / "train.json").write_text(json.dumps({"meta": {}, "results": rows}))
    table = report._training(tmp_path / "train.json")
    assert "| zero3 | ok | 1 | 40 | 40-40 | 1.000x | - | 2.5 | 2.6 |  |" in table
    assert "| zeropp | ok | 1 | 90 | 90-90 | 2.250x | - | 2.51 | 2.61 |  |" in table
    assert "| fsdp2 | failed | - | - | - | - | - | - | - | boom |" in table
    assert "| zeropp / zero3 | 2.250x | 2.250-2.250x | 1 | 2.250 |" in table
    assert "| fsdp2 / zero3 | - | - | 0 | fsdp2: no result |" in table


def test_training_table_pairs_ratios_by_round(tmp_path):
    # Round 2 ran everything slower; each ratio divides numbers of one round.
    import json

    def row(config, steps, diff=0.0):
        rounds = [{"round": r, "median_step_s": s} for r, s in enumerate(steps, 1)]
        return {"config": config, "status": "ok", "median_step_s": sorted(steps)[len(steps) // 2], "val_loss": 2.5,
                "train_losses": [3.0], "note": "", "rounds": rounds, "loss_max_diff": diff}

    rows = [row("zero3", [0.040, 0.080, 0.041]), row("fsdp2", [0.044, 0.084, 0.041], 2e-3),
            row("fsdp2-zeropp", [0.066, 0.126, 0.0615])]
    (tmp_path / "train.json").write_text(json.dumps({"meta": {}, "results": rows}))
    table = report._training(tmp_path / "train.json")
    assert "| fsdp2 | ok | 3 | 44 | 41-84 | 1.050x | 0.002 | 2.5 | 3 |  |" in table
    assert "| fsdp2 / zero3 | 1.050x | 1.000-1.100x | 3 | 1.100, 1.050, 1.000 |" in table
    assert "| fsdp2-zeropp / fsdp2 | 1.500x | 1.500-1.500x | 3 | 1.500, 1.500, 1.500 |" in table
    assert "| zeropp / zero3 | - | - | 0 | zeropp: no result |" in table


def test_host_cost_launchers_table_is_reported(tmp_path):
    import json

    compared = [{"name": "quantize int8", "numel": 1048576, "cupy host_us": 18.0, "driver host_us": 12.0,
                 "driver/cupy host": 0.667}]
    (tmp_path / "host_cost_cuda.json").write_text(json.dumps({"rows": [], "launchers": compared}))
    lines = report._host_cost(tmp_path, ["cuda"])
    assert "| name | numel | cupy host_us | driver host_us | driver/cupy host |" in lines
    assert "| quantize int8 | 1048576 | 18 | 12 | 0.667 |" in lines
    (tmp_path / "host_cost_cuda.json").write_text(json.dumps({"rows": [], "launchers": []}))
    assert not any("kernel launcher" in line for line in report._host_cost(tmp_path, ["cuda"]))
