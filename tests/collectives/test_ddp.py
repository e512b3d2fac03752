"""zcomm.ddp's communication hook in DistributedDataParallel on gloo, against plain DDP and fp64.

One 4-rank spawn (2 nodes x 2 ranks from ZCOMM_LOCAL_SIZE) trains a small MLP in several DDP
configurations with tiny buckets (one in DDP's first iteration, several once DDP rebuilt them). For
every bucket the hook reduces, a recording wrapper keeps what it was given; after backward
every rank's ``.grad`` must be within ``collective_oracles.all_reduce_bound`` of the fp64 mean
of those bucket inputs, and within that bound (plus fp32 backward rounding) of a single-process
fp64 oracle (every rank's batch run through an fp64 copy of the model), which plain DDP meets
to fp32 rounding. Configurations: plain steps (3, so the rebuilt buckets are covered), bf16
parameters, ``no_sync`` accumulation, ``find_unused_parameters`` with a layer unused on every
rank, ``static_graph``, ``gradient_as_bucket_view``, an INT8 first hop and an unquantized gather; error feedback; the
errors DDP's contract forces.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zcomm
import zcomm.ddp
from collective_checks import _assert_within
from collective_oracles import all_reduce_bound
from spawn_harness import run_distributed

BUCKET_CAP_MB = 4096 / 2**20  # about a thousand fp32 gradients per bucket: several buckets per step
GROUP_SIZE = 256  # the defaults of both the reduce-scatter and the gather
TOPOLOGY = zcomm.Topology(world_size=4, local_size=2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(24, 48), nn.Linear(48, 40), nn.Linear(40, 8)
        self.spare = nn.Linear(8, 8)  # used only when asked: unused parameters

    def forward(self, x: torch.Tensor, use_spare: bool = True) -> torch.Tensor:
        out = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.spare(out) if use_spare else out


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=gen).to(dtype), torch.randn(16, 8, generator=gen).to(dtype)


def _loss(model: nn.Module, step: int, rank: int, dtype: torch.dtype, use_spare: bool) -> torch.Tensor:
    x, y = _batch(step, rank, dtype)
    return ((model(x, use_spare) - y) ** 2).mean()


def _oracle(reference: nn.Module, steps: list[int], world: int, use_spare: bool) -> dict[str, torch.Tensor]:
    """fp64: the mean over ranks of each rank's gradient, summed over the micro-batches ``steps``."""
    model = copy.deepcopy(reference).double()
    for rank in range(world):
        for step in steps:
            (_loss(model, step, rank, torch.float64, use_spare) / world).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _recording_hook(names: dict[nn.Parameter, str], calls: list) -> object:
    """The hook, wrapped to keep each bucket's input (a copy) and its parameters' names, in call order
    (a function, unannotated: DDP reads the hook's ``__name__`` and refuses annotations that are strings)."""

    def hook(state, bucket):
        calls.append((bucket.buffer().clone(), [names[p] for p in bucket.parameters()]))
        return zcomm.ddp.quantized_allreduce_hook(state, bucket)

    return hook


