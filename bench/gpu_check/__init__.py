"""The GPU entry point: ``python -m bench.gpu_check`` (``make gpu-check``) validates zcomm on a CUDA
GPU, ``--bench`` (``make gpu-bench``) measures its speed, ``bench/gpu_lease.sh OUTDIR`` runs both
under hard limits and packs their reports (docs/gpu-check.md). The check's stages are
:mod:`.stages`, the speed report's parts :mod:`.speed_plan`; :mod:`.driver` runs them and
:mod:`.report` writes both reports. It installs nothing (GPU machines have no package registry)
and refuses at once (status 2) without a GPU.
"""
