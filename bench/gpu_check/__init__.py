"""``make gpu-check`` (``python -m bench.gpu_check``): validate zcomm on a machine with a CUDA GPU in under 5 minutes.

It runs with the interpreter that has the machine's CUDA torch and cupy (``python3`` by
default, the checkout on ``PYTHONPATH``) and installs nothing: GPU machines have no package
registry. On a machine without a GPU it exits with status 2 at once. Otherwise it runs the
stages of :mod:`bench.gpu_check.stages` (the CUDA tests with every skip a failure and every
crash a named failure, a world of 4 ranks on the one GPU over gloo (:mod:`bench.gpu_check.w4`),
the collectives on NCCL, and last the CUDA kernel tests again under the driver kernel
launcher), each under its own time limit, and writes ``report.md`` with the raw logs and outputs into
one folder under ``bench/results/`` (:mod:`bench.gpu_check.report`). Status 0 when every
stage passed, 1 otherwise.
"""
