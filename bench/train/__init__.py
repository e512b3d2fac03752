"""``python -m bench.train``: the same training under several ZeRO/ZeRO++/FSDP2/DeepSpeed setups (bench/TRAINING.md).

:mod:`.suite` runs it; ``bench.train.sweep``, ``.convergence`` and ``.weight_error`` are its other commands.
"""
