"""GPU timing of reorder_quantize's interleaved form against its flat form and quantize.

``python -m bench.reorder_interleaved [--sizes 64M,256M] [--repeats 20]`` (CUDA only). For each
size, dtype (bf16, fp32) and width (INT8, INT4), group size 256, 8 slices reversed and 4 chunks
(bench.kernels' layout), it times, in the same run:

* ``quantize`` of the flat tensor;
* ``reorder_quantize`` of the flat tensor (one tensor that fills its parts: the permuted kernel);
* ``reorder_quantize`` of the same elements as 5 separate tensors of uneven widths, interleaved
  over 8 parts with a zero fill (the coalesced reduce-scatter's input: the interleaved kernel),
  each part's pieces off the 8-element run boundaries in one tensor.

The interleaved form uploads its table per call and cannot be captured in a CUDA graph, so
every op is timed eagerly: ``--repeats`` back-to-back calls between two CUDA events after a
warm-up, the median of 5 such samples. At these sizes a call's kernel outlasts its host work,
so the GPU stays busy. Before timing, the interleaved payload is checked byte for byte against
the flat kernel run on the interleaving built with ``torch.cat`` (an independent path to the
same bytes). Prints microseconds per call and the ratios interleaved / flat and flat / quantize.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import zcomm.quant as q

PERM = (7, 6, 5, 4, 3, 2, 1, 0)
CHUNKS = 4
GROUP = 256
PARTS = 8
SHARES = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # the 5 tensors' shares of the elements, before rounding


def _sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in text.split(",")]


def _time_us(call, repeats: int) -> float:
    call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / repeats)
    return statistics.median(samples)


def _tensors(n: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """5 tensors of about ``n`` elements in all, each a multiple of PARTS, one of odd width; the part size."""
    widths = [max(1, int(n * share) // PARTS // 8 * 8) for share in SHARES]
    widths[1] += 3  # pieces off the run boundaries: scalar runs where they end
    part_numel = -(-(sum(widths) + 5) // GROUP) * GROUP  # a fill of 5 or more, parts of whole groups
    xs = [torch.randn(PARTS * w, device="cuda", dtype=torch.float32).to(dtype) for w in widths]
    return xs, part_numel


def run(sizes: list[int], repeats: int) -> list[str]:
    lines = [f"# reorder_quantize, interleaved vs flat, on {torch.cuda.get_device_name()} (torch {torch.__version__})",
             "", "| elements | dtype | bits | quantize us | reorder flat us | reorder interleaved us "
             "| interleaved / flat | flat / quantize |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        for tag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            xs, part_numel = _tensors(n, dtype)
            numel = PARTS * part_numel
            pieces = [x.view(PARTS, -1) for x in xs]
            fill = torch.zeros(PARTS, part_numel - sum(p.shape[1] for p in pieces), device="cuda", dtype=dtype)
            flat = torch.cat([*pieces, fill], dim=1).reshape(-1)  # the interleaving, materialized
            for bits in (8, 4):
                chunk = numel // CHUNKS
                out = torch.empty(CHUNKS, q.payload_nbytes(chunk, bits, GROUP), device="cuda", dtype=torch.uint8)
                ref = torch.empty_like(out)
                packed = torch.empty(q.payload_nbytes(numel, bits, GROUP), device="cuda", dtype=torch.uint8)
                q.reorder_quantize(xs, PERM, CHUNKS, bits, GROUP, parts=PARTS, part_numel=part_numel, out=out,
                                   backend="cuda")
                q.reorder_quantize(flat, PERM, CHUNKS, bits, GROUP, out=ref, backend="cuda")
                if not torch.equal(out, ref):
                    raise SystemExit(f"interleaved payload differs from the flat kernel's: {n} {tag} INT{bits}")
                t_quantize = _time_us(lambda: q.quantize(flat, bits, GROUP, out=packed, backend="cuda"), repeats)
                t_flat = _time_us(lambda: q.reorder_quantize(flat, PERM, CHUNKS, bits, GROUP, out=ref,
                                                             backend="cuda"), repeats)
                t_inter = _time_us(lambda: q.reorder_quantize(xs, PERM, CHUNKS, bits, GROUP, parts=PARTS,
                                                              part_numel=part_numel, out=out, backend="cuda"),
                                   repeats)
                lines.append(f"| {numel} | {tag} | {bits} | {t_quantize:.1f} | {t_flat:.1f} | {t_inter:.1f} "
                             f"| {t_inter / t_flat:.2f} | {t_flat / t_quantize:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64M,256M")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.reorder_interleaved needs a CUDA device")
    print("\n".join(run(_sizes(args.sizes), args.repeats)))


if __name__ == "__main__":
    main()
