"""The training comparison's run: every configuration on every model, one after another, in one launch.

Every rank runs every requested configuration: it re-seeds, rebuilds the model and
optimizer under the configuration's engine, trains ``--steps`` steps on the same global
batches of byte-level standard-library source (:mod:`.data`), validates on the fixed
held-out files, and measures step time, inter-node wire bytes and memory (:mod:`.loop`).
Rank 0 prints one table row per configuration and optionally writes JSON and PNGs
(:mod:`.report`).

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

from .cli import build_parser, check_grad_clip, chosen_configs, loop_settings, model_config
from .configs import TrainConfig, engine_config
from .data import ByteCorpus, TextDataConfig
from .deepspeed_runner import DeepSpeedRunner
from .fsdp2_runner import FSDP2Runner
from .loop import ConfigResult, LoopSettings, run_config
from .progress import StepProgress
from .models import GPTConfig, ModelSpec, model_spec
from .report import RunFacts, format_report, write_json, write_plots
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
        return FSDP2Runner(config, spec, lr=args.lr, local_size=env.local_size, world_size=env.world_size,
                           bf16=precision.dtype == "bf16", gradient_clipping=args.grad_clip,
                           device=ctx.device)  # fmt: skip

    return make


def run_model(
    model: str,
    shape: GPTConfig,
    configs: list[TrainConfig],
    settings: LoopSettings,
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
    facts: RunFacts,
) -> tuple[list[ConfigResult], int | None]:
    """All configurations on one model; returns the rows and the model's parameter count."""
    try:
        spec = model_spec(model, shape)
    except Unavailable as note:
        return [ConfigResult(config=c.name, model=model, status="skipped", note=str(note)) for c in configs], None
    rows = []
    for config in configs:
        make = runner_factory(config, spec, facts.engine_configs[config.name], ctx, args, facts.precision)
        progress = StepProgress(f"{model}: {config.name}", settings.steps) if ctx.env.rank == 0 else None
        try:
            rows.append(run_config(config.name, model, make, corpus, ctx, settings, facts.link_bytes_per_s,
                                   on_step=progress))
        except Unavailable as note:
            rows.append(ConfigResult(config=config.name, model=model, status="skipped", note=str(note)))
        except EngineFailed as note:
            rows.append(failed_row(config, model, note, ctx.device))
        if progress is not None and rows[-1].status != "ok":
            _progress(ctx, f"{model}: {config.name}: {rows[-1].status} (see the table)")
    return rows, sum(p.numel() for p in spec.build().parameters())


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
    rows: list[ConfigResult] = []
    params: dict[str, int | None] = {}
    for model in args.model:
        model_rows, params[model] = run_model(model, shape, configs, settings, corpus, ctx, args, facts)
        rows.extend(model_rows)
    if ctx.env.rank == 0:
        report(rows, params, corpus, ctx, args, facts)
    dist.destroy_process_group()
    return 0


def report(
    rows: list[ConfigResult],
    params: dict[str, int | None],
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
    facts: RunFacts,
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
    print(format_report(rows, facts))
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
    }
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot_dir:
        for path in write_plots(args.plot_dir, rows, title):
            print(f"wrote {path}")