def _check_buckets(calls: list, ddp: DDP, state: zcomm.ddp.QuantizedAllReduceState, dtype: torch.dtype,
                   oracle: dict[str, torch.Tensor]) -> int:
    """Every bucket reduced: ``.grad`` within the all-reduce bound of the fp64 mean of all ranks' bucket
    inputs, and of the fp64 oracle with fp32 backward rounding on top. Returns the number of buckets."""
    world = dist.get_world_size()
    grads = dict(ddp.module.named_parameters())
    for buffer, names in calls:
        everyone = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(everyone, buffer)
        inputs = torch.stack(everyone).double()
        exact = inputs.mean(0)
        first_bits = state.first_hop_bits
        slice_numel = -(-buffer.numel() // world)
        bound = all_reduce_bound(inputs, nodes=2, local=2, stages=1, group_size=GROUP_SIZE,
                                 gather_group_size=GROUP_SIZE if state.gather_bits else None, dtype=dtype,
                                 divide_by=world, exact=exact, first_bits=first_bits)
        assert slice_numel <= 4096 // 4  # one pipeline stage (the default below STAGE_BYTES)
        # a parameter unused on every rank keeps no .grad; its slots of the bucket were zeros
        reduced = torch.cat([torch.zeros(grads[name].numel()) if grads[name].grad is None
                             else grads[name].grad.reshape(-1).double() for name in names]).double()
        _assert_within("ddp hook vs its bucket inputs", {"names": names}, reduced - exact, bound)
        wanted = torch.cat([oracle[name].reshape(-1) if name in oracle else torch.zeros(grads[name].numel())
                            for name in names]).double()
        backward_slack = (1e-5 if dtype == torch.float32 else 2e-2) * (wanted.abs() + wanted.abs().max())
        _assert_within("ddp hook vs the fp64 oracle", {"names": names}, reduced - wanted, bound + backward_slack)
    count = len(calls)
    calls.clear()
    return count


def _check_plain_ddp(plain: DDP, oracle: dict[str, torch.Tensor]) -> None:
    for name, p in plain.module.named_parameters():
        if name in oracle:
            torch.testing.assert_close(p.grad.double(), oracle[name], rtol=1e-5, atol=1e-6)
        else:
            assert p.grad is None, name


def _run(config: dict) -> list[int]:
    """Three synchronized steps of ``config``; the bucket count of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, use_spare = config.get("dtype", torch.float32), not config.get("find_unused_parameters", False)
    torch.manual_seed(0)
    reference = _Net()
    ddp_options = {key: config[key] for key in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
                   if key in config}
    hooked = DDP(copy.deepcopy(reference).to(dtype), bucket_cap_mb=BUCKET_CAP_MB, **ddp_options)
    plain = DDP(copy.deepcopy(reference), bucket_cap_mb=BUCKET_CAP_MB, **ddp_options)
    state = zcomm.ddp.QuantizedAllReduceState(**config.get("state", {}))
    calls: list = []
    hooked.register_comm_hook(state, _recording_hook({p: name for name, p in hooked.module.named_parameters()}, calls))
    buckets = []
    for step in range(3):
        micro = [10 * step, 10 * step + 1] if config.get("accumulate") else [10 * step]
        for model, model_dtype in ((hooked, dtype), (plain, torch.float32)):
            model.zero_grad(set_to_none=True)
            for index, micro_step in enumerate(micro):
                if index < len(micro) - 1:
                    with model.no_sync():
                        _loss(model, micro_step, rank, model_dtype, use_spare).backward()
                else:
                    _loss(model, micro_step, rank, model_dtype, use_spare).backward()
        oracle = _oracle(reference, micro, world, use_spare)
        _check_plain_ddp(plain, oracle)
        buckets.append(_check_buckets(calls, hooked, state, dtype, oracle))
        if not use_spare:
            assert hooked.module.spare.weight.grad is None
    assert set(state._buckets) == set(range(buckets[-1]))
    return buckets


def _check_error_feedback() -> None:
    """The same batch reduced 12 times with per-bucket error feedback: the mean gradient is closer to
    the fp64 oracle than one reduction without it is."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Net()
    oracle = _oracle(reference, [7], world, True)
    errors = {}
    for feedback in (False, True):
        model = DDP(copy.deepcopy(reference), bucket_cap_mb=BUCKET_CAP_MB)
        state = zcomm.ddp.QuantizedAllReduceState(error_feedback=feedback, err_beta=0.0)
        model.register_comm_hook(state, zcomm.ddp.quantized_allreduce_hook)
        calls = 12 if feedback else 1
        total = {name: torch.zeros_like(g) for name, g in oracle.items()}
        for _ in range(calls):
            model.zero_grad(set_to_none=True)
            _loss(model, 7, rank, torch.float32, True).backward()
            for name, p in model.module.named_parameters():
                total[name] += p.grad.double() / calls
        errors[feedback] = sum(float((total[name] - oracle[name]).norm() ** 2) for name in oracle) ** 0.5
        # one bucket in DDP's first iteration, several once it rebuilt them (fresh feedback for each)
        assert len(state._buckets) >= (2 if feedback else 1), (feedback, sorted(state._buckets))
        assert sorted(state.bucket_feedback) == (sorted(state._buckets) if feedback else [])
    assert errors[True] < 0.5 * errors[False], errors


def _check_contract_errors() -> list[str]:
    """fp64 parameters and a state of the wrong type: the errors DDP surfaces from backward."""
    rank = dist.get_rank()
    found = []
    for state, module in ((zcomm.ddp.QuantizedAllReduceState(), nn.Linear(4, 4).double()),
                          (None, nn.Linear(4, 4))):
        model = DDP(module)
        model.register_comm_hook(state, zcomm.ddp.quantized_allreduce_hook)
        x = torch.randn(2, 4, dtype=module.weight.dtype) + rank
        try:
            model(x).sum().backward()
            found.append("no error")
        except Exception as exc:  # DDP may wrap the hook's error: the message must survive
            found.append(str(exc))
    return found


CONFIGS = {
    "plain": {},
    "bf16": {"dtype": torch.bfloat16},
    "no_sync": {"accumulate": True},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "int8_first_hop": {"state": {"first_hop_bits": 8}},
    "plain_gather": {"state": {"gather_bits": None}},
}


def _main(rank: int, world: int) -> dict:
    results = {name: _run(config) for name, config in CONFIGS.items()}
    _check_error_feedback()
    results["errors"] = _check_contract_errors()
    return results


@pytest.mark.slow
def test_ddp_hook_against_plain_ddp_and_the_fp64_oracle():
    results = run_distributed(_main, 4, env={"ZCOMM_LOCAL_SIZE": "2"}, timeout=400)
    for rank_results in results:
        for name in CONFIGS:
            # DDP starts with one bucket (except with find_unused_parameters) and rebuilds them after
            # its first iteration (static_graph: its second)
            assert rank_results[name][-1] >= 2, (name, rank_results[name])
        fp64, wrong_state = rank_results["errors"]
        assert "bucket 0 holds torch.strided torch.float64 gradients" in fp64, fp64
        assert "needs a zcomm.ddp.QuantizedAllReduceState, got NoneType" in wrong_state, wrong_state


def test_state_checks_its_options():
    with pytest.raises(ValueError, match="gather_bits must be 4, 8 or None"):
        zcomm.ddp.QuantizedAllReduceState(gather_bits=2)
    with pytest.raises(ValueError, match="first_hop_bits must be 4 or 8"):
        zcomm.ddp.QuantizedAllReduceState(first_hop_bits=2)
    with pytest.raises(ValueError, match="error_feedback cannot be combined"):
        zcomm.ddp.QuantizedAllReduceState(error_feedback=True, first_hop_bits=8)
    with pytest.raises(ValueError, match="err_beta"):
        zcomm.ddp.QuantizedAllReduceState(error_feedback=True, err_beta=1.0)
    with pytest.raises(ValueError, match="pipeline_stages"):
        zcomm.ddp.QuantizedAllReduceState(pipeline_stages=0)
    with pytest.raises(TypeError, match="group must be"):
        zcomm.ddp.QuantizedAllReduceState(group="world")
    with pytest.raises(TypeError):
        zcomm.ddp.QuantizedAllReduceState(None)  # keyword-only
    with pytest.raises(ValueError):
        zcomm.ddp.QuantizedAllReduceState(group_size=3)  # INT4 groups are even
