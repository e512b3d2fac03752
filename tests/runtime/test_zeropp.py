"""ZeRO++ in the runtime (qwZ, hpZ, qgZ) on 4 gloo ranks: 2 nodes x 2 and 1 node x 4.

One spawn runs every case (the CI machine has two cores): the ranks see ``ZCOMM_LOCAL_SIZE=2``
(so the runtime detects 2x2), and the 1x4 cases pass an explicit ``Topology``.

Oracles are independent of the code under test: plain stage 3 (fp32, bit-exact where no
quantization is involved), the initial weights of the unwrapped model, locally computed
per-rank gradients of the unwrapped model, and the wire-format byte formulas.

[Note: ZeRO++ error bounds] qwZ: an INT8 group's scale is ``absmax / 127`` and rounding moves an
element by at most half a scale, so a gathered weight is within ``absmax / 254`` of the
exact one, where ``absmax`` is at most the largest magnitude of the rank's shard that holds
it (its group lies inside that shard). qgZ (SUM of ``W`` ranks, ``N`` nodes): hop 1 moves
each rank's contribution by half an INT4 scale ``<= A_r / 14`` (``A_r``: the largest
magnitude of rank r's local gradient in the bucket, whose rows are all it quantizes); a
dequantized value is at most its group's absmax, so a node's fp32 partial sum is at most
``sum_{r in node} A_r`` and hop 2 adds half of that over 7. In total
``|error of the SUM| <= sum_r A_r / 14 + sum_r A_r / 14 = sum_r A_r / 7``; the runtime then
divides by ``W``. Both bounds get a 1e-4 relative allowance for fp32 rounding in the scale
division and the dequantizing multiply. Dividing by the node count instead of ``W`` would
multiply the average gradient by ``W / N = 2``; the test checks the bound is tight enough
to see that.
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile
from pathlib import Path

import pytest
import torch

from zero_harness import run
from zero_workloads import global_batch, local_slice, loss_of, make_model, make_optimizer, zero_steps

WORLD = 4
# Every parameter partitioned, one unit per module, freed after each use unless the prefetch
# window (a tenth of the GPT) covers its next one: backward gathers most units again (hpZ's
# case). DeepSpeed's residency defaults are "ZeRO++ defaults" below.
FREE_AFTER_USE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "zcomm_stage3_fuse_numel": 0,
                  "stage3_prefetch_bucket_size": 3000}
HPZ = {"zero_hpz_partition_size": 2}
QWZ = {"zero_quantized_weights": True}
QGZ = {"zero_quantized_gradients": True}
OPTIONS = {"qwZ": QWZ, "hpZ": HPZ, "qgZ": QGZ, "ZeRO++": {**QWZ, **HPZ, **QGZ},
           # SDP4Bit's options of qgZ: the INT8 first hop and the Hadamard rotation, together
           "qgZ INT8 hop + Hadamard": {**QGZ, "zcomm_qgz_first_hop_bits": 8, "zcomm_qgz_hadamard_block": 64},
           # DeepSpeed's residency defaults (units kept from forward to backward, fused blocks),
           # with the norms, biases and position embedding persistent, and small qgZ buckets.
           "ZeRO++ defaults": {**QWZ, **HPZ, **QGZ, "stage3_param_persistence_threshold": 512,
                               "stage3_max_reuse_distance": None, "stage3_prefetch_bucket_size": None,
                               "zcomm_stage3_fuse_numel": 13_000, "reduce_bucket_size": 3000}}
TRAIN_STEPS = 12
EXACT_STEPS = 4


def _topology(name: str):
    import zcomm

    return None if name == "2x2" else zcomm.Topology(world_size=WORLD, local_size=WORLD)


def _initialize(zero: dict, *, precision: str = "fp32", topology: str = "2x2"):
    import zero_runtime

    section = {"stage": 3, **FREE_AFTER_USE, **zero}
    config = {"zero_optimization": {key: value for key, value in section.items() if value is not None}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return zero_runtime.initialize(make_model("gpt"), make_optimizer(), config, topology=_topology(topology))


def _fixed_batch_losses(zero: dict, topology: str, rank: int) -> list[float]:
    """bf16 training on one fixed batch (memorisation: the loss must fall)."""
    model, opt = _initialize(zero, precision="bf16", topology=topology)
    batch = local_slice(global_batch("gpt", 0), rank, WORLD)
    losses = []
    for _ in range(TRAIN_STEPS):
        loss = loss_of("gpt", model, batch)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _step_by_phase(model, opt, rank: int, step: int) -> dict[str, dict[str, tuple[int, int, int]]]:
    """One training step; zcomm's counters per phase: op -> (calls, intra bytes, inter bytes)."""
    import zcomm

    def snapshot() -> dict[str, tuple[int, int, int]]:
        return {op: (s.calls, s.intra_bytes, s.inter_bytes) for op, s in zcomm.comm_stats().items()}

    zcomm.reset_comm_stats()
    loss = loss_of("gpt", model, local_slice(global_batch("gpt", step), rank, WORLD))
    forward = snapshot()
    zcomm.reset_comm_stats()
    opt.backward(loss)
    opt.step()
    return {"forward": forward, "backward": snapshot()}


