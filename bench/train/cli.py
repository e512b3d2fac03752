"""Command-line flags of ``python -m bench.train``: what to compare, model shape and data, training, output."""

from __future__ import annotations

import argparse

from bench.harness.precision import DTYPE_CHOICES

from .configs import CONFIGS, TrainConfig, configs_from_impl, select_configs
from .data import VOCAB_SIZE
from .loop import LoopSettings
from .models import MODELS, GPTConfig
from .rounds import RoundPlan

DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2")
DESCRIPTION = "The same training under several ZeRO/ZeRO++/FSDP2/DeepSpeed setups (see bench/TRAINING.md)."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=DESCRIPTION)
    choose = parser.add_argument_group("what to compare")
    listing = ", ".join(f"{c.name} ({c.summary})" for c in CONFIGS.values())
    choose.add_argument("--configs", nargs="+", metavar="NAME", help=f"default: {' '.join(DEFAULT_CONFIGS)}. {listing}")
    choose.add_argument(
        "--impl", nargs="+", choices=("zero", "fsdp2", "deepspeed"), help="the older spelling of --configs"
    )
    choose.add_argument("--stage", nargs="+", type=int, default=[3], help="ZeRO stages for --impl zero")
    choose.add_argument("--model", nargs="+", choices=MODELS, default=["tinygpt"])
    shape = parser.add_argument_group("model and data")
    shape.add_argument("--seq-len", type=int, default=128, help="predicted tokens per sequence")
    shape.add_argument("--d-model", type=int, default=128)
    shape.add_argument("--n-layers", type=int, default=4)
    shape.add_argument("--n-heads", type=int, default=4)
    shape.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="compute/communication precision of every configuration; auto: bf16 on a GPU or a CPU with native "
        "bf16 (AMX/AVX512-BF16), else fp32",
    )
    loop = parser.add_argument_group("training")
    loop.add_argument("--steps", type=int, default=40)
    loop.add_argument("--warmup", type=int, default=5, help="steps left out of time and wire bytes")
    loop.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    loop.add_argument("--lr", type=float, default=1e-3)
    loop.add_argument(
        "--grad-clip", type=float, default=0.0, help="max global gradient norm, given to every engine alike (0: off)"
    )
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="train every configuration this many times in one launch, alternating forward and backward order "
        "(A B C, C B A, ...), each from the same seed; step times are medians over rounds, ratios to --baseline "
        "are paired per round (default 1)",
    )
    loop.add_argument(
        "--baseline", metavar="NAME", help="the configuration the paired step-time ratios divide by (default: the first)"
    )
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


def check_grad_clip(args: argparse.Namespace) -> None:
    if args.grad_clip < 0:
        raise ValueError(f"--grad-clip must be >= 0 (0: off), got {args.grad_clip}")


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


def round_plan(args: argparse.Namespace, configs: list[TrainConfig]) -> RoundPlan:
    """``--rounds`` and ``--baseline`` (default: the first configuration) over the chosen configurations."""
    names = tuple(config.name for config in configs)
    return RoundPlan(rounds=args.rounds, baseline=args.baseline or names[0], configs=names)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The shape of every ``--model``, over the byte vocabulary of the data."""
    return GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                     n_layers=args.n_layers)  # fmt: skip
