"""``zero_runtime.Init``: models built partitioned on 4 gloo ranks.

Oracle: the same model built plainly with the same seed on each rank. Weights after
``initialize`` (``full_state_dict()``, every key) and the losses of training steps must be
bit-identical, for an HF GPT-2 (whose ``post_init`` draws every weight again after the modules
exist, so the random stream is consumed twice per weight), a model that re-initializes
through ``.data``, ``trunc_normal_`` and ``copy_`` after construction, a LoRA-like model with
frozen base weights (only the adapters change), and at stages 1 and 2 (where ``initialize``
gathers everything back). During construction a parameter holds exactly its ceil(n/4) slice
and a zero-stride placeholder. The error cases are checked on the same ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_harness import run
from zero_workloads import state_dicts_equal

pytest.importorskip("transformers")

WORLD = 4


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Reinit(nn.Module):
    """Weights drawn at construction, then drawn or edited again by the parent's __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.a.weight.data.normal_(0.0, 0.05)
        nn.init.trunc_normal_(self.b.weight, std=0.1)
        with torch.no_grad():
            self.a.bias.copy_(torch.arange(40.0) / 40)
            self.b.bias.mul_(3.0)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


class Lora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(24, 24)
        self.base.requires_grad_(False)
        self.down = nn.Linear(24, 4, bias=False)
        self.up = nn.Linear(4, 24, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


MODELS = {"gpt2": _gpt2, "reinit": Reinit, "lora": Lora}


def _loss(kind: str, model, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    if kind == "gpt2":
        tokens = torch.randint(0, 96, (2, 16), generator=gen)
        return model(input_ids=tokens, labels=tokens).loss
    x = torch.randn(4, 24, generator=gen)
    return model(x).square().mean()


def _train(kind: str, stage: int, rank: int, *, partitioned: bool) -> dict:
    import zero_runtime

    torch.manual_seed(0)
    if partitioned:
        with zero_runtime.Init():
            model = MODELS[kind]()
    else:
        model = MODELS[kind]()
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16,
                                    "zcomm_stage3_fuse_numel": 0}}
    model, opt = zero_runtime.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2), config)
    start = opt.full_state_dict()
    losses = []
    for step in range(2):
        loss = _loss(kind, model, step, rank)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return {"start": start, "end": opt.full_state_dict(), "losses": losses}


def _during_construction(rank: int) -> dict:
    import zero_runtime

    torch.manual_seed(0)
    with zero_runtime.Init():
        model = Reinit()
    out = {}
    for name, param in model.named_parameters():
        record = param._zero_init_shard
        out[name] = (tuple(param.shape), param.data.stride(), record.shard.numel(), bool(torch.isnan(param).all()))
    return out


def _errors(rank: int) -> dict:
    import torch.distributed as dist

    import zero_runtime

    out = {}
    try:
        zero_runtime.Init({"zero_optimization": {"stage": 2}})
    except ValueError as err:
        out["stage"] = str(err)
    with zero_runtime.Init():
        try:
            with zero_runtime.Init():
                pass
        except RuntimeError as err:
            out["nested"] = str(err)
        layer = nn.Linear(8, 8)
        try:
            layer.weight[0].zero_()
        except RuntimeError as err:
            out["view"] = str(err)

        class DefinedInside(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(12))

        inside = DefinedInside()
        out["inside-partitioned"] = hasattr(inside.w, "_zero_init_shard")
        # An initializer rebound to a wrapper that writes nothing (as Hugging Face's does for a
        # weight flagged as loaded) leaves the values alone; one that writes is kept.
        before = layer.weight.clone()
        original = torch.nn.init.normal_

        def normal_(tensor, mean=0.0, std=1.0, generator=None):
            return tensor

        torch.nn.init.normal_ = normal_
        try:
            original(layer.weight)
        finally:
            torch.nn.init.normal_ = original
        out["skip-kept"] = torch.equal(layer.weight.clone(), before)
        torch.manual_seed(5)
        torch.nn.init.normal_(layer.weight)
        torch.manual_seed(5)
        out["write-kept"] = torch.equal(layer.weight.clone(), torch.empty(8, 8).normal_())
    out["restored"] = not hasattr(DefinedInside.__init__, "_zero_init_original") and not hasattr(
        nn.Linear.__init__, "_zero_init_original")
    out["plain-after"] = not hasattr(nn.Linear(4, 4).weight, "_zero_init_shard")
    with zero_runtime.Init():
        built = nn.Linear(8, 8)
    try:
        zero_runtime.GatheredParameters(built.weight)
    except RuntimeError as err:  # a call before initialize(): the wrong order, not a wrong value
        out["gathered"] = str(err)
    out["nan-outside"] = bool(torch.isnan(built.weight).all())
    # initialize over a group of other ranks than the model was built over
    pair = dist.new_group([0, 1])
    if rank < 2:
        with zero_runtime.Init():
            model = nn.Linear(8, 8)
        try:
            zero_runtime.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                    {"zero_optimization": {"stage": 3}}, group=pair)
        except ValueError as err:
            out["group"] = str(err)
    return out


def _all(rank: int, world: int) -> dict:
    out = {}
    for kind, stage in (("gpt2", 3), ("reinit", 3), ("lora", 3), ("gpt2", 2), ("reinit", 1)):
        out[kind, stage] = (_train(kind, stage, rank, partitioned=True), _train(kind, stage, rank, partitioned=False))
    out["construction"] = _during_construction(rank)
    out["errors"] = _errors(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run(_all, WORLD)


@pytest.mark.parametrize("case", [("gpt2", 3), ("reinit", 3), ("lora", 3), ("gpt2", 2), ("reinit", 1)])
def test_built_partitioned_equals_built_plainly(results, case):
    for rank in range(WORLD):
        got, want = results[rank][case]
        assert got["losses"] == want["losses"]
    got, want = results[0][case]
    assert got["start"] and state_dicts_equal(got["start"], want["start"])
    assert state_dicts_equal(got["end"], want["end"])
    assert not state_dicts_equal(got["start"], got["end"])  # the steps changed something


def test_lora_trains_only_the_adapters(results):
    got, _ = results[0]["lora", 3]
    for key in got["start"]:
        assert torch.equal(got["start"][key], got["end"][key]) == key.startswith("base."), key


def test_parameters_hold_a_quarter_while_building(results):
    for rank in range(WORLD):
        shapes = results[rank]["construction"]
        assert set(shapes) == {"a.weight", "a.bias", "b.weight", "b.bias", "scale"}
        for shape, stride, shard, nan in shapes.values():
            numel = torch.Size(shape).numel()
            assert shard == -(-numel // WORLD)
            assert stride == (0,) * len(shape) and nan  # the placeholder has no memory and reads as NaN


def test_errors(results):
    errors = results[0]["errors"]
    assert "stage 2" in errors["stage"]
    assert "do not nest" in errors["nested"]
    assert "view of a partitioned parameter" in errors["view"]
    assert errors["inside-partitioned"] and errors["restored"] and errors["plain-after"]
    assert errors["skip-kept"] and errors["write-kept"]
    assert "other ranks" in errors["group"]
    assert "call initialize() first" in errors["gathered"] and errors["nan-outside"]
    assert "group" not in results[2]["errors"]
