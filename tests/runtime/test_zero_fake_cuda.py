"""The runtime's device discipline, checked on a fake CUDA machine without a GPU.

The cases (``zero_fake_cuda_cases``) train stages 1-3, hpZ, bf16/fp32 with gradient
clipping and fp16 with dynamic loss scaling, and save/load checkpoints, on fake CUDA
tensors and an NCCL-like fake group (see [Note: fake CUDA] in ``fake_cuda``). They run
in one fresh interpreter; these tests check what each observed. A tensor created on the
wrong device fails a case where it meets a CUDA tensor or a collective, a host read fails
it where it happens, and the placement checks below catch the rest.

ZeRO++ (qwZ, qgZ, hpZ, weight differences) on 4 fake ranks as 2 nodes is checked by
``test_zeropp_fake_cuda.py``. Not covered on the fake machine (``test_zero_cuda.py`` runs
them on a GPU): zcomm's CUDA kernels (the fake machine quantizes on zcomm's reference
backend), stream ordering, real NCCL (object collectives and ``torch.cuda.device``), and
numerical results.
"""

from __future__ import annotations

import pytest

from fake_cuda import case_ok, run_on_fake_machine

GPU = ["cuda:0"]
TRAINING = ["s1-accum-clip", "s2-clip", "s2-noclip", "s3-clip", "s3-fused-accum", "s3-hpz-fp32-clip",
            "s3-persistent", "s2-fp16-dynamic", "s3-fp16-dynamic"]
