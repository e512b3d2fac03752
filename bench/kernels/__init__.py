"""The kernel benchmark, one entry point: ``python -m bench.kernels [MODE] [options]``.

Modes (one per run; ``--help`` lists every option):

* default (:mod:`.eager`): GB/s of every quantization op on every backend and device that can
  run here, each against a copy of the same bytes, eager calls into preallocated outputs,
  with the project's targets marked PASS or MISS (``--numel``, ``--dtype``, ``--device``,
  ``--backends``, ``--group-size``, ``--repeats``, ``--reference-repeats``);
* ``--sweep`` (:mod:`.sweep`, GPU): kernel-only GB/s of every cuda op by CUDA-graph replay over
  L2-rotated buffers at 16M/64M/256M elements (``--quick``: 16M), group 256/512, bf16/fp32;
* ``--variants`` (:mod:`.variants`, GPU): each row of ``docs/kernel-variants.md`` that a GPU
  decides, the variant against the simpler path on the variant's own target shapes, with a
  keep/remove decision per row (keep when the variant is at least 10% faster);
* ``--ncu`` (:mod:`.sweep`, GPU, under Nsight Compute): one call of each op of the sweep
  inside a profiler range (``ncu --profile-from-start off ... python -m bench.kernels --ncu``);
* ``--static`` (:mod:`.static`, no GPU): registers, spills and main-loop instructions per
  element of every kernel, this tree against ``--before REV``, from nvcc's cubins.

``--output PATH`` writes the markdown report, ``--json PATH`` (sweep, variants) the rows.
"""

from __future__ import annotations

import argparse

from bench.harness.flags import parse_size

MODES = ("sweep", "variants", "ncu", "static")


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
    parser.add_argument("--ncu-numel", type=parse_size, default="16M", help="--ncu: elements per op (default 16M)")
    static.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> list[str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.quick or args.json) and not (args.sweep or args.variants):
        parser.error("--quick and --json go with --sweep or --variants")
    if args.static:
        from . import static

        return static.main(args)
    if args.sweep or args.variants or args.ncu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--sweep, --variants and --ncu measure CUDA kernels: torch {torch.__version__} sees no GPU")
    if args.sweep:
        from . import sweep

        return sweep.main(args.quick, args.json, args.output)
    if args.variants:
        from . import variants

        return variants.main(args.quick, args.json, args.output)
    if args.ncu:
        from . import sweep

        return sweep.ncu(args.ncu_numel, args.group_size or 256)
    from . import eager

    return eager.main(parser, args)
