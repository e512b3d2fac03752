"""``python -m zero_runtime.checkpoint.export CHECKPOINT_DIR OUT``: a checkpoint's consolidated weights
as safetensors, in one process with no process group (DeepSpeed's ``zero_to_fp32.py``).

The checkpoint's files are checked against its ``meta.json`` (sizes, hashes, save tag) and
read with ``weights_only``; the result is exactly what ``opt.full_state_dict()`` returned
when the checkpoint was saved: every state-dict key of the model (both names of a tied
parameter), trained parameters as their fp32 masters, frozen parameters and buffers in the
compute dtype. ``--dtype`` casts floating tensors on the way out.

Without ``--hf-config`` OUT is the safetensors file. With ``--hf-config`` (a Hugging Face
``config.json``, or a folder holding one) OUT is a folder that ``from_pretrained`` loads:
``config.json`` and ``model.safetensors`` (with ``{"format": "pt"}`` metadata, as
``save_pretrained`` writes it). safetensors comes with transformers (``zcomm[hf]``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Sequence

import torch

from ._sharded import CheckpointError, consolidate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, hf_config: str | os.PathLike | None = None,
           dtype: str | None = None) -> Path:
    """Write ``checkpoint``'s consolidated weights to ``out`` (see the module docstring);
    returns the safetensors file written."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(f"zero_runtime.checkpoint.export needs safetensors (pip install 'zcomm[hf]'): {err}") from None
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config_file = _hf_config_file(hf_config) if hf_config is not None else None
    weights = consolidate(checkpoint)
    if dtype is not None:
        weights = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in weights.items()}
    # safetensors stores no aliases: each key gets its own contiguous tensor.
    weights = {k: v.contiguous().clone() for k, v in weights.items()}
    out = Path(out)
    if config_file is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out))
        return out
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_file, out / "config.json")
    target = out / "model.safetensors"
    save_file(weights, str(target), metadata={"format": "pt"})
    return target


def _hf_config_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--hf-config: {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--hf-config: {path} is not JSON: {err}") from None
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_runtime.checkpoint.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a directory written by opt.save_checkpoint()")
    parser.add_argument("out", help="the safetensors file to write, or with --hf-config the folder")
    parser.add_argument("--hf-config", help="a Hugging Face config.json (or its folder): write a from_pretrained folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors (default: as saved)")
    args = parser.parse_args(argv)
    try:
        written = export(args.checkpoint, args.out, hf_config=args.hf_config, dtype=args.dtype)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
