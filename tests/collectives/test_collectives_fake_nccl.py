"""zcomm's quantized collectives and adapters on a fake CUDA machine of 4 ranks as 2 nodes x 2.

The cases (``fake_nccl_cases``) call ``all_gather_q8``, ``reduce_scatter_q4`` (single and
coalesced), ``all_reduce_q4`` and ``all_gather_hierarchical``, sync and async, planned and
prepared, with the options that change their chains (pipeline stages, the INT8 first hop,
the Hadamard rotation, error feedback, the INT4 gather, the reduction ops), the DDP hook and
FSDP2 with ``zcomm.fsdp.enable_zeropp`` (sharded in the node, and HSDP across the nodes), on
fake CUDA tensors and an NCCL-like fake group, as rank 3 of 4 ([Note: fake CUDA] in
``tests/fake_cuda.py``). NCCL with more than one rank has not run them on GPUs
yet; on a CPU machine this is what can be known before it does: every collective of their
hops is handed GPU tensors only, nothing is copied to the host, and nothing is read on the
host (a host read raises on fake tensors). Quantization runs on zcomm's reference backend;
its CUDA kernels and stream ordering need a GPU (``make gpu-check``).
"""

from __future__ import annotations

import pytest

from fake_cuda import case_ok, run_on_fake_machine
from fake_nccl_cases import CASES


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_on_fake_machine(tmp_path_factory.mktemp("fake_nccl"), "fake_nccl_cases")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_hops_run_on_gpu_tensors_without_host_reads_or_copies(results, name):
    case = case_ok(results, name)
    assert case["collectives"], "the case ran no collective: it would pass vacuously"
    assert case["transfers"] == [] and case["host_collectives"] == []


@pytest.mark.slow
def test_async_calls_and_the_ddp_hook_ask_for_cuda_streams_and_futures_only(results):
    """Side streams are made once per kind and device; the hook's future and ``record_stream`` name
    the bucket's device ([Note: fake CUDA streams] records them)."""
    assert results["all_gather_q8 fp16 async 4 stages"]["streams"] == ["stream on cuda:0"]
    assert results["reduce_scatter_q4 fp32 async 4 stages SUM"]["streams"] == ["stream on cuda:0"]
    assert results["ddp hook"]["streams"] == ["future on cuda:0", "record_stream of a cuda:0 tensor",
                                              "stream on cuda:0"]


@pytest.mark.slow
def test_fsdp2_and_hsdp_send_every_unit_through_zcomm(results):
    """Two steps of two units with parameters (the root holds none), weights gathered again for
    backward: qwZ gathers each unit 4 times and qgZ reduces it twice; under HSDP each unit's
    reduce-scatter output is also all-reduced across the 2 nodes (a qgZ reduce-scatter and, with
    ``replicate_gather_bits=4``, an INT4 hierarchical gather; by default an INT8 ``all_gather_q8``)."""
    calls = {name: results[name]["calls"] for name in ("fsdp2 zeropp", "hsdp zeropp", "hsdp exact in the node")}
    assert calls["fsdp2 zeropp"] == {"all_gather_q8": 8, "reduce_scatter_q4": 4}
    assert calls["hsdp zeropp"] == {"all_gather_q8": 8, "reduce_scatter_q4": 8, "all_gather_hierarchical": 4}
    assert calls["hsdp exact in the node"] == {"all_gather_into_tensor": 8, "reduce_scatter_tensor": 4,
                                               "reduce_scatter_q4": 4, "all_gather_q8": 4}
