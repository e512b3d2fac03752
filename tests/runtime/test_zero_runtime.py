"""Mixed precision, loss scaling, memory reports, checkpoints and bad input, on 2 gloo ranks.

Spawns are few and each checks many things (the CI machine has two cores): one run trains
and saves, a fresh set of processes resumes from the checkpoint, and a single-process run
checks a world-size mismatch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from zero_harness import run
from zero_runtime.comm._grad_reduce import MAX_IN_FLIGHT
from zero_workloads import global_batch, local_slice, loss_of, make_model, make_optimizer, zero_steps

CHECKPOINTED = {  # name -> (model, config); resumed in fresh processes
    "gpt-s3-bf16": ("gpt", {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 512},
                            "bf16": {"enabled": True}}),
    "mlp-s2-fp16": ("mlp", {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 8}}),
}
SAVE_AT, STOP_AT = 3, 6


def _initialize(kind, config):
    import zero_runtime

    return zero_runtime.initialize(make_model(kind), make_optimizer(), config)


def _fixed_batch_losses(kind: str, config: dict, rank: int, world: int, steps: int) -> list[float]:
    """Train on one fixed batch (memorisation: the loss must fall)."""
    model, opt = _initialize(kind, config)
    batch = local_slice(global_batch(kind, 0), rank, world)
    losses = []
    for _ in range(steps):
        loss = loss_of(kind, model, batch)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _fp16_overflow(rank: int, world: int) -> dict:
    """Rank 1 alone gets an inf gradient on step 2; every rank must skip it and halve the scale."""
    config = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    model, opt = _initialize("mlp", config)
    log = []
    for step in range(4):
        batch = local_slice(global_batch("mlp", step), rank, world)
        handle = None
        if step == 2 and rank == 1:
            handle = model.layers[0].weight.register_hook(lambda g: g * float("inf"))
        before = [u.master.detach().clone() for u in opt.units]
        opt.backward(loss_of("mlp", model, batch))
        opt.step()
        if handle is not None:
            handle.remove()
        unchanged = all(torch.equal(b, u.master) for b, u in zip(before, opt.units, strict=True))
        log.append((opt.last_step_skipped, opt.loss_scale, unchanged, opt.global_step))
    return {"log": log}


# Stage 3 without DeepSpeed's residency: every parameter partitioned, one unit per module,
# no prefetch, each unit freed after every use.
FREE_AFTER_USE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "zcomm_stage3_fuse_numel": 0, "stage3_prefetch_bucket_size": 0}
PERSISTENCE_THRESHOLD = 512  # the GPT's norms, biases and position embedding (16 x 32) are persistent
MEMORY_CONFIGS = {
    1: {"stage": 1},
    2: {"stage": 2},
    3: FREE_AFTER_USE,
    "3-persistent": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD},
}


def _memory_reports(rank: int, world: int) -> dict:
    out = {}
    for name, zero in MEMORY_CONFIGS.items():
        model, opt = _initialize("gpt", {"zero_optimization": {**zero, "reduce_bucket_size": 4000},
                                         "bf16": {"enabled": True}})
        zero_steps("gpt", model, opt, rank, world, range(1))
        padded = sum(u.layout.numel for u in opt.units)
        out[name] = (tuple(opt.memory_report()), padded, len(opt.units))
    return out


def _traffic(rank: int, world: int) -> dict:
    """Bytes each rank sends per step (zcomm's counters) and stage-3 prefetch and keep counts."""
    import zcomm

    out = {}
    configs = {
        "s2": {"stage": 2},
        "s3": FREE_AFTER_USE,
        "s3-prefetch": {**FREE_AFTER_USE, "stage3_prefetch_bucket_size": 10**6},
        "s3-keep": {**FREE_AFTER_USE, "stage3_max_reuse_distance": 10**9},  # DeepSpeed's default
        "s3-persistent": {"stage": 3},  # DeepSpeed's defaults: every parameter of the MLP is persistent
    }
    for name, zero in configs.items():
        model, opt = _initialize("mlp", {"zero_optimization": zero, "bf16": {"enabled": True}})
        zero_steps("mlp", model, opt, rank, world, range(1))  # the first step records the order
        zcomm.reset_comm_stats()
        zero_steps("mlp", model, opt, rank, world, range(1, 2))
        stats = zcomm.comm_stats()
        out[name] = {
            "gather": stats["all_gather_into_tensor"].total_bytes,
            "reduce_scatter": stats["reduce_scatter_tensor"].total_bytes,
            "shard_bytes": sum(u.grad_shard.numel() * 2 for u in opt.units),
            "prefetches": opt.scheduler.prefetches if opt.scheduler else 0,
            "kept": opt.scheduler.kept if opt.scheduler else 0,
            "partitioned": sum(u.partitioned for u in opt.units),
        }
    return out


def _gathers_per_step(rank: int, world: int) -> dict:
    """Stage-3 units and all-gather calls of one step of the GPT (blocks of 12,704 elements,
    28,032 in all), one unit per module and with blocks fused, freed after each use or kept
    from forward to backward (DeepSpeed's default reuse distance)."""
    import zcomm

    out = {}
    for name, zero in (("per-module", FREE_AFTER_USE), ("fused", {**FREE_AFTER_USE, "zcomm_stage3_fuse_numel": 13_000}),
                       ("fused-kept", {**FREE_AFTER_USE, "zcomm_stage3_fuse_numel": 13_000,
                                       "stage3_max_reuse_distance": 10**9})):
        model, opt = _initialize("gpt", {"zero_optimization": zero})
        zero_steps("gpt", model, opt, rank, world, range(1))
        zcomm.reset_comm_stats()
        zero_steps("gpt", model, opt, rank, world, range(1, 2))
        out[name] = (len(opt.units), zcomm.comm_stats()["all_gather_into_tensor"].calls)
    return out


def _live_limit(rank: int, world: int) -> dict:
    """``stage3_max_live_parameters``: the gathered elements observed after every module's
    forward and every gradient of two steps with everything kept (reuse distance 1e9) but a
    live limit of about a third of the model."""
    from zero_runtime._partition import GatherState

    model, opt = _initialize("gpt", {"zero_optimization": {**FREE_AFTER_USE, "stage3_max_reuse_distance": 10**9,
                                                           "stage3_max_live_parameters": 10_000}})
    seen = []

    def observe(*_):
        seen.append(sum(u.layout.numel for u in opt.scheduler.units if u.state is not GatherState.FREE))

    for module in model.modules():  # after the runtime's hooks, so each sees its release
        module.register_forward_hook(observe)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(observe)
    zero_steps("gpt", model, opt, rank, world, range(2))
    largest = max(u.layout.numel for u in opt.scheduler.units)
    return {"seen": seen, "largest_unit": largest, "kept": opt.scheduler.kept}


def _overlap(rank: int, world: int) -> dict:
    """Gradient buckets launched before the token embedding's backward (the last module to
    run backward), with per-module units and small buckets."""
    import torch.distributed as dist

    launched = {}
    for overlap in (True, False):
        model, opt = _initialize("gpt", {"zero_optimization": {**FREE_AFTER_USE, "reduce_bucket_size": 3000,
                                                               "overlap_comm": overlap}})
        launched[overlap] = []
        model.tok.register_full_backward_pre_hook(
            lambda *_, hits=launched[overlap], opt=opt: hits.append(opt.reducer.launched))
        if overlap:
            in_flight = []
            for module in model.modules():
                module.register_full_backward_pre_hook(
                    lambda *_, in_flight=in_flight, opt=opt: in_flight.append(len(opt.reducer._in_flight)))
        zero_steps("gpt", model, opt, rank, world, range(2))
    group, gradients = opt.plan.group, opt.plan.reduce_scatter.group
    return {"launched": launched[True], "not_overlapped": launched[False], "in_flight": in_flight,
            "buckets": [[u.layout.numel for u in b] for b in opt.reducer.buckets],
            "own_group": gradients is not group
                         and dist.get_process_group_ranks(gradients) == dist.get_process_group_ranks(group)}


def _stage3_reads(rank: int, world: int) -> dict:
    """Stage-3 parameters read outside a forward: through the module they are gathered,
    through ``parameters()`` they are empty (never freed memory), and training goes on."""
    model, opt = _initialize("mlp", {"zero_optimization": FREE_AFTER_USE})
    zero_steps("mlp", model, opt, rank, world, range(1))
    freed = [p.numel() for p in model.parameters()]
    read = model.layers[0].weight.detach().clone()
    full = opt.full_state_dict()
    after = zero_steps("mlp", model, opt, rank, world, range(1, 2))
    return {"freed": freed, "read": read, "full": full.get("layers.0.weight"), "after": after}


def _bad_input(rank: int, world: int) -> dict:
    import zero_runtime

    errors = {}
    model, opt = _initialize("mlp", {"zero_optimization": {"stage": 2}})
    try:
        opt.step()
    except RuntimeError as err:
        errors["step_without_backward"] = str(err)
    frozen = make_model("mlp").requires_grad_(False)
    try:
        zero_runtime.initialize(frozen, make_optimizer(), {"zero_optimization": {"stage": 2}})
    except ValueError as err:
        errors["no_trainable"] = str(err)
    model = make_model("mlp")
    template = torch.optim.AdamW([{"params": model.layers[0].parameters()},
                                  {"params": model.layers[1:].parameters(), "weight_decay": 0.0}])
    template.param_groups[1]["params"].append(model.layers[0].weight)
    try:
        zero_runtime.initialize(model, template, {"zero_optimization": {"stage": 2}})
    except ValueError as err:
        errors["two_groups"] = str(err)
    return errors


def _train_and_save(rank: int, world: int, root: str) -> dict:
    results = {
        "bf16": {(kind, stage): _fixed_batch_losses(kind, {"zero_optimization": {"stage": stage},
                                                           "bf16": {"enabled": True}}, rank, world, 12)
                 for kind, stage in (("mlp", 1), ("mlp", 2), ("gpt", 3))},
        "fp16": _fp16_overflow(rank, world),
        "memory": _memory_reports(rank, world),
        "traffic": _traffic(rank, world),
        "gathers": _gathers_per_step(rank, world),
        "live_limit": _live_limit(rank, world),
        "overlap": _overlap(rank, world),
        "stage3_reads": _stage3_reads(rank, world),
        "errors": _bad_input(rank, world),
    }
    for name, (kind, config) in CHECKPOINTED.items():
        model, opt = _initialize(kind, config)
        zero_steps(kind, model, opt, rank, world, range(SAVE_AT))
        opt.save_checkpoint(Path(root) / name)
        results[name] = zero_steps(kind, model, opt, rank, world, range(SAVE_AT, STOP_AT))
    return results


def _resume(rank: int, world: int, root: str) -> dict:
    from zero_runtime import CheckpointError

    results = {}
    for name, (kind, config) in CHECKPOINTED.items():
        model, opt = _initialize(kind, config)
        initial = [u.master.detach().clone() for u in opt.units]
        try:
            opt.load_checkpoint(Path(root) / f"{name}-truncated")
        except CheckpointError as err:
            results[f"{name}-truncated"] = str(err)
        results[f"{name}-untouched"] = all(torch.equal(a, u.master) for a, u in zip(initial, opt.units, strict=True))
        other = "mlp-s2-fp16" if name == "gpt-s3-bf16" else "gpt-s3-bf16"
        try:
            opt.load_checkpoint(Path(root) / other)
        except CheckpointError as err:
            results[f"{name}-other-model"] = str(err)
        opt.load_checkpoint(Path(root) / name)
        results[name] = zero_steps(kind, model, opt, rank, world, range(SAVE_AT, STOP_AT))
        full = opt.full_state_dict()  # collective: every rank calls it, rank 0 gets the weights
        if rank == 0:
            fresh = make_model(kind)
            fresh.load_state_dict(full)
            results[f"{name}-full"] = loss_of(kind, fresh, global_batch(kind, 0)).item()
    return results


def _single_rank_loads(rank: int, world: int, root: str) -> list[str]:
    from zero_runtime import CheckpointError

    model, opt = _initialize("gpt", CHECKPOINTED["gpt-s3-bf16"][1])
    opt.load_checkpoint(Path(root) / "gpt-s3-bf16")  # resharded from 2 ranks (tests/runtime/test_reshard.py)
    messages = []
    for name in ("gpt-s3-bf16-truncated", "incomplete"):
        with pytest.raises(CheckpointError) as info:
            opt.load_checkpoint(Path(root) / name)
        messages.append(str(info.value))
    return messages


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    first = run(_train_and_save, 2, str(root))
    for name in CHECKPOINTED:
        broken = root / f"{name}-truncated"
        shutil.copytree(root / name, broken)
        data = (broken / "rank00001.pt").read_bytes()
        (broken / "rank00001.pt").write_bytes(data[: len(data) // 2])
    resumed = run(_resume, 2, str(root))
    return first, resumed, root


@pytest.mark.slow
def test_bf16_trains(runs):
    for rank_results in runs[0]:
        for kind, losses in rank_results["bf16"].items():
            assert losses[-1] < 0.7 * losses[0], (kind, losses)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_everywhere_and_halves_scale(runs):
    for rank_results in runs[0]:
        log = rank_results["fp16"]["log"]
        assert [entry[0] for entry in log] == [False, False, True, False]
        assert [entry[1] for entry in log] == [256.0, 256.0, 128.0, 128.0]
        assert log[2][2], "weights changed on the skipped step"
        assert [entry[3] for entry in log] == [1, 2, 2, 3]


@pytest.mark.slow
def test_memory_report_matches_formulas_within_padding(runs):
    """The ZeRO paper's formulas; stage 3's persistent parameters are whole on every rank
    (2 bytes each in bf16), while their gradients and optimizer states stay partitioned."""
    from zero_workloads import GPT

    model = make_model("gpt")
    psi = sum(p.numel() for p in model.parameters())  # the tied weight counts once
    whole = sum(p.numel() for p in model.parameters() if p.numel() <= PERSISTENCE_THRESHOLD)
    n = 2
    formulas = {1: (2 * psi, 2 * psi, 12 * psi / n), 2: (2 * psi, 2 * psi / n, 12 * psi / n),
                3: (2 * psi / n, 2 * psi / n, 12 * psi / n),
                "3-persistent": (2 * whole + 2 * (psi - whole) / n, 2 * psi / n, 12 * psi / n)}
    assert GPT.vocab_size and 0 < whole < psi / 4  # the tied-embedding GPT, some of it persistent
    for rank_results in runs[0]:
        for name, (report, padded, units) in rank_results["memory"].items():
            pad = padded - psi
            slack = (2 * pad, 2 * pad, 12 * pad + 8 * units)  # padding, plus Adam's step counters
            assert report[3] == 0  # no hpZ secondary without ZeRO++
            for got, want, extra in zip(report[:3], formulas[name], slack, strict=True):
                assert want <= got <= want + extra, (name, report, formulas[name])


@pytest.mark.slow
def test_traffic_per_step_is_2M_for_stage_2_and_3M_for_stage_3(runs):
    """ZeRO paper section 7: stage 2 moves a reduce-scatter and an all-gather of the model
    per step, stage 3 an extra all-gather (forward and backward); ring bytes per rank are
    (W - 1) x shard. Keeping units from forward to backward (DeepSpeed's reuse distance, or
    a prefetch window that already covers the backward use) drops the backward gather, and
    persistent parameters are gathered once, after the step: 2M either way."""
    for rank_results in runs[0]:
        traffic = rank_results["traffic"]
        for name, gathers in (("s2", 1), ("s3", 2), ("s3-prefetch", 1), ("s3-keep", 1), ("s3-persistent", 1)):
            shard = traffic[name]["shard_bytes"]
            assert traffic[name]["reduce_scatter"] == shard  # (W - 1) = 1 on two ranks
            assert traffic[name]["gather"] == gathers * shard, name
        assert traffic["s3"]["prefetches"] == traffic["s3"]["kept"] == 0
        assert traffic["s3-prefetch"]["prefetches"] > 0 and traffic["s3-prefetch"]["kept"] > 0
        assert traffic["s3-keep"]["kept"] > 0
        assert traffic["s3-persistent"]["partitioned"] == 0 and traffic["s3"]["partitioned"] == 3


@pytest.mark.slow
def test_fused_blocks_gather_once_per_block_and_phase(runs):
    """With ``zcomm_stage3_fuse_numel`` a block is one unit, gathered once in forward and once
    in backward, not once per module (token and position embeddings, 2 blocks, final norm);
    the tied LM head re-gathers the token embedding in forward either way. Kept from forward
    to backward, each unit is gathered once per step, the tied embedding included."""
    for rank_results in runs[0]:
        gathers = rank_results["gathers"]
        (per_module, per_module_calls), (fused, fused_calls) = gathers["per-module"], gathers["fused"]
        assert fused == 5 and per_module > 2 * fused
        assert per_module_calls == 2 * per_module + 1
        assert fused_calls == 2 * fused + 1
        assert gathers["fused-kept"] == (fused, fused)


@pytest.mark.slow
def test_live_parameters_stay_within_the_limit(runs):
    """Kept units never make more than ``stage3_max_live_parameters`` live, beyond one unit
    gathered on demand; without the limit the reuse distance would keep all 28k elements."""
    for rank_results in runs[0]:
        live = rank_results["live_limit"]
        assert live["kept"] > 0
        assert max(live["seen"]) <= 10_000 + live["largest_unit"], live


@pytest.mark.slow
def test_gradient_buckets_are_reduced_during_backward(runs):
    """Buckets of at most ``reduce_bucket_size`` elements (a larger unit alone) are launched
    as their gradients become final: before the token embedding (the last module backward
    reaches) runs its backward, all but the buckets waiting for it are in flight, on a
    group of their own over the same ranks; with ``overlap_comm`` false, none is."""
    for rank_results in runs[0]:
        overlap = rank_results["overlap"]
        buckets = overlap["buckets"]
        assert all(sum(b) <= 3000 or len(b) == 1 for b in buckets) and len(buckets) > 4
        assert len(overlap["launched"]) == 2  # one backward per step
        assert all(len(buckets) - 2 <= launched < len(buckets) for launched in overlap["launched"]), overlap
        assert overlap["own_group"]  # see [Note: gradient group]: gathers never queue behind them
        assert overlap["not_overlapped"] == [0, 0]  # overlap_comm false: all launched after backward
        # See [Note: gradient buffer lifetimes]: never more than MAX_IN_FLIGHT buckets' gradients
        # held, although nearly all buckets are launched before backward ends.
        assert max(overlap["in_flight"]) == MAX_IN_FLIGHT < len(buckets) - 2


@pytest.mark.slow
def test_stage3_parameters_read_outside_forward(runs):
    reads = [r["stage3_reads"] for r in runs[0]]
    for rank_reads in reads:
        assert rank_reads["freed"] == [0] * len(rank_reads["freed"])
        assert torch.isfinite(torch.tensor(rank_reads["after"])).all()
    assert torch.equal(reads[0]["read"], reads[0]["full"])
    assert torch.equal(reads[1]["read"], reads[0]["full"])


@pytest.mark.slow
def test_bad_input_gives_clear_errors(runs):
    errors = runs[0][0]["errors"]
    assert "step() called without backward()" in errors["step_without_backward"]
    assert "no trainable parameters" in errors["no_trainable"]
    assert "layers.0.weight is in optimizer groups 0 and 1" in errors["two_groups"]


@pytest.mark.slow
def test_checkpoint_resume_is_bit_identical(runs):
    first, resumed, _ = runs
    for rank in range(2):
        for name in CHECKPOINTED:
            assert resumed[rank][name] == first[rank][name], name


@pytest.mark.slow
def test_damaged_or_foreign_checkpoints_are_rejected_untouched(runs):
    first, resumed, root = runs
    for name in CHECKPOINTED:
        assert "truncated" in resumed[1][f"{name}-truncated"]
        assert "another rank" in resumed[0][f"{name}-truncated"]
        for rank in range(2):
            assert resumed[rank][f"{name}-untouched"]
            assert "another model" in resumed[rank][f"{name}-other-model"]
    incomplete = root / "incomplete"  # as if the save crashed before meta.json was written
    shutil.copytree(root / "gpt-s3-bf16", incomplete)
    (incomplete / "meta.json").unlink()
    truncated, no_meta = run(_single_rank_loads, 1, str(root))[0]
    assert "truncated" in truncated  # a 1-rank load reads every rank's file
    assert "no complete checkpoint" in no_meta


@pytest.mark.slow
def test_full_state_dict_loads_into_the_unwrapped_model(runs):
    for name in CHECKPOINTED:
        assert torch.isfinite(torch.tensor(runs[1][0][f"{name}-full"]))
