"""The kernel benchmark, one entry point: ``python -m bench.kernels [MODE] [options]`` (docs/benchmarks.md).

One mode per run, one module each: the default (:mod:`.eager`, the CPU backends); on a GPU
``--sweep`` and ``--ncu`` (:mod:`.sweep`) and ``--variants`` (:mod:`.variants`); ``--static``
(:mod:`.static`, nvcc's cubins, no GPU). Each returns its report's lines, printed and written to ``--output``.
"""

from __future__ import annotations

import argparse
import importlib

# mode -> (module, function): each takes the parsed arguments and returns the report's lines
MODES = {"sweep": ("sweep", "main"), "variants": ("variants", "main"), "ncu": ("sweep", "ncu"), "static": ("static", "main")}


def build_parser() -> argparse.ArgumentParser:
    from . import eager, static

    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    for name in MODES:
        mode.add_argument(f"--{name}", action="store_true", help=f"the {name} mode (see the module docstring)")
    eager.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="--sweep, --variants: the smallest size only")
    parser.add_argument("--json", metavar="PATH", help="--sweep, --variants: also write the rows as JSON")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    static.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> list[str]:
    """Run the chosen mode; print its report (and write it to ``--output``) and return its lines."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.quick or args.json) and not (args.sweep or args.variants):
        parser.error("--quick and --json go with --sweep or --variants")
    mode = next((name for name in MODES if getattr(args, name)), None)
    if mode is None:
        from . import eager

        lines = eager.main(parser, args)
    else:
        if mode != "static":
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(f"--{mode} measures CUDA kernels: torch {torch.__version__} sees no GPU")
        module, function = MODES[mode]
        lines = getattr(importlib.import_module(f"{__name__}.{module}"), function)(args)
    print("\n".join(lines), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")
    return lines
