"""nccl-tests for zcomm: time, bandwidth and correctness of torch's and zcomm's collectives.

``python -m bench.collectives`` (:mod:`.suite`, flags in :mod:`.cli`) sweeps the collectives of
:mod:`.catalog` and prints :mod:`.report`. Definitions: ``bench/PERFORMANCE.md``.
"""
