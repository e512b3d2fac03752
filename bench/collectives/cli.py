"""Command-line flags of the collectives suite, named as in nccl-tests.

``-b/-e/-f`` give a geometric sweep of sizes in bytes (``K``/``M``/``G`` suffixes are powers
of 1024, as in nccl-tests), ``-n`` timed iterations, ``-w`` warm-up iterations, ``-d`` the
element type by nccl-tests' names; then zcomm's: the ops, their pipeline stages and group
size, and the rank's device and backend (``bench.harness.dist_env``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import torch

from bench.harness.dist_env import BACKEND_CHOICES, DEVICE_CHOICES
from bench.harness.flags import parse_size

from .catalog import ALL_OPS

DTYPES: dict[str, torch.dtype] = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}


def parse_stages(text: str) -> tuple[int | None, ...]:
    """``"auto"`` -> (None,) (zcomm picks); ``"1,2,4"`` -> (1, 2, 4)."""
    items = [item.strip() for item in text.split(",")]
    if not all(item == "auto" or (item.isdigit() and int(item) >= 1) for item in items):
        raise ValueError(f"stages must be 'auto' or positive ints separated by commas, got {text!r}")
    return tuple(None if item == "auto" else int(item) for item in items)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One sweep: sizes ``min_bytes * factor**k <= max_bytes`` for every op in ``ops``."""

    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    dtype: str = "float"
    ops: tuple[str, ...] = ALL_OPS
    stages: tuple[int | None, ...] = (None,)
    group_size: int | None = None
    seed: int = 0
    device: str = "auto"
    backend: str = "auto"
    json_path: str | None = None

    def __post_init__(self) -> None:
        if self.min_bytes < 1 or self.max_bytes < self.min_bytes:
            raise ValueError(f"need 1 <= minbytes <= maxbytes, got {self.min_bytes} and {self.max_bytes}")
        if self.factor < 2:
            raise ValueError(f"stepfactor must be >= 2, got {self.factor}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got {self.iters} and {self.warmup}")
        if self.dtype not in DTYPES:
            raise ValueError(f"datatype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        unknown = [op for op in self.ops if op not in ALL_OPS]
        if unknown or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {ALL_OPS}, got {self.ops}")
        if not self.stages:
            raise ValueError("stages must not be empty")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group size must be an even int >= 2, got {self.group_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def sizes(self) -> list[int]:
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= self.factor
        return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__)
    parser.add_argument("-b", "--minbytes", dest="min_bytes", type=parse_size, default="32M", help="smallest size (bytes, K/M/G)")
    parser.add_argument("-e", "--maxbytes", dest="max_bytes", type=parse_size, default="32M", help="largest size (bytes, K/M/G)")
    parser.add_argument("-f", "--stepfactor", dest="factor", type=int, default=2, help="multiply the size by this each step")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    parser.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=5, help="untimed warm-up iterations per size")
    parser.add_argument("-d", "--datatype", dest="dtype", choices=tuple(DTYPES), default="float")
    parser.add_argument("--ops", default=",".join(ALL_OPS), help=f"comma-separated subset of {','.join(ALL_OPS)}")
    parser.add_argument("--stages", type=parse_stages, default="auto",
                        help="pipeline_stages of reduce_scatter_q4 and all_reduce_q4: auto or e.g. 1,2,4")
    parser.add_argument("--group-size", type=int, help="quantization group size of the zcomm ops (default: each op's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto: cuda:LOCAL_RANK when a GPU is visible (unless --backend gloo), else cpu")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="auto: nccl on cuda, gloo on cpu")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows as a JSON list")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> BenchConfig:
    """Parse ``argv``; invalid values exit through argparse with the config's message."""
    parser = build_parser()
    fields = vars(parser.parse_args(argv))  # the parser's dests are BenchConfig's fields
    fields["ops"] = tuple(op.strip() for op in fields["ops"].split(",") if op.strip())
    try:
        return BenchConfig(**fields)
    except ValueError as exc:
        parser.error(str(exc))
