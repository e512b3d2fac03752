"""``python -m bench.train``: the same training under several ZeRO/ZeRO++/FSDP2/DeepSpeed setups.

Every rank runs every requested configuration one after another in this one launch: it
re-seeds, rebuilds the model and optimizer under the configuration's engine, trains
``--steps`` steps on the same global batches of byte-level standard-library source
(``bench.text_data``), validates on the fixed held-out files, and measures step time,
inter-node wire bytes and memory (``bench.train_loop``). Rank 0 prints one table row per
configuration and optionally writes JSON and PNGs (``bench.train_report``).

Launch under the simulated cluster, torchrun or anything that sets torchrun's variables::

    python -m bench.simcluster --nodes 2 --local 2 --rate 200mbit -- python -m bench.train
    torchrun --nproc-per-node 4 -m bench.train --configs zero3 zeropp fsdp2

See bench/TRAINING.md for the configurations and the columns.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.deepspeed_runner import DeepSpeedRunner
from bench.fsdp2_runner import FSDP2Runner
from bench.text_data import ByteCorpus, TextDataConfig
from bench.train_configs import CONFIGS, TrainConfig, configs_from_impl, select_configs
from bench.train_dist import DistContext, init_distributed
from bench.train_loop import ConfigResult, LoopSettings, run_config
from bench.train_models import MODELS, ModelSize, ModelSpec, model_spec
from bench.train_report import format_table, write_json, write_plots
from bench.train_runner import Runner, Unavailable
from bench.zero_runner import ZeroRunner

DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    choose = parser.add_argument_group("what to compare")
    listing = ", ".join(f"{c.name} ({c.summary})" for c in CONFIGS.values())
    choose.add_argument("--configs", nargs="+", metavar="NAME", help=f"default: {' '.join(DEFAULT_CONFIGS)}. {listing}")
    choose.add_argument(
        "--impl", nargs="+", choices=("zero", "fsdp2", "deepspeed"), help="issue 5's spelling of --configs"
    )
    choose.add_argument("--stage", nargs="+", type=int, default=[3], help="ZeRO stages for --impl zero")
    choose.add_argument("--model", nargs="+", choices=MODELS, default=["tinygpt"])
    shape = parser.add_argument_group("model and data")
    shape.add_argument("--seq-len", type=int, default=128, help="predicted tokens per sequence")
    shape.add_argument("--d-model", type=int, default=128)
    shape.add_argument("--n-layers", type=int, default=4)
    shape.add_argument("--n-heads", type=int, default=4)
    shape.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute/communication precision")
    loop = parser.add_argument_group("training")
    loop.add_argument("--steps", type=int, default=40)
    loop.add_argument("--warmup", type=int, default=5, help="steps left out of time and wire bytes")
    loop.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    loop.add_argument("--lr", type=float, default=1e-3)
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    loop.add_argument("--eval-batches", type=int, default=4, help="global batches of the validation set")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the rows and run metadata as JSON")
    out.add_argument("--plot-dir", metavar="DIR", help="write loss_vs_step.png and step_time.png")
    return parser


def chosen_configs(args: argparse.Namespace) -> list[TrainConfig]:
    if args.impl and args.configs:
        raise ValueError("give either --configs or --impl/--stage, not both")
    names = configs_from_impl(args.impl, args.stage) if args.impl else (args.configs or list(DEFAULT_CONFIGS))
    return select_configs(names)


def runner_factory(
    config: TrainConfig, spec: ModelSpec, ctx: DistContext, args: argparse.Namespace
) -> Callable[[], Runner]:
    """A callable that builds ``config``'s engine around a fresh model (seeded by the loop)."""
    common = dict(lr=args.lr, ranks_per_node=ctx.ranks_per_node, bf16=args.dtype == "bf16", device=ctx.device)

    def make() -> Runner:
        if config.engine == "zero":
            return ZeroRunner(config, spec, **common)
        if config.engine == "fsdp2":
            return FSDP2Runner(config, spec, world_size=ctx.world_size, **common)
        return DeepSpeedRunner(config, spec, micro_batch=args.batch // ctx.world_size, **common)

    return make


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(
        steps=args.steps,
        warmup=args.warmup,
        batch=args.batch,
        seq_len=args.seq_len,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )


def model_size(args: argparse.Namespace) -> ModelSize:
    return ModelSize(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)


def run_model(
    model: str,
    size: ModelSize,
    configs: list[TrainConfig],
    settings: LoopSettings,
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
) -> tuple[list[ConfigResult], int | None]:
    """All configurations on one model; returns the rows and the model's parameter count."""
    try:
        spec = model_spec(model, size)
    except Unavailable as note:
        return [ConfigResult(config=c.name, model=model, status="skipped", note=str(note)) for c in configs], None
    rows = []
    for config in configs:
        _progress(ctx, f"{model}: {config.name}")
        try:
            rows.append(run_config(config.name, model, runner_factory(config, spec, ctx, args), corpus, ctx, settings))
        except Unavailable as note:
            rows.append(ConfigResult(config=config.name, model=model, status="skipped", note=str(note)))
    return rows, sum(p.numel() for p in spec.build().parameters())


def _progress(ctx: DistContext, message: str) -> None:
    if ctx.rank == 0:
        print(f"[bench.train] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs = chosen_configs(args)
        settings, size = loop_settings(args), model_size(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    ctx = init_distributed()
    if args.batch % ctx.world_size:
        parser.error(f"--batch {args.batch} does not split evenly over {ctx.world_size} ranks")
    corpus = ByteCorpus(TextDataConfig(seq_len=args.seq_len))
    rows: list[ConfigResult] = []
    params: dict[str, int | None] = {}
    for model in args.model:
        model_rows, params[model] = run_model(model, size, configs, settings, corpus, ctx, args)
        rows.extend(model_rows)
    if ctx.rank == 0:
        report(rows, params, corpus, ctx, args)
    dist.destroy_process_group()
    return 0


def report(
    rows: list[ConfigResult],
    params: dict[str, int | None],
    corpus: ByteCorpus,
    ctx: DistContext,
    args: argparse.Namespace,
) -> None:
    title = f"{ctx.num_nodes} node(s) x {ctx.ranks_per_node} rank(s), {args.dtype}, batch {args.batch} x {args.seq_len}"
    sizes = ", ".join(f"{model} {count:,} params" for model, count in params.items() if count is not None)
    print(f"bench.train: {title}; {sizes}")
    print(
        f"data: stdlib sources, {len(corpus.train_files)} train files ({corpus.train.size:,} bytes), "
        f"{len(corpus.val_files)} validation files ({corpus.val.size:,} bytes)"
    )
    print(format_table(rows))
    meta = {
        "world_size": ctx.world_size,
        "ranks_per_node": ctx.ranks_per_node,
        "nodes": ctx.num_nodes,
        "device": str(ctx.device),
        "torch": torch.__version__,
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


if __name__ == "__main__":
    sys.exit(main())