WITHOUT_HOST_READS = ["s1-accum-clip", "s2-clip", "s2-noclip", "s3-clip", "s3-fused-accum", "s3-hpz-fp32-clip",
                      "s3-persistent"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_on_fake_machine(tmp_path_factory.mktemp("fake_cuda"), "zero_fake_cuda_cases")


@pytest.mark.slow
def test_fake_machine_rejects_each_class_of_device_error(results):
    """Without this the other tests could pass vacuously."""
    caught = case_ok(results, "harness_has_teeth")
    assert caught["mix"] == "FakeTensorDeviceMismatchError"
    assert caught["item"] and caught["bool"]  # host reads of a value the fake GPU does not have
    assert caught["host_collectives"] == ["c10d.allreduce_.default on cpu"]
    assert caught["transfers"] == ["aten._to_copy.default: cuda:0 -> cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINING)
def test_training_keeps_every_tensor_on_the_gpu(results, name):
    case = case_ok(results, name)
    for kind in ("masters", "grad_shards", "full", "shards", "parameters", "full_state_dict"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["full_grads"] == (GPU if name.startswith("s1") else [])  # stage 1 keeps them
    assert case["secondaries"] == (GPU if "hpz" in name else [])
    # Optimizer state where torch's AdamW puts it for a CUDA parameter (``step`` on the CPU).
    assert case["optimizer"] == case["oracle_optimizer"]
    assert case["optimizer"]["exp_avg"] == ["cuda:0/torch.float32"]
    assert case["transfers"] == [] and case["host_collectives"] == []
    assert case["memory_total"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", WITHOUT_HOST_READS)
def test_no_host_reads_without_dynamic_loss_scaling(results, name):
    """Clipping included: it multiplies by a clamped device scalar (see [Note: host syncs])."""
    case = case_ok(results, name)
    assert case["host_reads"] == []
    assert [entry[2] for entry in case["log"]] == [1, 2]  # every step updated


@pytest.mark.slow
def test_fp16_dynamic_scaling_reads_one_gpu_flag_per_step(results):
    """Step 2's flag says overflow (scripted): it is skipped and the scale halves (hysteresis 1)."""
    case = case_ok(results, "s2-fp16-dynamic")
    assert case["host_reads"] == GPU * 3
    assert case["log"] == [[False, 256.0, 1], [True, 128.0, 1], [False, 128.0, 2]]
    assert case_ok(results, "s3-fp16-dynamic")["host_reads"] == GPU * 2


@pytest.mark.slow
def test_stage3_prefetches_and_hpz_gathers_from_secondaries(results):
    for name in ("s3-clip", "s3-fused-accum", "s3-hpz-fp32-clip", "s3-persistent"):
        assert case_ok(results, name)["prefetches"] > 0, name
    assert case_ok(results, "s3-hpz-fp32-clip")["fallbacks"] == 0  # every backward gather used a secondary


@pytest.mark.slow
def test_failed_checkpoint_load_agrees_on_the_gpu(results):
    """The agreement flag is reduced on the GPU; this rank's own failure needs no host read."""
    case = case_ok(results, "missing_checkpoint")
    assert "no complete checkpoint" in case["raised"]
    assert case["host_collectives"] == [] and case["transfers"] == [] and case["host_reads"] == []


@pytest.mark.slow
def test_checkpoint_load_places_optimizer_state_as_torch_does(results):
    """A CPU checkpoint loaded on the GPU: masters on the GPU, AdamW's ``step`` counters where
    an optimizer that never saw a checkpoint keeps them (the CPU, fp32), moments on the GPU."""
    case = case_ok(results, "checkpoint_roundtrip")
    loaded = case["loaded"]
    assert loaded["optimizer"] == case["fresh"] == case["oracle_optimizer"]
    assert case["fresh"]["step"] == ["cpu/torch.float32"]
    assert loaded["masters"] == loaded["parameters"] == GPU
    assert loaded["global_step"] == 2
    assert case["host_reads"] == GPU * 2  # one agreement read per load
    assert "failed validation on another rank" in case["rejected"]  # the second load's scripted flag
    assert case["host_collectives"] == [] and case["transfers"] == []


@pytest.mark.slow
def test_initialize_rejects_parameters_the_group_cannot_reduce(results):
    case = case_ok(results, "wrong_devices")
    assert "parameters are on cpu" in case["cpu_on_nccl"] and "runs on cuda only" in case["cpu_on_nccl"]
    assert "several devices (cpu, cuda:0)" in case["mixed"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["offload_cpu", "offload_cpu_overlap"])
def test_offloaded_optimizer_moves_only_gradients_to_the_host(results, name):
    """Per step exactly one device-to-host copy per unit (its fp32 gradient shard), after the
    one-time copy of each master to the host at start-up; the states and the kernel's tensors
    live on the CPU, the parameters and shards the model computes with on the GPU. The same
    with the update during backward (``zcomm_overlap_step``)."""
    case = case_ok(results, name)
    units = case["units"]
    copy = "aten._to_copy.default: cuda:0 -> cpu"
    assert case["at_start"] == [copy] * units
    # each step: one asynchronous copy per unit into a host buffer (see [Note: gradient copies to the host])
    assert case["transfers"] == [copy] * units + ["aten.copy_.default: cpu,cuda:0 -> cpu"] * (2 * units)
    assert case["kernel_calls"] >= 2 * units and case["kernel_devices"] == ["cpu"]
    assert case["host_states"] == case["compute_copies"] == ["cpu"]
    for kind in ("shards", "masters", "parameters", "full_state_dict"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["optimizer_states"] == 0 and case["offloaded"] > 0
    assert case["host_collectives"] == [] and case["host_reads"] == []


@pytest.mark.slow
def test_offloaded_parameters_live_on_the_host_and_gather_on_the_gpu(results):
    """One device-to-host copy per partitioned unit at start-up (its home) and one per unit per
    step (the step's new shard going home); between steps no shard holds GPU memory; what the
    model computes with, the gathers and the optimizer stay on the GPU."""
    case = case_ok(results, "offload_param_cpu")
    units = case["units"]
    assert case["at_start"] == ["aten._to_copy.default: cuda:0 -> cpu"] * units
    assert case["transfers"][units:] == ["aten.copy_.default: cpu,cuda:0 -> cpu"] * (2 * units)
    assert case["homes"] == ["cpu"] and case["resident_between_steps"] == 0
    for kind in ("masters", "grad_shards", "shards", "parameters", "full_state_dict"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["offloaded_parameters"] > 0
    assert case["host_collectives"] == [] and case["host_reads"] == []


@pytest.mark.slow
def test_partitioned_init_builds_on_the_gpu(results):
    case = case_ok(results, "partitioned_init")
    assert case["slices"] == GPU
    for kind in ("masters", "grad_shards", "shards", "parameters", "full_state_dict"):
        assert case[kind] == GPU, (kind, case[kind])
    assert case["transfers"] == [] and case["host_collectives"] == [] and case["host_reads"] == []
