"""``python -m bench.train``: the same training under several ZeRO/ZeRO++/FSDP2/DeepSpeed setups.

:mod:`.suite` runs the comparison from the flags of :mod:`.cli`: the named configurations
(:mod:`.configs`) on the models of :mod:`.models` (which the runtime's tests use too) and the
byte-level text of :mod:`.data`, each trained by :mod:`.loop` through a runner
(:mod:`.runner`: :mod:`.zero_runner`, :mod:`.fsdp2_runner`, :mod:`.deepspeed_runner`), and
reported by :mod:`.report`. ``python -m bench.train.sweep`` (:mod:`.sweep`, outputs in
:mod:`.sweep_report`) runs the comparison at several simulated link rates and checks the
ZeRO++ paper's bandwidth claim on the measured numbers. See bench/TRAINING.md.
"""
