"""Command-line flags of the collectives suite, named as in nccl-tests.

``-b/-e/-f`` give a geometric sweep of sizes in bytes (``K``/``M``/``G`` suffixes are powers
of 1024, as in nccl-tests), ``-n`` timed iterations, ``-w`` warm-up iterations, ``-d`` the
element type by nccl-tests' names; then zcomm's: the ops, their pipeline stages and group
size, and the rank's device and backend (``bench.harness.dist_env``).
"""

from __future__ import annotations

import argparse
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


def parse_config(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, with ``ops`` as a tuple, ``torch_dtype`` and ``sizes`` (``min_bytes * factor**k <= max_bytes``);
    invalid values exit through argparse."""
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
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto: cuda:LOCAL_RANK when a GPU is visible (unless --backend gloo), else cpu")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="auto: nccl on cuda, gloo on cpu")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows as a JSON list")
    config = parser.parse_args(argv)
    config.ops = tuple(op.strip() for op in config.ops.split(",") if op.strip())
    group_size, config.torch_dtype, config.sizes = config.group_size, DTYPES[config.dtype], []
    for failed, message in (
        (config.min_bytes < 1 or config.max_bytes < config.min_bytes,
         f"need 1 <= minbytes <= maxbytes, got {config.min_bytes} and {config.max_bytes}"),
        (config.factor < 2, f"stepfactor must be >= 2, got {config.factor}"),
        (config.iters < 1 or config.warmup < 0, f"need iters >= 1 and warmup >= 0, got {config.iters} and {config.warmup}"),
        (not config.ops or not set(config.ops) <= set(ALL_OPS), f"ops must be a non-empty subset of {ALL_OPS}, got {config.ops}"),
        (group_size is not None and (group_size < 2 or group_size % 2), f"group size must be an even int >= 2, got {group_size}"),
    ):
        if failed:
            parser.error(message)
    size = config.min_bytes
    while size <= config.max_bytes:
        config.sizes.append(size)
        size *= config.factor
    return config
