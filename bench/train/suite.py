"""The training comparison's run: every configuration on every model, one after another, in one launch.

Every rank runs every requested configuration: it re-seeds, rebuilds the model and
optimizer under the configuration's engine (:mod:`.runner`), trains ``--steps`` steps on the
same global batches (:mod:`.data`) and measures them (:mod:`.loop`), ``--rounds`` times in
alternating order (:mod:`.rounds`). Rank 0 prints the table and writes JSON and PNGs
(:mod:`.report`). Launch under the simulated cluster, torchrun or anything that sets
torchrun's variables (bench/TRAINING.md)::

    python -m bench.simcluster --num-nodes 2 --local-size 2 --rate 200mbit -- python -m bench.train
    torchrun --nproc-per-node 4 -m bench.train --configs zero3 zeropp fsdp2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.harness import dist_env
from bench.harness.dist_env import DistContext
from bench.harness.link import measure_link_throughput
from bench.harness.precision import Precision, choose_precision, cpu_model, read_cpuinfo

from .cli import build_parser, check_grad_clip, chosen_configs, loop_settings, model_config, round_plan
from .configs import TrainConfig, engine_config
from .data import ByteCorpus, TextDataConfig
from .loop import ConfigResult, LoopSettings, run_config
from .models import GPTConfig, ModelSpec, Unavailable, model_spec
from .progress import StepProgress
from .report import RunFacts, report
from .rounds import RoundPlan, attach_ratios, combine, round_record
from .runner import RUNNERS, EngineFailed, EngineSetup


@dataclass(frozen=True)
class Launch:
    """What every configuration of one launch is run with."""

    args: argparse.Namespace
    ctx: DistContext
    settings: LoopSettings
    corpus: ByteCorpus
    facts: RunFacts
    setup: EngineSetup


def agreed_precision(requested: str, ctx: DistContext) -> Precision:
    """:func:`choose_precision` on every rank; bf16 only if every rank's hardware has it (collective)."""
    cuda_bf16 = torch.cuda.is_bf16_supported() if ctx.device.type == "cuda" else None
    local = choose_precision(requested, cpuinfo=read_cpuinfo(), cuda_bf16=cuda_bf16)
    everywhere = torch.tensor([int(local.dtype == "bf16")], device=ctx.device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if local.dtype == "bf16" and not everywhere.item():
        return Precision("fp32", f"auto: another rank's hardware has no native bf16 (here: {local.reason})")
    return local


def run_once(launch: Launch, config: TrainConfig, model: str, spec: ModelSpec, label: str) -> ConfigResult:
    """One configuration trained once from the seed: its row, "ok" or why not (collective)."""
    settings = launch.facts.engine_configs[config.name]
    make = lambda: RUNNERS[config.engine](config, spec, settings, launch.setup)  # noqa: E731
    progress = StepProgress(label, launch.settings.steps) if launch.ctx.env.rank == 0 else None
    try:
        row = run_config(config.name, model, make, launch.corpus, launch.ctx, launch.settings, on_step=progress)
    except Unavailable as note:
        row = ConfigResult(config=config.name, model=model, status="skipped", note=str(note))
    except EngineFailed as note:
        row = failed_row(config, model, note, launch.ctx.device)
    if progress is not None and row.status != "ok":
        _progress(launch.ctx, f"{label}: {row.status} (see the table)")
    return row


def run_rounds(launch: Launch, models: list[str], shape: GPTConfig, configs: list[TrainConfig],
               plan: RoundPlan) -> tuple[list[ConfigResult], dict[str, int | None]]:  # fmt: skip
    """Every configuration on every model, ``plan.rounds`` times in alternating order (see
    [Note: round order]); returns one row per (model, configuration), in the order asked
    for, and each model's parameter count.

    A configuration that does not finish a round ("skipped", "failed", "expected failure")
    is not run again: its row is that round's, its note naming the round when it was not the first.
    """
    specs: dict[str, ModelSpec | Unavailable] = {}
    for model in models:
        try:
            specs[model] = model_spec(model, shape)
        except Unavailable as note:
            specs[model] = note
    units = [(model, config) for model in models if not isinstance(specs[model], Unavailable) for config in configs]
    firsts: dict[tuple[str, str], ConfigResult] = {}  # each configuration's row of round 1
    records: dict[tuple[str, str], list[dict]] = {(model, config.name): [] for model, config in units}
    stopped: dict[tuple[str, str], ConfigResult] = {}  # the row of the round a configuration did not finish
    for index in range(plan.rounds):
        running = [(model, config) for model, config in plan.order(units, index) if (model, config.name) not in stopped]
        for position, (model, config) in enumerate(running):
            label = f"{model}: {config.name}" + (f" (round {index + 1} of {plan.rounds})" if plan.rounds > 1 else "")
            row, key = run_once(launch, config, model, specs[model], label), (model, config.name)
            if row.status == "ok":
                firsts.setdefault(key, row)
                records[key].append(round_record(row, round=index + 1, position=position))
                continue
            row.note = f"round {index + 1} of {plan.rounds}: {row.note}" if index else row.note
            row.rounds = records[key]  # the rounds it finished stay in the JSON
            stopped[key] = row
    tokens_per_step = launch.settings.batch * launch.settings.seq_len
    table = []
    for model in models:
        for config in configs:
            key = (model, config.name)
            if isinstance(specs[model], Unavailable):
                row = ConfigResult(config=config.name, model=model, status="skipped", note=str(specs[model]))
            else:
                row = stopped.get(key) or combine(firsts[key], records[key], tokens_per_step=tokens_per_step,
                                                  link_bytes_per_s=launch.facts.link_bytes_per_s)
            table.append(row)
    attach_ratios(table, plan.baseline)
    params = {m: None if isinstance(s, Unavailable) else sum(p.numel() for p in s.build().parameters())
              for m, s in specs.items()}  # fmt: skip
    return table, params


def failed_row(config: TrainConfig, model: str, failure: EngineFailed, device: torch.device) -> ConfigResult:
    """A configuration whose engine raised: "expected failure" with the known reason and the
    error's first line when the configuration is known to fail on this device, else "failed"
    with the whole description (where the engine raised it)."""
    if config.fails_on_cpu and device.type == "cpu":
        cause = failure.__cause__ or failure
        said = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        return ConfigResult(config=config.name, model=model, status="expected failure",
                            note=f"{config.fails_on_cpu} (it raised {said})")
    return ConfigResult(config=config.name, model=model, status="failed", note=str(failure))


def _progress(ctx: DistContext, message: str) -> None:
    if ctx.env.rank == 0:
        print(f"[bench.train] {message}", file=sys.stderr, flush=True)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs = chosen_configs(args)
        settings, shape, plan = loop_settings(args), model_config(args), round_plan(args, configs)
        check_grad_clip(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    ctx = dist_env.join(dist_env.detect())
    env = ctx.env
    if args.batch % env.world_size:
        parser.error(f"--batch {args.batch} does not split evenly over {env.world_size} ranks")
    precision = agreed_precision(args.dtype, ctx)
    _progress(ctx, f"precision: {precision.dtype} ({precision.reason}); measuring the inter-node link")
    bf16 = precision.dtype == "bf16"
    setup = EngineSetup(lr=args.lr, local_size=env.local_size, world_size=env.world_size, bf16=bf16,
                        gradient_clipping=args.grad_clip, device=ctx.device)  # fmt: skip
    micro_batch = args.batch // env.world_size
    engine_configs = {config.name: engine_config(config, local_size=env.local_size, bf16=bf16, micro_batch=micro_batch,
                                                 gradient_clipping=args.grad_clip) for config in configs}
    facts = RunFacts(cpu=cpu_model(read_cpuinfo()), device=str(ctx.device), precision=precision,
                     link_bytes_per_s=measure_link_throughput(ctx), deepspeed=_version("deepspeed"),
                     engine_configs=engine_configs)  # fmt: skip
    corpus = ByteCorpus(TextDataConfig(seq_len=args.seq_len))
    rows, params = run_rounds(Launch(args, ctx, settings, corpus, facts, setup), args.model, shape, configs, plan)
    if env.rank == 0:
        report(rows, params, corpus, env, args, facts, plan)
    dist.destroy_process_group()
    return 0
