"""``GatheredParameters`` and ``state_dict()`` under stage 3, with an unmodified Hugging Face
GPT-2 built from a config (nothing downloaded), on 2 gloo ranks.

Oracles: ``opt.full_state_dict()`` (the fp32 masters, gathered exactly) for what the block
exposes; ``from_pretrained`` in a fresh model for what ``save_pretrained`` wrote (fp32, so
logits must be bit-identical); plain single-process AdamW on the global batch, with the same
edit applied by hand, for training after a ``modifier_rank`` edit.
"""

from __future__ import annotations

import pytest
import torch

from zero_harness import run

pytest.importorskip("transformers")

WORLD = 2
STEPS = 2
LR = 1e-2
CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
EDITED = "transformer.h.0.mlp.c_fc.weight"


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _edit(weight: torch.Tensor) -> None:
    """Weight surgery, applied by the modifier rank and by the oracle."""
    weight[:3].fill_(0.25)
    weight.mul_(0.5)


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        tokens = _tokens(step)[rank * 2:(rank + 1) * 2]
        opt.backward(model(input_ids=tokens, labels=tokens).loss)
        opt.step()


def _gathered_gpt2(rank: int, world: int, root: str) -> dict:
    from transformers import GPT2LMHeadModel

    import zero_runtime

    model, opt = zero_runtime.initialize(_gpt2(), lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0), CONFIG)
    _train(model, opt, rank, range(STEPS))
    out: dict = {}
    probe = _tokens(100)
    errors = []
    for module in (model, model.transformer.h[1]):
        try:
            module.state_dict()
        except RuntimeError as err:
            errors.append(str(err))
    out["errors"] = errors
    masters = opt.full_state_dict()
    with torch.no_grad():
        outside = model(input_ids=probe).logits
    with zero_runtime.GatheredParameters(model):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            inside = model(input_ids=probe).logits  # a forward inside keeps the block's gathers
        shapes_after_forward = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if rank == 0:
            model.save_pretrained(root)
    out["shapes_after_forward"] = shapes_after_forward
    out["freed_after"] = all(u.state.value == "free" for u in opt.units if u.partitioned)
    out["logits"] = (outside, inside)
    if rank == 0:
        out["masters"], out["state"] = masters, state
        with torch.no_grad():
            out["loaded_logits"] = GPT2LMHeadModel.from_pretrained(root)(input_ids=probe).logits
    # modifier_rank: rank 1's surgery lands in every shard and master; rank 0's edit is discarded.
    weight = dict(model.named_parameters())[EDITED]
    with zero_runtime.GatheredParameters([weight], modifier_rank=1):
        with torch.no_grad():
            if rank == 1:
                _edit(weight)
            else:
                weight.fill_(7.0)
    with zero_runtime.GatheredParameters(weight):
        out["seen_after_edit"] = weight.detach().clone()
    out["masters_after_edit"] = opt.full_state_dict()
    _train(model, opt, rank, range(STEPS, STEPS + 1))
    out["trained_after_edit"] = opt.full_state_dict()
    try:
        with zero_runtime.GatheredParameters(model):
            _train(model, opt, rank, range(STEPS + 1, STEPS + 2))
    except RuntimeError as err:
        out["step_inside"] = str(err)
    return out


def _oracle() -> tuple[dict, dict]:
    """Single process: STEPS steps on the global batch, the edit, one more step."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(index: int) -> None:
        tokens = _tokens(index)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    for index in range(STEPS):
        step(index)
    with torch.no_grad():
        _edit(dict(model.named_parameters())[EDITED])
    edited = {k: v.clone() for k, v in model.state_dict().items()}
    step(STEPS)
    return edited, model.state_dict()


def test_gathered_parameters_save_pretrained_and_modifier_rank(tmp_path):
    results = run(_gathered_gpt2, WORLD, str(tmp_path / "hf"))
    first = results[0]
    for result in results:
        assert len(result["errors"]) == 2 and all("GatheredParameters" in e and "full_state_dict" in e
                                                  for e in result["errors"])
        assert "state_dict() under ZeRO stage 3: ln_1.weight" in result["errors"][1]  # names as the submodule sees them
        assert all(0 not in shape for shape in result["shapes_after_forward"].values())
        assert result["freed_after"]  # partitioned again after the block
        outside, inside = result["logits"]
        assert torch.equal(outside, inside)
    # The block exposes exactly the fp32 masters (fp32 run: compute dtype == master dtype).
    assert first["state"].keys() == first["masters"].keys()
    for key, value in first["masters"].items():
        assert torch.equal(first["state"][key], value), key
    # save_pretrained inside the block -> from_pretrained: identical logits.
    assert torch.equal(first["loaded_logits"], first["logits"][1])
    # modifier_rank=1: rank 1's surgery, on every rank, in the masters; training continues from it.
    edited, trained = _oracle()
    for result in results:
        torch.testing.assert_close(result["seen_after_edit"], first["masters_after_edit"][EDITED], rtol=0, atol=0)
    assert (first["masters_after_edit"][EDITED][:3] == 0.125).all()
    for key in edited:
        torch.testing.assert_close(first["masters_after_edit"][key], edited[key], rtol=0, atol=2e-5, msg=key)
        torch.testing.assert_close(first["trained_after_edit"][key], trained[key], rtol=0, atol=5e-5, msg=key)
    assert all("inside a GatheredParameters block" in r["step_inside"] for r in results)


def _modify_whole_units(rank: int, world: int) -> dict:
    """Units kept whole (stage 2; stage 3's persistent ones): rank 1's edit reaches every
    rank's parameters and the fp32 masters; a parameter outside any unit is broadcast."""
    import zero_runtime
    from zero_workloads import make_model, make_optimizer

    out = {}
    for name, zero in (("s2", {"stage": 2}), ("s3-persistent", {"stage": 3})):  # the MLP is all persistent
        model = make_model("mlp")
        model.layers[1].bias.requires_grad_(False)  # frozen: in no unit
        model, opt = zero_runtime.initialize(model, make_optimizer(), {"zero_optimization": zero})
        weight, frozen = model.layers[0].weight, model.layers[1].bias
        with zero_runtime.GatheredParameters([weight, frozen], modifier_rank=1):
            with torch.no_grad():
                weight.fill_(float(rank + 1))
                frozen.fill_(float(rank + 1))
        out[name] = {"weight": weight.detach().clone(), "frozen": frozen.detach().clone(),
                     "masters": opt.full_state_dict()}
    return out


def test_modifier_rank_on_units_kept_whole():
    results = run(_modify_whole_units, WORLD)
    for name in ("s2", "s3-persistent"):
        for result in results:
            assert (result[name]["weight"] == 2.0).all() and (result[name]["frozen"] == 2.0).all()
        assert (results[0][name]["masters"]["layers.0.weight"] == 2.0).all()