def _exact_hpz(rank: int) -> dict:
    """fp32, varying batches: plain stage 3 and hpZ (2x2 and 1x4), losses, weights, traffic."""
    out = {}
    for name, zero, topology in (("s3", {}, "2x2"), ("hpZ", HPZ, "2x2"), ("hpZ-1x4", HPZ, "1x4")):
        model, opt = _initialize(zero, topology=topology)
        losses = zero_steps("gpt", model, opt, rank, WORLD, range(EXACT_STEPS))
        phases = _step_by_phase(model, opt, rank, EXACT_STEPS)
        fallbacks = getattr(opt.plan.backward_gather, "primary_fallbacks", None)
        out[name] = {"losses": losses, "weights": opt.full_state_dict(), "phases": phases, "fallbacks": fallbacks}
    return out


def _stale_secondaries(rank: int, root: str) -> dict:
    """Weights replaced between steps (checkpoint, state dict) and written in place between a
    forward and its backward: hpZ, and stage 3 without prefetching, must compute exactly what
    plain stage 3 computes (see [Note: gathers follow the shards] in ``_stage3``)."""
    out = {}
    for name, zero in (("s3", {}), ("hpZ", HPZ), ("s3-no-prefetch", {"stage3_prefetch_bucket_size": 0})):
        directory = Path(root) / name
        model, opt = _initialize(zero)
        zero_steps("gpt", model, opt, rank, WORLD, range(2))
        snapshot = copy.deepcopy(opt.state_dict())  # torch optimizer state comes by reference
        opt.save_checkpoint(directory)
        continued = zero_steps("gpt", model, opt, rank, WORLD, range(2, 4))
        opt.load_checkpoint(directory)
        after_checkpoint = zero_steps("gpt", model, opt, rank, WORLD, range(2, 4))
        opt.load_state_dict(snapshot)
        after_state_dict = zero_steps("gpt", model, opt, rank, WORLD, range(2, 4))
        loss = loss_of("gpt", model, local_slice(global_batch("gpt", 4), rank, WORLD))
        with torch.no_grad():
            for unit in opt.units:
                unit.shard.mul_(0.5)  # after the forward: backward must see this, as plain stage 3 does
        opt.backward(loss)
        opt.step()
        written = zero_steps("gpt", model, opt, rank, WORLD, range(5, 6))
        fresh_model, fresh_opt = _initialize(zero)
        fresh_opt.load_checkpoint(directory)
        fresh = zero_steps("gpt", fresh_model, fresh_opt, rank, WORLD, range(2, 4))
        out[name] = {"continued": continued, "after_checkpoint": after_checkpoint,
                     "after_state_dict": after_state_dict, "fresh": fresh, "written": written,
                     "weights": opt.full_state_dict(),
                     "fallbacks": getattr(opt.plan.backward_gather, "primary_fallbacks", None)}
    return out


def _traffic(rank: int) -> dict:
    """bf16 on 2x2: zcomm's counters for one step after the first (which records the trace)."""
    out = {}
    for name, zero in (("s3", {}), ("s3-no-prefetch", {"stage3_prefetch_bucket_size": 0}),
                       ("ZeRO++", OPTIONS["ZeRO++"]), ("ZeRO++ defaults", OPTIONS["ZeRO++ defaults"])):
        model, opt = _initialize(zero, precision="bf16")
        launched = []
        model.tok.register_full_backward_pre_hook(
            lambda *_, launched=launched, opt=opt: launched.append(opt.reducer.launched))
        zero_steps("gpt", model, opt, rank, WORLD, range(1))
        out[name] = _step_by_phase(model, opt, rank, 1)
        if name == "ZeRO++":
            out["memory"] = tuple(opt.memory_report())
            out["padded_numel"] = sum(u.layout.numel for u in opt.units)
        if name == "ZeRO++ defaults":
            out["buckets"], out["launched"] = len(opt.reducer.buckets), launched
            out["whole_units"] = sum(not unit.partitioned for unit in opt.units)
    return out


