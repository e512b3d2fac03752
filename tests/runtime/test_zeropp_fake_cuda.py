"""ZeRO++'s device discipline in the runtime, on a fake CUDA machine of 4 ranks as 2 nodes x 2.

The cases (``zeropp_fake_cuda_cases``) train stages 0-3 with quantized gradients (qgZ's
reduce-scatter, the quantized all-reduce of stage 0), quantized weights (qwZ), hpZ and 4-
and 8-bit weight differences on fake CUDA tensors and an NCCL-like fake group, as rank 3 of
4 (see [Note: fake CUDA] in ``fake_cuda``). NCCL with more than one rank has not run
these paths on GPUs yet; on a CPU machine this is what can be known before it does: every
tensor they create is on the GPU, no collective is handed a host tensor, nothing is copied
to the host, and the only host reads are the ones [Note: host syncs] in
``zero_runtime._host_sync`` lists (a host read anywhere else raises on fake tensors).
"""

from __future__ import annotations

import pytest

from fake_cuda import case_ok, run_on_fake_machine
from zeropp_fake_cuda_cases import CASES, FALLBACK, STEPS

GPU = ["cuda:0"]
TRAINING = [name for name in CASES if "offload" not in name]
DELTA_CASES = [name for name in TRAINING if "delta" in name]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_on_fake_machine(tmp_path_factory.mktemp("zeropp_fake_cuda"), "zeropp_fake_cuda_cases")


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINING)
def test_zeropp_keeps_every_tensor_and_collective_on_the_gpu(results, name):
    case = case_ok(results, name)
    for kind in ("masters", "grad_shards", "full", "shards", "parameters"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["full_state_dict"] == []  # consolidated on rank 0 only
    assert "alltoall_base_.default" in case["collectives"]  # qgZ's hops ran (and the audit saw them)
    assert case["transfers"] == [] and case["host_collectives"] == []
    assert all(entry.endswith("cuda:0") or "cuda:0 tensor" in entry for entry in case["streams"]), case["streams"]
    assert case["global_step"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in TRAINING if name not in DELTA_CASES])
def test_quantized_gradients_and_weights_read_nothing_on_the_host(results, name):
    assert case_ok(results, name)["host_reads"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", DELTA_CASES)
def test_weight_differences_read_one_pair_of_counts_per_unit_and_step(results, name):
    """The first gather of each unit is exact, and so is the first after a ``GatheredParameters``
    edit; each other one reads its counts once, on the GPU, and the fallen-back groups it counts
    are the totals the reads returned."""
    case = case_ok(results, name)
    reads = case["units"] * (STEPS - (2 if "edit" in name else 1))  # the step after an edit gathers exactly
    assert case["host_reads"] == GPU * reads
    expected = sum(total for _, total in FALLBACK[:reads]) if "fallback" in name else 0
    assert case["fallback_groups"] == expected


@pytest.mark.slow
def test_offloaded_optimizer_under_zeropp_moves_only_gradients_to_the_host(results):
    """qwZ, qgZ and hpZ with the optimizer on the CPU, updating during backward: the same
    device-to-host copies as without ZeRO++ (``test_zero_fake_cuda``), one per unit per step."""
    case = case_ok(results, "s3-zeropp-offload-overlap")
    units, copy = case["units"], "aten._to_copy.default: cuda:0 -> cpu"
    assert case["at_start"] == [copy] * units
    assert case["transfers"] == [copy] * units + ["aten.copy_.default: cpu,cuda:0 -> cpu"] * (2 * units)
    assert case["kernel_devices"] == ["cpu"] and case["host_states"] == ["cpu"]
    for kind in ("shards", "masters", "parameters"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["host_collectives"] == [] and case["host_reads"] == []
