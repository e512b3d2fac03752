"""ZeRO++ in the runtime (stages 0-3, qwZ, qgZ, hpZ, weight differences, with an edit between
steps and with the optimizer offloaded to the CPU) on fake CUDA tensors and a CUDA-only fake
process group of 4 ranks as 2 nodes x 2 ([Note: fake CUDA] in ``fake_cuda``); run by
``python tests/fake_cuda.py SHIM OUT zeropp_fake_cuda_cases``, checked by
``test_zeropp_fake_cuda.py``.

This process is rank 3 (the second rank of the second node), so no step of a hierarchical
collective is that of a first rank. Each case trains ``STEPS`` steps and returns where the
runtime's tensors live, the audit (device-to-host copies, collectives on host tensors), the
devices of the host reads the runtime made through ``_host_sync`` (scripted: weight
differences read one pair of counts per unit and step) and the streams and futures the code
asked for ([Note: fake CUDA streams]). Values are meaningless and never inspected.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

import zcomm
import zero_runtime
from fake_cuda import fake_cuda
from zero_fake_cuda_cases import PARTITIONED, _audit, _cuda_model, _placement, _train, offload_cpu
from zero_workloads import make_optimizer

WORLD, RANK = 4, 3  # the fake world the driver starts, and this process's rank in it
TOPOLOGY = zcomm.Topology(world_size=WORLD, local_size=2)
STEPS = 3
QUANTIZED = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
# The answers of the runtime's host reads in the weight-difference cases: (the most groups any
# rank sent as values, all ranks' total). NO_FALLBACK: every read says none fell back; FALLBACK:
# the reads say some did, 1 and 3 groups at most in turn (these models' shards have fewer than
# 256 groups, so no slots: each such read runs the second gather of [Note: fallback slots]).
NO_FALLBACK = [[0, 0]] * 64
FALLBACK = [[1, 2], [3, 5]] * 32


def _training(zero: dict, *, kind: str = "gpt", reads: list | None = None, clip: float = 1.0,
              precision: str = "bf16", edit_after: int | None = None) -> Callable[[], dict[str, Any]]:
    """A case: ``STEPS`` optimizer steps of ``kind`` under ``zero`` options, 2 nodes x 2 ranks;
    with ``edit_after``, rank 0 edits every weight in a ``GatheredParameters`` block after that
    many steps (the next gathers start again from exact values)."""

    def case() -> dict[str, Any]:
        config: dict[str, Any] = {"zero_optimization": zero, "gradient_clipping": clip}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        with fake_cuda(reads) as probe:
            model, opt = zero_runtime.initialize(_cuda_model(kind), make_optimizer(), config, topology=TOPOLOGY)
            for step in range(STEPS):
                if step == edit_after:
                    with zero_runtime.GatheredParameters(model, modifier_rank=0), torch.no_grad():
                        for param in model.parameters():
                            param.mul_(0.5)
                _train(kind, model, opt, range(step, step + 1), rank=RANK, ranks=WORLD)
            gather = opt.plan.forward_gather if opt.config.stage < 3 else opt.plan.backward_gather
            return {**_placement(opt), **_audit(probe), "streams": sorted(set(probe["streams"])),
                    "collectives": sorted(set(probe["collectives"])),
                    "units": len(opt.units), "global_step": opt.global_step,
                    "fallback_groups": getattr(gather, "fallback_groups", None)}

    return case


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "s0-q": _training({"stage": 0, "zero_quantized_gradients": True}),
    "s1-q": _training({"stage": 1, **QUANTIZED}, kind="mlp"),
    "s2-q": _training({"stage": 2, **QUANTIZED}),
    "s2-q-int8hop-hadamard": _training({"stage": 2, **QUANTIZED, "zcomm_qgz_first_hop_bits": 8,
                                        "zcomm_qgz_hadamard_block": 16}, precision="fp32"),
    "s1-delta4": _training({"stage": 1, **QUANTIZED, "zcomm_weight_delta_bits": 4}, reads=NO_FALLBACK),
    "s2-delta4-fallback": _training({"stage": 2, **QUANTIZED, "zcomm_weight_delta_bits": 4}, reads=FALLBACK),
    "s2-delta4-edit": _training({"stage": 2, **QUANTIZED, "zcomm_weight_delta_bits": 4}, reads=NO_FALLBACK,
                                edit_after=1),
    "s2-delta8": _training({"stage": 2, **QUANTIZED, "zcomm_weight_delta_bits": 8}, kind="mlp", reads=NO_FALLBACK),
    "s3-zeropp": _training({**PARTITIONED, **QUANTIZED, "zero_hpz_partition_size": 2}),
    # the offloaded optimizer's device-to-host copies are checked as without ZeRO++ (test_zero_fake_cuda)
    "s3-zeropp-offload-overlap": functools.partial(offload_cpu, overlap=True, topology=TOPOLOGY, rank=RANK,
                                                   world=WORLD, zero={**QUANTIZED, "zero_hpz_partition_size": 2}),
    "s3-zeropp-delta4-fallback": _training({**PARTITIONED, **QUANTIZED, "zero_hpz_partition_size": 2,
                                   "zcomm_weight_delta_bits": 4}, reads=FALLBACK),
}