def _local_grad_absmax(opt, rank: int) -> torch.Tensor:
    """Per unit, the largest |gradient| of this rank's own batch slice (unwrapped model)."""
    model = make_model("gpt")
    loss_of("gpt", model, local_slice(global_batch("gpt", 0), rank, WORLD)).backward()
    grads = dict(model.named_parameters())
    return torch.tensor([max(grads[n].grad.abs().max().item() for n in u.names) for u in opt.units])


def _one_backward(zero: dict, rank: int):
    model, opt = _initialize({"reduce_bucket_size": 1, **zero})  # one unit per bucket
    captured = {}

    def capture(module, args):
        for unit in opt.hooks._static[module]:
            captured.setdefault(unit.index, unit.full.detach().clone())

    for module in model.modules():
        module.register_forward_pre_hook(capture)  # after the runtime's: the unit is gathered
    opt.backward(loss_of("gpt", model, local_slice(global_batch("gpt", 0), rank, WORLD)))
    return opt, captured


def _numerics(rank: int) -> dict:
    """fp32, 2x2, step 0: gradients (qgZ) and gathered weights (qwZ) against plain stage 3."""
    import torch.distributed as dist

    plain, _ = _one_backward({}, rank)
    qgz, _ = _one_backward(QGZ, rank)
    qwz, gathered = _one_backward(QWZ, rank)
    local = _local_grad_absmax(plain, rank)
    absmax = torch.empty(WORLD * local.numel())
    dist.all_gather_into_tensor(absmax, local)
    exact = make_model("gpt").state_dict()
    return {
        "plain_grads": [u.grad_shard.clone() for u in plain.units],
        "qgz_grads": [u.grad_shard.clone() for u in qgz.units],
        "grad_absmax": absmax.view(WORLD, -1),  # (rank, unit)
        "gathered": gathered,
        "exact_flat": {u.index: u.layout.flatten([exact[n] for n in u.names], dtype=torch.float32)
                       for u in qwz.units},
    }


def _group_size_bytes(rank: int) -> dict:
    """zcomm_quant_group_size reaches the collectives: bytes of one step per group size."""
    from zero_runtime._contract import Phase

    out = {}
    for size in (64, "tensor"):
        model, opt = _initialize({**QWZ, **QGZ, "zcomm_quant_group_size": size, "reduce_bucket_size": 1})
        zero_steps("gpt", model, opt, rank, WORLD, range(1))
        phases = _step_by_phase(model, opt, rank, 1)
        out[size] = {"phases": phases, "buckets": [u.layout.shard_numel for u in opt.units],
                     "first_hop_bits": opt.config.qgz_first_hop_bits,
                     "forward_gathers": [use.unit.layout.shard_numel for use in opt.scheduler.trace.uses
                                         if use.phase is Phase.FORWARD]}
    return out


def _everything(rank: int, world: int, root: str) -> dict:
    assert world == WORLD
    return {
        "train": {(option, topology): _fixed_batch_losses(zero, topology, rank)
                  for option, zero in OPTIONS.items() for topology in ("2x2", "1x4")},
        "exact": _exact_hpz(rank),
        "stale": _stale_secondaries(rank, root),
        "traffic": _traffic(rank),
        "numerics": _numerics(rank),
        "group_size": _group_size_bytes(rank),
    }


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run(_everything, WORLD, root, env={"ZCOMM_LOCAL_SIZE": "2"})  # the ranks detect 2 nodes x 2


@pytest.mark.slow
def test_each_option_alone_and_all_together_train_on_2x2_and_1x4(results):
    for rank_results in results:
        for (option, topology), losses in rank_results["train"].items():
            assert all(map(math.isfinite, losses)), (option, topology, losses)
            assert losses[-1] < 0.8 * losses[0], (option, topology, losses)


def test_qgz_first_hop_and_hadamard_keys_are_validated():
    from zero_runtime.config import ZeroConfig

    def parse(**zero):
        return ZeroConfig.from_dict({"zero_optimization": {"stage": 3, **zero}})

    config = parse(**QGZ, zcomm_qgz_first_hop_bits=8, zcomm_qgz_hadamard_block=256)
    assert (config.qgz_first_hop_bits, config.qgz_hadamard_block) == (8, 256)
    assert (parse(**QGZ).qgz_first_hop_bits, parse(**QGZ).qgz_hadamard_block) == (4, None)
    for block in (0, 96, 2.0, True):
        with pytest.raises(ValueError, match="zcomm_qgz_hadamard_block must be a power of two"):
            parse(**QGZ, zcomm_qgz_hadamard_block=block)
    with pytest.raises(ValueError, match="zcomm_qgz_first_hop_bits must be 4 or 8"):
        parse(**QGZ, zcomm_qgz_first_hop_bits=6)
    for key, value in (("zcomm_qgz_hadamard_block", 64), ("zcomm_qgz_first_hop_bits", 8)):
        with pytest.raises(ValueError, match=f"{key} .*needs zero_quantized_gradients"):
            parse(**{key: value})
        with pytest.raises(ValueError, match=f"{key} .*cannot be combined with zeropp_loco_param"):
            parse(**QGZ, **{key: value}, zeropp_loco_param={})


