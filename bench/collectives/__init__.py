"""nccl-tests for zcomm: time, bandwidth and correctness of torch's and zcomm's collectives.

``python -m bench.collectives`` (:mod:`.suite`) sweeps the collectives of :mod:`.catalog`,
one spec file each (:mod:`.all_gather`, :mod:`.reduce_scatter`, :mod:`.all_to_all`,
:mod:`.all_gather_q8`, :mod:`.reduce_scatter_q4`), over the shared harness
(:mod:`bench.harness`); :mod:`.cli` holds its flags and :mod:`.comparison` what the zcomm
rows buy over torch's.
"""
