"""``make gpu-bench`` (``python -m bench.gpu_bench``): every speed target of zcomm measured in one call.

A GPU machine is lent rarely and for minutes, so one command measures everything the
host-path, kernel and training work is judged by, in about 3.5 minutes, and writes one
folder under ``bench/results/`` (``report.md`` with three tables, the tools' JSON, logs):

1. **host cost** per call at world size 1, on 1M and 16M bf16 elements: each
   ``zcomm.quant`` op next to ``clone``, ``all_gather_q8`` next to torch's all-gather,
   ``reduce_scatter_q4`` (1 and 4 stages) next to torch's reduce-scatter, host enqueue time
   and synchronized time, under each CUDA kernel launcher (cupy, driver) with their ratios
   (``python -m bench.host_cost --launcher cupy,driver``);
2. **kernel GB/s** of every op against a device-to-device copy of the same bytes, at 16M,
   64M and 256M elements, group sizes 256 and 512, bf16 and fp32 (``python -m bench.kernels``);
3. **training** a GPT of ~160M parameters (d_model 1024, 12 layers, 16 heads, sequence
   512, batch 8, bf16) on the one GPU: zero3, zeropp, zero3+qwz, zero3+qgz, fsdp2 and
   fsdp2-zeropp in 4 interleaved rounds (``python -m bench.train --rounds 4``), median step
   time over rounds, step-time ratios paired per round (zero3+qwz / zero3, zeropp / zero3,
   fsdp2-zeropp / fsdp2, fsdp2 / zero3) with their range, validation loss.

Each part is a subprocess under its own time limit within a total deadline
(:mod:`bench.gpu_bench.plan`), run by gpu-check's stage runner; a tool that this checkout
lacks is reported as "not available in this checkout", never skipped in silence. Ratios
(zcomm over torch, each config over zero3) come from numbers measured in the same run;
nothing here is a pass/fail threshold on speed.

On a machine without a GPU the same command runs the CPU part (host cost with the CPU
backends, on 1M elements), writes its report and exits 2, as the GPU parts could not run.
Exit status 0 when every part ran and passed, 1 when one failed or was not available.
"""