@pytest.mark.slow
def test_hpz_without_quantization_is_bit_identical_to_stage3(results):
    exact = results[0]["exact"]
    for name in ("hpZ", "hpZ-1x4"):
        assert exact[name]["losses"] == exact["s3"]["losses"], name
        assert exact[name]["weights"].keys() == exact["s3"]["weights"].keys()
        for key, want in exact["s3"]["weights"].items():
            assert torch.equal(exact[name]["weights"][key], want), (name, key)


@pytest.mark.slow
def test_hpz_backward_gathers_stay_inside_the_node(results):
    for rank, rank_results in enumerate(results):
        exact = rank_results["exact"]
        for name in ("hpZ", "hpZ-1x4"):
            calls, intra, inter = exact[name]["phases"]["backward"]["all_gather_into_tensor"]
            assert calls > 0 and intra > 0 and inter == 0, (rank, name)
            assert exact[name]["fallbacks"] == 0, (rank, name)
        # The counters can see inter-node gathers: plain stage 3's ring crosses nodes on ranks 1 and 3.
        plain_inter = exact["s3"]["phases"]["backward"]["all_gather_into_tensor"][2]
        assert (plain_inter > 0) == (rank % 2 == 1), rank


@pytest.mark.slow
def test_hpz_never_serves_stale_secondaries(results):
    for rank_results in results:
        stale = rank_results["stale"]
        for name in ("s3", "hpZ", "s3-no-prefetch"):
            runs = stale[name]
            assert runs["after_checkpoint"] == runs["continued"] == runs["fresh"], name
            assert runs["after_state_dict"] == runs["continued"], name
        assert stale["hpZ"]["written"] == stale["s3"]["written"] == stale["s3-no-prefetch"]["written"]
        # Every secondary was invalidated by the in-place write between forward and backward.
        assert stale["hpZ"]["fallbacks"] > 0
    weights = results[0]["stale"]
    for key, want in weights["s3"]["weights"].items():
        assert torch.equal(weights["hpZ"]["weights"][key], want), key
        assert torch.equal(weights["s3-no-prefetch"]["weights"][key], want), key


def _inter_bytes(step: dict) -> int:
    return sum(inter for phase in step.values() for _, _, inter in phase.values())


@pytest.mark.slow
def test_zeropp_inter_node_bytes_at_most_0_3_of_stage3(results):
    plain = sum(_inter_bytes(r["traffic"]["s3"]) for r in results)
    zeropp = sum(_inter_bytes(r["traffic"]["ZeRO++"]) for r in results)
    ratio = zeropp / plain
    print(f"inter-node bytes per step on 2x2 (bf16 TinyGPT), all ranks: ZeRO++ {zeropp}, stage 3 {plain}, "
          f"ratio {ratio:.3f}")
    assert ratio <= 0.3
    for rank_results in results:
        assert rank_results["traffic"]["ZeRO++"]["backward"]["all_gather_into_tensor"][2] == 0


@pytest.mark.slow
def test_zeropp_with_deepspeed_residency_defaults_reduces_qgz_buckets_during_backward(results):
    """Units kept from forward to backward: backward gathers nothing (so hpZ has nothing to
    do; the INT8 all-gathers after backward are the persistent units', after the step) and
    the qgZ buckets go through reduce_scatter_q4 as their gradients become final, most of
    them before the token embedding (the last module backward reaches) runs."""
    for rank_results in results:
        traffic = rank_results["traffic"]
        after_forward = traffic["ZeRO++ defaults"]["backward"]
        assert traffic["whole_units"] > 0
        assert "all_gather_into_tensor" not in after_forward
        assert after_forward["all_gather_q8"][0] == traffic["whole_units"]
        buckets = traffic["buckets"]
        assert buckets > 2 and after_forward["reduce_scatter_q4"][0] == buckets
        assert all(buckets - 2 <= launched < buckets for launched in traffic["launched"]), traffic["launched"]


