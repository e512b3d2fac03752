"""Command-line flags of ``python -m bench.train`` and the settings they give."""

from __future__ import annotations

import argparse
import dataclasses

from bench.harness.precision import DTYPE_CHOICES

from .configs import CONFIGS, TrainConfig, select_configs
from .data import VOCAB_SIZE
from .loop import LoopSettings
from .models import MODELS, GPTConfig
from .rounds import RoundPlan

DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2")


def add_training_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """The model shape and training flags of ``bench.train`` and ``bench.train.weight_error``."""
    parser.add_argument("--seq-len", type=int, default=128, help="predicted tokens per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the results and run metadata as JSON")
    parser.set_defaults(**defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description="The same training under several "
                                     "ZeRO/ZeRO++/FSDP2/DeepSpeed setups (see bench/TRAINING.md).")  # fmt: skip
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="NAME",
                        help=f"default: {' '.join(DEFAULT_CONFIGS)}; any of {' '.join(CONFIGS)} (bench/TRAINING.md)")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["tinygpt"])
    add_training_args(parser)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="compute/communication precision of every configuration; auto: bf16 on a GPU or a CPU "
                        "with native bf16 (AMX/AVX512-BF16), else fp32")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of time and wire bytes")
    parser.add_argument("--grad-clip", type=float, default=0.0,
                        help="max global gradient norm, given to every engine alike (0: off)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="train every configuration this many times, in "
                        "alternating order, ratios to --baseline paired per round (bench/TRAINING.md, Rounds)")
    parser.add_argument("--baseline", metavar="NAME",
                        help="the configuration the paired step-time ratios divide by (default: the first)")
    parser.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    parser.add_argument("--eval-batches", type=int, default=4, help="global batches of the validation set")
    parser.add_argument("--plot-dir", metavar="DIR", help="write loss_vs_step.png and step_time.png")
    return parser


def chosen_configs(args: argparse.Namespace) -> list[TrainConfig]:
    return select_configs(args.configs)


def check_grad_clip(args: argparse.Namespace) -> None:
    if args.grad_clip < 0:
        raise ValueError(f"--grad-clip must be >= 0 (0: off), got {args.grad_clip}")


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(LoopSettings)})


def round_plan(args: argparse.Namespace, configs: list[TrainConfig]) -> RoundPlan:
    """``--rounds`` and ``--baseline`` (default: the first configuration) over the chosen configurations."""
    names = tuple(config.name for config in configs)
    return RoundPlan(rounds=args.rounds, baseline=args.baseline or names[0], configs=names)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The shape of every ``--model``, over the byte vocabulary of the data."""
    return GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                     n_layers=args.n_layers)  # fmt: skip
