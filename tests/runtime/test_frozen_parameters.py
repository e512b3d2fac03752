"""Frozen parameters and buffers under stage 3 and ZeRO++: a LoRA-like model (frozen base
linears, trainable low-rank adapters, a buffer, a frozen module called twice in a row) on 4
gloo ranks (2 nodes of 2).

Oracle: plain single-process AdamW over the adapters on the global batch. Frozen weights
must stay bit-identical to their initial values, be partitioned (empty outside a use,
counted in ``memory_report()`` as shards), have no gradient and no optimizer state.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from zero_harness import run

WORLD = 4
STEPS = 4
D, RANK = 48, 4
BATCH = 8
FREE_AFTER_USE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "zcomm_stage3_fuse_numel": 0, "stage3_prefetch_bucket_size": 0}
CASES = {
    "s3": FREE_AFTER_USE,
    "s3-defaults-fused": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zeropp": {**FREE_AFTER_USE, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
               "zero_quantized_gradients": True},
}


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.lora_a = nn.Linear(D, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, D, bias=False)
        self.register_buffer("scaling", torch.tensor(0.5))
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


class LoRAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear() for _ in range(3))
        self.shared = nn.Linear(D, D).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        # A frozen module called twice in a row: its first call's backward needs the weights
        # after the second call's input gradient (the first call's output) is final.
        return self.shared(self.shared(x))


def _model() -> LoRAModel:
    torch.manual_seed(0)
    return LoRAModel()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, D, generator=gen)


OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)


def _train_lora(rank: int, world: int) -> dict:
    import zcomm
    import zero_runtime

    out = {}
    for name, zero in CASES.items():
        model, opt = zero_runtime.initialize(_model(), OPTIMIZER, {"zero_optimization": zero},
                                             topology=zcomm.Topology(world_size=world, local_size=2))
        frozen = [p for layer in model.layers for p in layer.base.parameters()]
        losses = []
        for step in range(STEPS):
            x, y = (t[rank * 2:(rank + 1) * 2] for t in _batch(step))
            loss = F.mse_loss(model(x), y)
            opt.backward(loss)
            losses.append(loss.item())
            if step == 0:
                grads = [p.grad for p in frozen]
            opt.step()
        out[name] = {
            "losses": losses, "weights": opt.full_state_dict(), "report": opt.memory_report(),
            "frozen_numel_outside": [model.layers[i].base._parameters["weight"].numel() for i in range(3)],
            "frozen_grads": grads, "frozen_units": len(opt.frozen_units), "trainable_units": len(opt.units),
            "optimizer_numel": sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"]),
            "state_tensors": sum(1 for s in opt.optimizer.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0),
        }
    return out


def _oracle() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = OPTIMIZER([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_lora_trains_only_the_adapters_under_stage3_and_zeropp():
    results = run(_train_lora, WORLD)
    initial = _model().state_dict()
    oracle_losses, oracle_weights = _oracle()
    adapter_numel = 3 * 2 * D * RANK
    frozen_numel = 4 * (D * D + D)
    for name in CASES:
        first = results[0][name]
        weights = first["weights"]
        losses = [sum(r[name]["losses"][step] for r in results) / WORLD for step in range(STEPS)]  # global mean
        assert weights.keys() == initial.keys()  # buffers included
        for key, value in initial.items():
            if ".base." in key or key.endswith("scaling") or key.startswith("shared."):
                assert torch.equal(weights[key], value), (name, key)  # frozen: bit-identical
            else:
                assert not torch.equal(weights[key], value), (name, key)  # adapters trained
        for result in results:
            mine = result[name]
            assert mine["frozen_numel_outside"] == [0, 0, 0]  # partitioned, freed between uses
            assert all(g is None for g in mine["frozen_grads"])
            assert mine["frozen_units"] == (1 if name == "s3-defaults-fused" else 4)  # fused: one unit
            # Only adapters in the optimizer: masters are this rank's shard of them (plus padding).
            assert adapter_numel / WORLD <= mine["optimizer_numel"] <= adapter_numel / WORLD + 64
            assert mine["state_tensors"] == 2 * mine["trainable_units"]  # AdamW's two moments, masters only
            # fp32: shards of adapters and frozen weights, 4 bytes each (padding < 64 elements a unit).
            params = mine["report"].parameters
            assert (adapter_numel + frozen_numel) / WORLD * 4 <= params <= ((adapter_numel + frozen_numel) / WORLD
                                                                              + 64 * 12) * 4
            assert mine["report"].optimizer_states <= 3 * (adapter_numel / WORLD + 64) * 4
        if name == "zeropp":
            # Quantized weights and gradients: close to the oracle, not equal.
            for got, want in zip(losses, oracle_losses, strict=True):
                assert abs(got - want) <= 0.02 * want
        else:
            for got, want in zip(losses, oracle_losses, strict=True):
                assert abs(got - want) <= 1e-5 * want
            for key, value in oracle_weights.items():
                torch.testing.assert_close(weights[key], value, rtol=0, atol=2e-5, msg=f"{name} {key}")
