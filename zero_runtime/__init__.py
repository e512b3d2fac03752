"""zero_runtime: ZeRO stages 0-3 for an unmodified PyTorch model on torch.distributed.

    model, opt = zero_runtime.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3), config)
    loss = model(batch)...; opt.backward(loss); opt.step()

Stage 3 takes the ZeRO++ options (``zero_quantized_weights``, ``zero_hpz_partition_size``,
``zero_quantized_gradients``, ``zcomm_quant_group_size``; see ``ZeroConfig``), stages 1 and 2
all but hpZ, and ``zcomm_weight_delta_bits`` (4-bit weight differences after each step), stage
0 (plain data parallelism) qgZ alone, as ``zcomm.all_reduce_q4``: they change only the
communication objects of the run's comm plan.

``Init()`` builds a model with its parameters partitioned as each module is constructed.
``GatheredParameters(params, modifier_rank=None)`` makes partitioned parameters full for a
block (and writes a rank's edits back into every shard and fp32 master).

Public modules: ``config`` (``ZeroConfig``, ``LossScaleConfig``; the DeepSpeed JSON reader),
``optimizer`` (``ZeroOptimizer``), ``lr_schedules`` (DeepSpeed's warm-up schedules),
``estimate`` (``python -m zero_runtime.estimate``), ``activation_checkpointing`` and
``tiled_linear``. Sub-packages by concern: ``offload`` (``cpu_adam``, ``swap_file``),
``checkpoint`` (sharded checkpoints; ``export``, ``python -m zero_runtime.checkpoint.export``) and
``comm`` (the comm plan). Modules whose names start with an underscore are internal;
``_contract`` holds the contracts between them.
"""

from ._gathered import GatheredParameters
from ._initialize import initialize
from ._memory import MemoryReport
from ._partitioned_init import Init
from .checkpoint._sharded import CheckpointError
from .config import LossScaleConfig, ZeroConfig
from .optimizer import ZeroOptimizer
from .tiled_linear import TiledLinear

__all__ = ["initialize", "Init", "GatheredParameters", "ZeroConfig", "LossScaleConfig", "ZeroOptimizer", "MemoryReport",
           "CheckpointError", "TiledLinear"]
