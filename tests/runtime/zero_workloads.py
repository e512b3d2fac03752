"""Shared workloads for the runtime tests: models, deterministic data, training loops.

The oracle is plain single-process training of the unwrapped model on the *global* batch;
the runtime trains the same model (same seed) with each rank taking its slice of that
batch. Both sides call the same functions here, so they differ only in the runtime.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench.train.models import MLP, GPTConfig, TinyGPT

GPT = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
GLOBAL_BATCH = 8
LR = 1e-2


class OutsideUse(torch.nn.Module):
    """Reads its children's parameters in its own forward, without calling them (and calls
    ``inner`` twice): the case stage 3's gather-on-access must handle."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(12, 20)
        self.head = torch.nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inner(x))
        h = h + self.inner(x * 0.5)
        return F.linear(h, self.head.weight) + self.head.bias


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "outside":
        return OutsideUse()
    return MLP(d_in=12, d_hidden=20, d_out=5, depth=3) if kind == "mlp" else TinyGPT(GPT)


def make_optimizer():
    return functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.01)


def grouped_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """A torch optimizer with per-group hyper-parameters, built on the (MLP) model itself:
    the runtime takes it as a template, the oracle uses it directly."""
    first, rest = model.layers[0], model.layers[1:]
    return torch.optim.AdamW([{"params": first.parameters(), "weight_decay": 0.1},
                              {"params": rest.parameters(), "lr": LR / 2}], lr=LR, weight_decay=0.01)


def global_batch(kind: str, step: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + step)
    if kind in ("mlp", "outside"):
        return torch.randn(GLOBAL_BATCH, 12, generator=gen), torch.randn(GLOBAL_BATCH, 5, generator=gen)
    return (torch.randint(0, GPT.vocab_size, (GLOBAL_BATCH, GPT.seq_len), generator=gen),)


def local_slice(batch: tuple[torch.Tensor, ...], index: int, parts: int) -> tuple[torch.Tensor, ...]:
    size = batch[0].shape[0] // parts
    return tuple(t[index * size : (index + 1) * size] for t in batch)


def loss_of(kind: str, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if kind in ("mlp", "outside"):
        x, y = batch
        return F.mse_loss(model(x).float(), y)
    return model.loss(batch[0])


def reference_run(kind: str, steps: int, *, clip: float = 0.0,
                  grouped: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training on the global batch: the oracle."""
    model = make_model(kind)
    opt = grouped_optimizer(model) if grouped else make_optimizer()(model.parameters())
    losses = []
    for step in range(steps):
        loss = loss_of(kind, model, global_batch(kind, step))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys, and bit-identical tensors under each."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def optimizer_state_placement(optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """Per state key (``step``, ``exp_avg``, ...): the devices and dtypes of its tensors."""
    found: dict[str, set[str]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found.setdefault(key, set()).add(f"{value.device}/{value.dtype}")
    return {key: sorted(values) for key, values in found.items()}


def zero_steps(kind: str, model, opt, rank: int, world: int, steps: range, *, accumulation: int = 1) -> list[float]:
    """Runtime training; returns the global-batch loss of every step (mean over ranks and
    micro-batches, reduced exactly in float64 so it is comparable to the oracle)."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        mine = local_slice(global_batch(kind, step), rank, world)
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(accumulation):
            loss = loss_of(kind, model, local_slice(mine, micro, accumulation))
            opt.backward(loss)
            opt.step()
            total += loss.item()
        dist.all_reduce(total)
        losses.append(total.item() / (world * accumulation))
    return losses


def restart_checks(model, opt, rank: int, world: int, root: str, exact_then_step: Callable[[int], bool]) -> dict:
    """The weight-difference tests' restarts: 3 steps, a checkpoint, 2 more steps; then a
    checkpoint load, a state-dict load (of the state at the checkpoint) and a
    ``GatheredParameters`` edit that halves every parameter. After each, ``exact_then_step(step)``
    says whether the weights restarted from exact values and runs ``step`` (3, 3, then 4)."""
    import copy

    import zero_runtime

    zero_steps("gpt", model, opt, rank, world, range(3))
    opt.save_checkpoint(f"{root}/ckpt")
    snapshot = copy.deepcopy(opt.state_dict())
    zero_steps("gpt", model, opt, rank, world, range(3, 5))
    opt.load_checkpoint(f"{root}/ckpt")
    out = {"after_checkpoint": exact_then_step(3)}
    opt.load_state_dict(snapshot)
    out["after_state_dict"] = exact_then_step(3)
    with zero_runtime.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.5)
    out["after_edit"] = exact_then_step(4)
    return out


def train_save_resume(kind: str, config: dict, rank: int, world: int, ckpt: str, steps: int, *,
                      accumulation: int = 1, at_start: Callable[[Any], dict] | None = None,
                      after_training: Callable[[Any], dict] | None = None) -> dict:
    """The offload tests' run: ``2 * steps`` runtime steps with a checkpoint saved to ``ckpt``
    half-way, then a fresh runtime that loads it and runs the second half again. Returns
    ``losses``, ``weights`` (consolidated at the end), ``resumed`` and ``resumed_weights``,
    with what ``at_start(opt)`` (right after ``initialize``) and ``after_training(opt)``
    (before the first runtime closes) return."""
    import zero_runtime

    model, opt = zero_runtime.initialize(make_model(kind), make_optimizer(), config)
    out = at_start(opt) if at_start else {}
    out["losses"] = zero_steps(kind, model, opt, rank, world, range(steps), accumulation=accumulation)
    opt.save_checkpoint(ckpt)
    out["losses"] += zero_steps(kind, model, opt, rank, world, range(steps, 2 * steps), accumulation=accumulation)
    out["weights"] = opt.full_state_dict()
    out.update(after_training(opt) if after_training else {})
    opt.close()
    model, opt = zero_runtime.initialize(make_model(kind), make_optimizer(), config)
    opt.load_checkpoint(ckpt)
    out["resumed"] = zero_steps(kind, model, opt, rank, world, range(steps, 2 * steps), accumulation=accumulation)
    out["resumed_weights"] = opt.full_state_dict()
    opt.close()
    return out


def assert_trains_alike(results: list[dict], base_key: Any, key: Any, steps: int) -> None:
    """``train_save_resume`` outputs per rank (``results[rank][key]``): the run under ``key``
    has the losses of the run under ``base_key`` on every rank, bit for bit, and moved its
    weights (so the comparison means something); rank 0's consolidated weights are
    bit-identical; the resumed second half repeats the uninterrupted one exactly."""
    for rank, out in enumerate(results):
        base, got = out[base_key], out[key]
        assert got["losses"] == base["losses"]
        assert got["losses"][0] != got["losses"][-1]
        if rank == 0:
            assert base["weights"] and state_dicts_equal(got["weights"], base["weights"])
    first = results[0][key]
    assert first["resumed"] == first["losses"][steps:]
    assert state_dicts_equal(first["resumed_weights"], first["weights"])