@pytest.mark.slow
def test_prefetch_issues_each_gather_once_with_a_tied_embedding(results):
    """TinyGPT's LM head gathers the embedding's unit a second time in forward; prefetching
    must follow that trace, not re-gather every unit after the embedding: it only moves
    gathers earlier, or saves those whose use the prefetch window already covered."""
    def calls(step: dict) -> int:
        return sum(phase.get("all_gather_into_tensor", (0,))[0] for phase in step.values())

    for rank_results in results:
        traffic = rank_results["traffic"]
        units = 15  # two blocks of 6 modules, two embeddings and the final norm, each its own unit
        assert calls(traffic["s3-no-prefetch"]) == 2 * units + 1
        assert units < calls(traffic["s3"]) <= calls(traffic["s3-no-prefetch"])
        assert traffic["s3"]["backward"]["reduce_scatter_tensor"] == traffic["s3-no-prefetch"]["backward"][
            "reduce_scatter_tensor"]


@pytest.mark.slow
def test_memory_report_counts_the_hpz_secondary_as_the_estimator_does(results):
    from zero_runtime.estimate import hpz_estimate

    for rank_results in results:
        traffic = rank_results["traffic"]
        secondary = traffic["memory"][3]
        assert secondary == hpz_estimate(params=traffic["padded_numel"], world_size=WORLD, partition_size=2).secondary


@pytest.mark.slow
def test_qgz_gradients_within_the_int4_bound_and_averaged_over_the_world(results):
    """See [Note: ZeRO++ error bounds]."""
    for rank, rank_results in enumerate(results):
        numerics = rank_results["numerics"]
        bounds = numerics["grad_absmax"].sum(dim=0) / 7 / WORLD * (1 + 1e-4)
        errors = []
        would_catch_node_count = False
        for unit, (got, want) in enumerate(zip(numerics["qgz_grads"], numerics["plain_grads"], strict=True)):
            error = (got - want).abs().max().item()
            assert error <= bounds[unit], (rank, unit, error, bounds[unit].item())
            errors.append(error)
            would_catch_node_count |= want.abs().max().item() > 2 * bounds[unit].item()
        assert max(errors) > 0, "qgZ gradients are exact: was the quantized path used?"
        assert would_catch_node_count, rank


@pytest.mark.slow
def test_qwz_gathered_weights_within_the_int8_bound(results):
    """See [Note: ZeRO++ error bounds]; shards are the ranks' equal slices of each unit's flat buffer."""
    for rank_results in results:
        numerics = rank_results["numerics"]
        assert numerics["gathered"].keys() == numerics["exact_flat"].keys()
        quantized = False
        for unit, got in numerics["gathered"].items():
            exact = numerics["exact_flat"][unit]
            for got_shard, exact_shard in zip(got.chunk(WORLD), exact.chunk(WORLD), strict=True):
                bound = exact_shard.abs().max().item() / 254 * (1 + 1e-4)
                assert (got_shard - exact_shard).abs().max().item() <= bound, unit
            quantized |= not torch.equal(got, exact)
        assert quantized


def _ceil_div(numel: int, divisor: int) -> int:
    return -(-numel // divisor)


def _payload(numel: int, bits: int, groups: int) -> int:
    """Wire-format bytes: values (INT8: 1 byte, INT4: half a byte each) padded to 4, then 4 per scale."""
    values = numel if bits == 8 else _ceil_div(numel, 2)
    return _ceil_div(values, 4) * 4 + 4 * groups


@pytest.mark.slow
def test_quant_group_size_sets_the_scales_per_payload(results):
    """zcomm's byte model on 2x2 (N = L = 2): all_gather_q8 of a P-byte INT8 payload sends
    (N-1) P across nodes and (L-1) N P inside; reduce_scatter_q4 of a bucket with an
    m-element shard sends (L-1) payloads of N*m elements inside the node (at the first hop's
    width: INT4 by default) and (N-1) INT4 payloads of m across."""
    nodes = local = 2
    for rank, rank_results in enumerate(results):
        for size, run_ in rank_results["group_size"].items():
            groups = (lambda numel: 1) if size == "tensor" else functools.partial(_ceil_div, divisor=size)
            payloads = [_payload(n, 8, groups(n)) for n in run_["forward_gathers"]]
            assert run_["phases"]["forward"]["all_gather_q8"] == (
                len(payloads), sum((local - 1) * nodes * p for p in payloads), sum((nodes - 1) * p for p in payloads))
            buckets, first = run_["buckets"], run_["first_hop_bits"]
            assert first == 4
            assert run_["phases"]["backward"]["reduce_scatter_q4"] == (
                len(buckets), sum((local - 1) * _payload(nodes * m, first, groups(nodes * m)) for m in buckets),
                sum((nodes - 1) * _payload(m, 4, groups(m)) for m in buckets)), (rank, size)
