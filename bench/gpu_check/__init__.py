"""The GPU entry point: ``python -m bench.gpu_check`` (``make gpu-check``) validates zcomm on a machine
with a CUDA GPU in about 5 minutes; ``--bench`` (``make gpu-bench``) measures its speed in about 4.

Both run with the interpreter that has the machine's CUDA torch and cupy (``python3`` by
default, the checkout on ``PYTHONPATH``) and install nothing: GPU machines have no package
registry. ``bench/gpu_lease.sh OUTDIR`` runs the check and then the speed report under hard
limits and packs both: the one command a lent GPU runs first (docs/gpu-check.md).

The check refuses at once (status 2) without a GPU. Otherwise it runs the stages of
:mod:`bench.gpu_check.stages` (the CUDA tests with every skip a failure and every crash a
named failure, 4 ranks on the one GPU over gloo (:mod:`bench.gpu_check.w4`), the collectives
on NCCL, on 2 or more GPUs every collective over NCCL with one rank per GPU against the CPU
(:mod:`bench.gpu_check.nccl`), and last the CUDA kernel tests under the driver launcher),
each under its own time limit, with the kernels' device-side checks on, and writes
``report.md`` with the raw logs into one folder under ``bench/results/``
(:mod:`bench.gpu_check.report`). Status 0 when every stage passed or was skipped as not for
this machine, 1 otherwise. The speed report's parts are :mod:`bench.gpu_check.speed_plan`'s
and its report :mod:`bench.gpu_check.speed_report`'s; without a GPU its CPU part runs and
the status is 2.
"""
