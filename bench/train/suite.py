"""The training comparison's run: every configuration on every model, one after another, in one launch.

Every rank runs every requested configuration: it re-seeds, rebuilds the model and
optimizer under the configuration's engine, trains ``--steps`` steps on the same global
batches of byte-level standard-library source (:mod:`.data`), validates on the fixed
held-out files, and measures step time, inter-node wire bytes and memory (:mod:`.loop`).
Rank 0 prints one table row per configuration and optionally writes JSON and PNGs
(:mod:`.report`). ``--rounds R`` trains every configuration R times, interleaved, and adds
per configuration the spread over rounds, the ratio to ``--baseline`` paired per round and
a check that the rounds trained the same losses (:mod:`.rounds`).

Launch under the simulated cluster, torchrun or anything that sets torchrun's variables::

    python -m bench.simcluster --num-nodes 2 --local-size 2 --rate 200mbit -- python -m bench.train
    torchrun --nproc-per-node 4 -m bench.train --configs zero3 zeropp fsdp2

See bench/TRAINING.md for the configurations and the columns.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.harness import dist_env
from bench.harness.dist_env import DistContext
from bench.harness.link import measure_link_throughput
from bench.harness.precision import Precision, choose_precision, cpu_model, read_cpuinfo

from .cli import build_parser, check_grad_clip, chosen_configs, loop_settings, model_config, round_plan
from .configs import TrainConfig, engine_config
from .data import ByteCorpus, TextDataConfig
from .ddp_runner import DDPRunner
from .deepspeed_runner import DeepSpeedRunner
from .fsdp2_runner import FSDP2Runner
from .loop import ConfigResult, LoopSettings, RoundRecord, run_config
from .models import GPTConfig, ModelSpec, model_spec
from .progress import StepProgress
from .report import RunFacts, format_report, write_json, write_plots
from .rounds import RoundPlan, attach_ratios, combine
from .runner import EngineFailed, Runner, Unavailable
from .zero_runner import ZeroRunner


def agreed_precision(requested: str, ctx: DistContext) -> Precision:
    """:func:`choose_precision` on every rank; bf16 only if every rank's hardware has it (collective)."""
    cuda_bf16 = torch.cuda.is_bf16_supported() if ctx.device.type == "cuda" else None
    local = choose_precision(requested, cpuinfo=read_cpuinfo(), cuda_bf16=cuda_bf16)
    everywhere = torch.tensor([int(local.dtype == "bf16")], device=ctx.device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if local.dtype == "bf16" and not everywhere.item():
        return Precision("fp32", f"auto: another rank's hardware has no native bf16 (here: {local.reason})")
    return local


def engine_configs(
    configs: list[TrainConfig], ctx: DistContext, args: argparse.Namespace, precision: Precision
) -> dict[str, dict]:
    """Each configuration's engine config, as its runner gets it and the JSON records it."""
    env = ctx.env
    return {
        config.name: engine_config(
            config,
            local_size=env.local_size,
            bf16=precision.dtype == "bf16",
            gradient_clipping=args.grad_clip,
            micro_batch=args.batch // env.world_size,
        )
        for config in configs
    }


def runner_factory(
    config: TrainConfig,
    spec: ModelSpec,
    settings: dict,
    ctx: DistContext,
    args: argparse.Namespace,
    precision: Precision,
) -> Callable[[], Runner]:
    """A callable that builds ``config``'s engine around a fresh model (seeded by the loop)."""
    env = ctx.env

    def make() -> Runner:
        if config.engine == "zero":
            return ZeroRunner(spec, settings, lr=args.lr, device=ctx.device)
        if config.engine == "deepspeed":
            return DeepSpeedRunner(config.name, spec, settings, lr=args.lr, device=ctx.device)
        engine = DDPRunner if config.engine == "ddp" else FSDP2Runner
        return engine(config, spec, lr=args.lr, local_size=env.local_size, world_size=env.world_size,
                      bf16=precision.dtype == "bf16", gradient_clipping=args.grad_clip,
                      device=ctx.device)  # fmt: skip

    return make


def _specs(models: list[str], shape: GPTConfig) -> dict[str, ModelSpec | Unavailable]:
    """Each ``--model``'s spec, or why it cannot be built here."""
    specs: dict[str, ModelSpec | Unavailable] = {}
    for model in models:
        try:
            specs[model] = model_spec(model, shape)
        except Unavailable as note:
            specs[model] = note
    return specs


def run_once(
    config: TrainConfig,
    model: str,
    spec: ModelSpec,
    label: str,
    settings: LoopSettings,
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
    facts: RunFacts,
) -> ConfigResult:
    """One configuration trained once from the seed: its row, "ok" or why not (collective)."""
    make = runner_factory(config, spec, facts.engine_configs[config.name], ctx, args, facts.precision)
    progress = StepProgress(label, settings.steps) if ctx.env.rank == 0 else None
    try:
        row = run_config(config.name, model, make, corpus, ctx, settings, facts.link_bytes_per_s, on_step=progress)
    except Unavailable as note:
        row = ConfigResult(config=config.name, model=model, status="skipped", note=str(note))
    except EngineFailed as note:
        row = failed_row(config, model, note, ctx.device)
    if progress is not None and row.status != "ok":
        _progress(ctx, f"{label}: {row.status} (see the table)")
    return row


def run_rounds(
    models: list[str],
    shape: GPTConfig,
    configs: list[TrainConfig],
    plan: RoundPlan,
    settings: LoopSettings,
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
    facts: RunFacts,
) -> tuple[list[ConfigResult], dict[str, int | None]]:
    """Every configuration on every model, ``plan.rounds`` times in alternating order (see
    [Note: round order]); returns one row per (model, configuration), in the order asked
    for, and each model's parameter count.

    A configuration that does not finish a round ("skipped", "failed", "expected failure")
    is not run again: its row is that round's, its note naming the round when it was not the first.
    """
    specs = _specs(models, shape)
    units = [(model, config) for model in models if not isinstance(specs[model], Unavailable) for config in configs]
    records: dict[tuple[str, str], list[RoundRecord]] = {(m, c.name): [] for m, c in units}
    rows: dict[tuple[str, str], ConfigResult] = {}  # round 1's row, or the row of the round that did not finish
    for index in range(plan.rounds):
        running = [(m, c) for m, c in plan.order(units, index) if rows.get((m, c.name), _NOT_RUN).status == "ok"]
        for position, (model, config) in enumerate(running):
            label = f"{model}: {config.name}" + (f" (round {index + 1} of {plan.rounds})" if plan.rounds > 1 else "")
            row = run_once(config, model, specs[model], label, settings, corpus, ctx, args, facts)
            key = (model, config.name)
            if row.status == "ok":
                rows.setdefault(key, row)
                records[key].append(RoundRecord.of(row, round=index + 1, position=position))
            else:
                row.note = f"round {index + 1} of {plan.rounds}: {row.note}" if index else row.note
                row.rounds = records[key]  # the rounds it finished stay in the JSON
                rows[key] = row
    table = []
    for model in models:
        spec = specs[model]
        if isinstance(spec, Unavailable):
            table += [ConfigResult(config=c.name, model=model, status="skipped", note=str(spec)) for c in configs]
            continue
        for config in configs:
            row, done = rows[(model, config.name)], records[(model, config.name)]
            table.append(row if row.status != "ok" else combine(
                row, done, tokens_per_step=settings.batch * settings.seq_len, link_bytes_per_s=facts.link_bytes_per_s))  # fmt: skip
    attach_ratios(table, plan.baseline)
    params = {m: None if isinstance(s, Unavailable) else sum(p.numel() for p in s.build().parameters())
              for m, s in specs.items()}  # fmt: skip
    return table, params


# Stands for "not run yet" when choosing what a round runs.
_NOT_RUN = ConfigResult(config="", model="")


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
        settings, shape = loop_settings(args), model_config(args)
        plan = round_plan(args, configs)
        check_grad_clip(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    ctx = dist_env.join(dist_env.detect())
    if args.batch % ctx.env.world_size:
        parser.error(f"--batch {args.batch} does not split evenly over {ctx.env.world_size} ranks")
    precision = agreed_precision(args.dtype, ctx)
    _progress(ctx, f"precision: {precision.dtype} ({precision.reason}); measuring the inter-node link")
    facts = RunFacts(
        cpu=cpu_model(read_cpuinfo()),
        device=str(ctx.device),
        precision=precision,
        link_bytes_per_s=measure_link_throughput(ctx),
        deepspeed=_version("deepspeed"),
        engine_configs=engine_configs(configs, ctx, args, precision),
    )
    corpus = ByteCorpus(TextDataConfig(seq_len=args.seq_len))
    rows, params = run_rounds(args.model, shape, configs, plan, settings, corpus, ctx, args, facts)
    if ctx.env.rank == 0:
        report(rows, params, corpus, ctx, args, facts, plan)
    dist.destroy_process_group()
    return 0


def report(
    rows: list[ConfigResult],
    params: dict[str, int | None],
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
    facts: RunFacts,
    plan: RoundPlan,
) -> None:
    env = ctx.env
    title = (f"{env.num_nodes} node(s) x {env.local_size} rank(s), {facts.precision.dtype}, "
             f"global batch {args.batch} sequences x {args.seq_len} tokens")  # fmt: skip
    sizes = ", ".join(f"{model} {count:,} params" for model, count in params.items() if count is not None)
    print(f"bench.train: {title}; {sizes}")
    print(
        f"data: stdlib sources, {len(corpus.train_files)} train files ({corpus.train.size:,} bytes), "
        f"{len(corpus.val_files)} validation files ({corpus.val.size:,} bytes)"
    )
    print(format_report(rows, facts, rounds=plan.rounds, baseline=plan.baseline))
    meta = {
        "world_size": env.world_size,
        "local_size": env.local_size,
        "num_nodes": env.num_nodes,
        "torch": torch.__version__,
        **facts.as_meta(),
        "params": params,
        "train_bytes": int(corpus.train.size),
        "val_bytes": int(corpus.val.size),
        "args": vars(args),
        "rounds": plan.rounds,
        "baseline": plan.baseline,
        "round_order": "forward in odd rounds, backward in even ones (bench/train/rounds.py)",
    }
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot_dir:
        for path in write_plots(args.plot_dir, rows, title):
            print(f"wrote {path}")
