"""nccl-tests for zcomm: time, bandwidth and correctness of torch's and zcomm's collectives.

``python -m bench.collectives`` (:mod:`.suite`) sweeps the collectives of :mod:`.catalog` over
the shared harness (:mod:`bench.harness`); :mod:`.cli` holds its flags and :mod:`.comparison`
what the zcomm rows buy over torch's. Definitions: ``bench/PERFORMANCE.md``.
"""
