"""bench.kernels: the copy-of-the-same-bytes yardstick, the GPU targets, the device/backend choice, the
modes of the one entry point and the variants' decision table.

Timings are measurements: nothing here asserts how fast anything is.
"""

from __future__ import annotations

import pytest
import torch

import bench.kernels as cli
from bench.kernels import eager as kernels
from bench.kernels import sweep as kernels_sweep
from bench.kernels import variants

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_vs_copy_is_the_bandwidth_ratio():
    row = kernels.Row("cuda", "quantize INT8", seconds=2e-3, nbytes=6_000_000, copy_seconds=1.5e-3)
    assert row.gbps == pytest.approx(3.0)
    assert row.vs_copy == pytest.approx(0.75)  # 3 GB/s against the copy's 4 GB/s


def test_copy_yardstick_moves_the_same_bytes_and_is_cached(monkeypatch):
    timer = kernels._Timer(repeats=1)
    copied = []
    real = timer.seconds

    def seconds(fn, **kwargs):
        copied.append(fn.func.__self__.numel() + fn.args[0].numel())  # target + source bytes
        return real(fn, **kwargs)

    monkeypatch.setattr(timer, "seconds", seconds)
    timer.copy_seconds(1000)
    timer.copy_seconds(1000)
    assert copied == [1000]


