"""Checkpoints that move: an HF GPT-2 trained at stage 3 on 4 gloo
ranks and saved, loaded at stage 2 on 2 ranks and at stage 1 on 1 rank (other buckets, other
padding). Oracles: the per-parameter fp32 masters and Adam states that the saving ranks held,
assembled here from their shards and slot offsets (not by the runtime's consolidation); and the
4-rank run that took one more step without resharding, against which one step of each resharded
run (same global batch) is compared. A checkpoint of another model is refused, naming the
parameters, with the model untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_harness import run

pytest.importorskip("transformers")

SAVED_WORLD = 4
STAGES = {4: 3, 2: 2, 1: 1}  # world size -> stage
STATES = ("exp_avg", "exp_avg_sq")


def _gpt2(n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=n_layer, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.transformer.wpe.requires_grad_(False)  # frozen: partitioned at stage 3, no optimizer state
    return model


def _initialize(world: int, n_layer: int = 2, offload: bool = False):
    import zero_runtime

    config = {"zero_optimization": {"stage": STAGES[world], "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 3000}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return zero_runtime.initialize(_gpt2(n_layer), lambda p: torch.optim.AdamW(p, lr=1e-2), config)


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's part of step ``step``'s global batch of 8 sequences (the same at every world size)."""
    per = SAVED_WORLD // world
    return torch.cat([torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + r))
                      for r in range(rank * per, (rank + 1) * per)])


def _step(model, opt, step: int, rank: int, world: int) -> None:
    tokens = _batch(step, rank, world)
    opt.backward(model(input_ids=tokens, labels=tokens).loss)
    opt.step()


def _shards(opt) -> list[dict]:
    """What this rank holds, with where it lies: per unit its names, slots, padded size, shard range,
    master shard and Adam states."""
    out = []
    for unit in opt.units:
        state = opt.optimizer.state[unit.master]
        slots = zip(unit.names, unit.layout.slots, strict=True)
        out.append({"slots": [(n, s.offset, s.numel, tuple(s.shape)) for n, s in slots],
                    "numel": unit.layout.numel, "range": unit.layout.shard_range(opt.plan.rank),
                    "master": unit.master.detach().clone(), "step": float(state["step"]),
                    **{k: state[k].detach().clone() for k in STATES}})
    return out


def _assemble(ranks: list[list[dict]]) -> dict[str, dict]:
    """Per parameter name: its full master and states and the step, from every rank's shards;
    asserts that each unit's padding is zero."""
    out = {}
    for u in range(len(ranks[0])):
        units = [r[u] for r in ranks]
        full = {}
        for key in ("master", *STATES):
            flat = torch.zeros(units[0]["numel"])
            for unit in units:
                flat[unit["range"][0]:unit["range"][1]] = unit[key]
            full[key] = flat
        used = torch.zeros(units[0]["numel"], dtype=torch.bool)
        for name, offset, numel, shape in units[0]["slots"]:
            used[offset:offset + numel] = True
            out[name] = {k: v[offset:offset + numel].view(shape) for k, v in full.items()}
            out[name]["step"] = units[0]["step"]
        for key, flat in full.items():
            assert not flat[~used].any(), f"non-zero padding in {key}"
    return out


def _save(rank: int, world: int, root: str) -> dict:
    model, opt = _initialize(world)
    for step in range(2):
        _step(model, opt, step, rank, world)
    opt.save_checkpoint(Path(root) / "ckpt")
    saved = _shards(opt)
    _step(model, opt, 2, rank, world)  # the run that continues without resharding
    return {"saved": saved, "continued": opt.full_state_dict(), "units": len(opt.units)}


def _load(rank: int, world: int, root: str) -> dict:
    from zero_runtime import CheckpointError

    out = {}
    if world == 1:  # another model (one more layer) is refused before anything changes
        model, opt = _initialize(world, n_layer=3)
        before = [u.master.detach().clone() for u in opt.units]
        with pytest.raises(CheckpointError) as info:
            opt.load_checkpoint(Path(root) / "ckpt")
        out["other-model"] = str(info.value)
        out["untouched"] = all(torch.equal(b, u.master) for b, u in zip(before, opt.units, strict=True))
    model, opt = _initialize(world)
    opt.load_checkpoint(Path(root) / "ckpt")
    out["loaded"] = _shards(opt)
    out["global_step"] = opt.global_step
    out["units"] = len(opt.units)
    _step(model, opt, 2, rank, world)
    out["stepped"] = opt.full_state_dict()
    out["steps_after"] = [float(opt.optimizer.state[u.master]["step"]) for u in opt.units]  # each its own counter
    if world == 1:  # into an offloaded optimizer (same format): its one step must equal the step above
        model, opt = _initialize(world, offload=True)
        opt.load_checkpoint(Path(root) / "ckpt")
        out["offloaded-loaded"] = opt.full_state_dict()
        _step(model, opt, 2, rank, world)
        out["offloaded-stepped"] = opt.full_state_dict()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    saved = run(_save, SAVED_WORLD, str(root))
    return saved, {world: run(_load, world, str(root)) for world in (2, 1)}


@pytest.mark.parametrize("world", [2, 1])
def test_masters_and_adam_states_are_bit_identical(runs, world):
    saved, loaded = runs
    want = _assemble([r["saved"] for r in saved])
    got = _assemble([r["loaded"] for r in loaded[world]])
    assert loaded[world][0]["units"] != saved[0]["units"]  # other buckets, not just other shards
    assert got.keys() == want.keys() and "lm_head.weight" not in want  # tied: one master
    for name, states in want.items():
        assert got[name]["step"] == states["step"] == 2.0, name
        for key in ("master", *STATES):
            assert torch.equal(got[name][key], states[key]), (name, key)
    assert all(r["global_step"] == 2 for r in loaded[world])


@pytest.mark.parametrize("world", [2, 1])
def test_training_continues_as_without_resharding(runs, world):
    saved, loaded = runs
    continued, stepped = saved[0]["continued"], loaded[world][0]["stepped"]
    before = _assemble([r["saved"] for r in saved])
    assert stepped.keys() == continued.keys()
    moved = max((continued[n] - before[n]["master"]).abs().max().item() for n in before)
    assert moved > 1e-3  # the step changes the weights by about lr
    for key, value in continued.items():
        # same global batch, other reduction order: gradients agree to fp32 rounding, so does Adam's step
        torch.testing.assert_close(stepped[key], value, rtol=0, atol=1e-6, msg=key)
    assert all(steps == [3.0] * len(steps) for steps in (r["steps_after"] for r in loaded[world]))


def test_another_model_is_refused_naming_parameters(runs):
    result = runs[1][1][0]
    assert "another model" in result["other-model"]
    assert "12 parameter(s) differ" in result["other-model"]  # layer h.2's 12 trained parameters
    assert "transformer.h.2.attn.c_proj.weight (missing from the checkpoint)" in result["other-model"]
    assert result["untouched"]


def test_loads_into_an_offloaded_optimizer(runs):
    saved, loaded = runs
    want = _assemble([r["saved"] for r in saved])
    result = loaded[1][0]
    for name, states in want.items():
        assert torch.equal(result["offloaded-loaded"][name], states["master"]), name
    for key, value in result["stepped"].items():  # offloaded training is bit-identical to training without
        assert torch.equal(result["offloaded-stepped"][key], value), key
