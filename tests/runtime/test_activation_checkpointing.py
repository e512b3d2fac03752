"""Activation checkpointing against the same model without it (the oracle): bit-identical outputs
and gradients under every option; the activation bytes the graph keeps, measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_runtime.activation_checkpointing import ActivationCheckpointingConfig, Checkpointer, checkpoint

DEPTH, WIDTH, BATCH = 8, 64, 16
OPTIONS = {
    "plain": {},
    "cpu": {"cpu_checkpointing": True},
    "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": DEPTH},
    "cpu+contiguous": {"cpu_checkpointing": True, "contiguous_memory_optimization": True,
                       "number_checkpoints": DEPTH},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)  # the recomputation must draw the same mask

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class Deep(nn.Module):
    def __init__(self, checkpointer: Checkpointer | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.checkpointer = checkpointer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, 0.5) if self.checkpointer is None else checkpoint(block, x, 0.5,
                                                                          checkpointer=self.checkpointer)
        return x


def _train(checkpointer: Checkpointer | None, steps: int = 3):
    model = Deep(checkpointer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    outs, grads = [], []
    torch.manual_seed(123)
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=gen, requires_grad=True)
        out = model(x)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append([x.grad] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return outs, grads


@pytest.mark.parametrize("option", OPTIONS)
def test_bit_identical_to_no_checkpointing(option):
    want_outs, want_grads = _train(None)
    outs, grads = _train(Checkpointer(OPTIONS[option]))
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    for got, want in zip(grads, want_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_no_grad_runs_plainly():
    model = Deep(Checkpointer(OPTIONS["contiguous"]))
    model.eval()
    with torch.no_grad():
        for _ in range(3):  # no slot is taken without autograd, so no exhaustion
            model(torch.randn(2, WIDTH))


def test_more_live_checkpoints_than_slots_is_an_error():
    checkpointer = Checkpointer({"contiguous_memory_optimization": True, "number_checkpoints": DEPTH - 1})
    with pytest.raises(RuntimeError, match="number_checkpoints"):
        Deep(checkpointer)(torch.randn(BATCH, WIDTH, requires_grad=True))


def test_slots_are_reused_across_iterations():
    checkpointer = Checkpointer(OPTIONS["contiguous"])
    _train(checkpointer, steps=3)
    (buffer,) = checkpointer.slots.buffers.values()
    assert buffer.numel() == DEPTH * BATCH * WIDTH * 4  # one buffer, allocated once
    assert not any(checkpointer.slots.busy[torch.device("cpu")])


def _saved_bytes(checkpointer: Checkpointer | None) -> int:
    """Bytes of the tensors autograd keeps for backward at the end of forward (activations),
    plus the checkpointed inputs the checkpointer keeps on the model's device."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model = Deep(checkpointer)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    kept = sum(seen.values())
    if checkpointer is not None and not checkpointer.config.cpu_checkpointing:
        kept += DEPTH * BATCH * WIDTH * 4  # the block inputs it holds (stored outside autograd)
    out.sum().backward()
    return kept


def test_checkpointing_keeps_a_fraction_of_the_activations():
    # Per block without checkpointing: the input of up (B*W), gelu's input (4BW), dropout's
    # mask and output (4BW bool + 4BW), down's input: >= 13 BW floats; with it, the block
    # input only (BW floats), and nothing on the device with cpu_checkpointing.
    plain = _saved_bytes(None)
    assert plain >= DEPTH * 13 * BATCH * WIDTH * 4 * 0.9
    assert _saved_bytes(Checkpointer()) <= plain / 8
    assert _saved_bytes(Checkpointer({"cpu_checkpointing": True})) == 0


@pytest.mark.parametrize("bad, error", [
    ({"contiguous_memory_optimization": True}, ValueError),
    ({"number_checkpoints": 0}, ValueError),
    ({"cpu_checkpointing": 1}, TypeError),
    ({"partition_activations": True}, ValueError),
])
def test_config_errors(bad, error):
    with pytest.raises(error):
        ActivationCheckpointingConfig.from_dict(bad)