def test_the_default_mode_measures_the_cpu_backends_only(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--backends", "cuda", "--numel", "64"])
    assert "'cuda' does not run on the CPU: the GPU's kernels are measured by --sweep" in capsys.readouterr().err


def test_cpu_targets_come_from_this_runs_medians():
    rows = [kernels.Row("torch", "clone", 1.0, 10, 1.0), kernels.Row("torch", "copy_ (preallocated)", 0.5, 10, 1.0),
            kernels.Row("cpu", "quantize INT8", 1.2, 10, 1.0), kernels.Row("reference", "quantize INT8", 6.0, 10, 1.0)]
    assert kernels._target_lines(rows, "fp32") == [
        "| fp32 cpu quantize INT8 time / clone time | 1.20 | <= 1.5 | PASS |",
        "| fp32 reference / cpu quantize INT8 time (speedup) | 5.00 | >= 4 | PASS |",
        "| fp32 (info, no target) cpu quantize INT8 time / copy_ time | 2.40 | - | - |",
    ]


def test_small_cpu_run_reports_every_op_against_a_copy(tmp_path):
    out = tmp_path / "k.md"
    report = cli.main(["--numel", "4096", "--group-size", "32", "--backends", "reference",
                           "--dtype", "fp32", "bf16", "--repeats", "2", "--output", str(out)])  # fmt: skip
    assert out.read_text() == "\n".join(report) + "\n"
    rows = [line for line in report if line.startswith("| cpu |")]
    assert len(rows) == 2 * (2 + 10)  # per dtype: clone, copy_, five ops at INT8 and INT4
    assert all(line.endswith("% |") for line in rows)
    assert "| device | dtype | backend | op | median ms | GB/s | vs copy |" in report
    assert report[-2:] == ["| target (this run) | measured | target | result |", "|---|---:|---|---|"]  # no cpu backend: no targets


def test_sweep_flags_need_the_sweep(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--quick"])
    assert "--quick and --json go with --sweep or --variants" in capsys.readouterr().err


def test_one_mode_at_a_time(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--sweep", "--variants"])
    assert "not allowed with argument" in capsys.readouterr().err


@NO_GPU
@pytest.mark.parametrize("mode", ["--sweep", "--variants", "--ncu"])
def test_gpu_modes_without_a_gpu_are_an_error(mode):
    with pytest.raises(SystemExit, match="sees no GPU"):
        cli.main([mode])


def test_sweep_covers_every_op_with_its_bytes():
    """Per dtype 6 rows (quantize, dequantize, reorder_quantize at INT8 and INT4); the reductions
    (payloads in, fp32 or payloads out) once per size, with the fp32 rows."""
    n, gs = 1 << 12, 256
    fp32 = kernels_sweep.op_specs(n, torch.float32, gs)
    bf16 = kernels_sweep.op_specs(n, torch.bfloat16, gs)
    assert len(bf16) == 6 and len(fp32) == 10
    bytes_of = {label: nbytes for _, label, nbytes, _ in fp32}
    p8 = kernels.q.payload_nbytes(n, 8, gs)
    assert bytes_of["quantize INT8"] == 4 * n + p8 == bytes_of["dequantize INT8"]
    assert bytes_of["dequant_reduce INT8 k=4 -> fp32"] == 4 * p8 + 4 * n
    assert {label: nbytes for _, label, nbytes, _ in bf16}["quantize INT4"] == 2 * n + kernels.q.payload_nbytes(n, 4, gs)
    assert {family for family, *_ in fp32} == set(kernels_sweep.TARGETS)


def test_sweep_report_marks_each_row_against_its_target():
    rows = [
        dict(numel=16 << 20, group_size=256, dtype="bf16", family="quantize", op="quantize INT8", bytes=100,
             seconds=1e-5, gbps=10.0, copy_gbps=11.0, vs_copy=10 / 11, target=0.85),
        dict(numel=16 << 20, group_size=512, dtype="fp32", family="dequant_reduce", op="dequant_reduce INT4", bytes=100,
             seconds=1e-5, gbps=6.0, copy_gbps=10.0, vs_copy=0.6, target=0.70),
    ]
    lines = kernels_sweep.report(rows, 12.0, "Some GPU")
    assert lines[-1] == "1 of 2 rows meet their target; 1 miss."
    assert lines[4].endswith("| 91% | >= 85% | PASS |") and lines[5].endswith("| 60% | >= 70% | MISS |")


def _variant_rows(ratios: dict[str, list[float]], problem: str | None = None) -> list[dict]:
    rows = []
    for name, values in ratios.items():
        cases = [{"shape": f"16M s{i}", "variant us": 10.0, "simpler us": 10.0 * r, "ratio": r,
                  "variant kernels": ["zc_a"], "simpler kernels": ["zc_b"]} for i, r in enumerate(values)]
        if problem:
            cases.append({"shape": "16M broken", "problem": problem})
        rows.append({"row": name, "cases": cases})
    return rows


def test_variant_decision_keeps_only_a_10_percent_win(monkeypatch):
    """The decision is the geometric mean of the shapes' ratios against 1.10; a case with a problem
    leaves its row undecided instead of deciding on the other shapes."""
    monkeypatch.setattr(variants, "ROWS", tuple(
        variants.Row(name, lambda n, name=name: [name]) for name in ("wins", "ties", "broken")))
    ratios = {"wins": [1.2, 1.05], "ties": [1.09, 1.1]}

    def measure_case(case: str, host: bool) -> dict:
        if case == "broken":
            return {"shape": case, "problem": "outputs differ"}
        ratio = ratios[case].pop(0)
        return {"shape": case, "variant us": 1.0, "simpler us": ratio, "ratio": ratio}

    monkeypatch.setattr(variants, "measure_case", measure_case)
    monkeypatch.setattr(variants.torch.cuda, "empty_cache", lambda: None)
    results = variants.measure(quick=False)  # 2 sizes: each row's case list runs twice
    decisions = {r["row"]: r["decision"] for r in results}
    assert decisions["wins"] == "keep"  # geo. mean of 1.2 and 1.05 = 1.12
    assert decisions["ties"] == "remove"  # 1.095
    assert decisions["broken"].startswith("not decided: outputs differ")


def test_variant_report_prints_a_decision_per_row():
    rows = _variant_rows({"narrow": [1.3], "tiles": [0.9]})
    for row, decision in zip(rows, ("keep", "remove"), strict=True):
        row["geomean"], row["decision"] = row["cases"][0]["ratio"], decision
    lines = variants.report(rows, "Some GPU", 3.0)
    decisions = [line for line in lines if line.startswith(("| narrow |", "| tiles |")) and "**" in line]
    assert decisions == ["| narrow | 1 | 1.30-1.30 | 1.30 | **keep** |", "| tiles | 1 | 0.90-0.90 | 0.90 | **remove** |"]


def test_every_variant_row_is_a_row_of_the_table():
    """docs/kernel-variants.md names every row the GPU decides, by the same name."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "docs" / "kernel-variants.md").read_text()
    assert all(f"| {row.name} |" in table for row in variants.ROWS), [r.name for r in variants.ROWS]


def test_forcing_the_simpler_path_names_what_this_tree_reads_and_restores_it():
    """Every name a row overrides exists in the CUDA backend (a rename fails here, not on a GPU lease), is set
    inside the block with the launch plans emptied, and is restored after."""
    import importlib

    from zcomm_cuda import loader

    backend = importlib.import_module(variants.BACKEND)
    forced = {"narrow_requant": variants._never, "in_registers": variants._never, "WIDE_NUMEL": 0,
              "TEAM_MAX_GROUP": 1 << 62}
    before = {name: getattr(backend, name) for name in forced}
    backend.OP_PLANS[("stale",)] = ()
    launcher = loader.launcher()
    with variants._forced({**forced, "launcher": "driver"}):
        assert {name: getattr(backend, name) for name in forced} == forced and loader.launcher() == "driver"
        assert backend.OP_PLANS == {}
    assert {name: getattr(backend, name) for name in forced} == before and loader.launcher() == launcher
    with pytest.raises(LookupError, match="no_such_switch"):
        with variants._forced({"no_such_switch": 1}):
            pass


def test_recording_names_each_launched_kernel_and_restores_the_loader(monkeypatch):
    from zcomm_cuda import loader

    launched = []
    monkeypatch.setattr(loader, "launch", lambda source, name, *args: launched.append(name))
    names: list[str] = []
    with variants._recording(names):
        loader.launch("quantize.cu", "zc_quantize_bf16_int8", None, 1, 1, ())
    loader.launch("quantize.cu", "zc_other", None, 1, 1, ())
    assert names == ["zc_quantize_bf16_int8"] and launched == ["zc_quantize_bf16_int8", "zc_other"]
