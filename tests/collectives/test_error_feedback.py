"""LoCo error feedback of ``reduce_scatter_q4`` (``zcomm.ErrorFeedback``).

On 4 gloo ranks as 2 nodes x 2 (both hops quantize) and 1 x 4 (hop 1 only), against an fp64
reduction of plain ``torch.distributed``:

* the first call with a fresh state delivers, bit for bit, what the stateless collective
  delivers (the error starts at zero; rows, groups and bytes are the same);
* reducing the same gradient ``T`` times, the mean of the outputs is off by at most the
  analytic bound of the telescoping sum, ``2 * max|e| / (T * (1 - err_beta))``, far less
  than one call's error, while the stateless collective's mean keeps its full error;
* a state restored from ``state_dict`` continues exactly as the original; ``reset_T``
  restarts from zero; a call of another geometry is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zcomm
from spawn_harness import run_distributed

T = 40
BETA = 0.8


def _input(rank: int, world: int, m: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    # a few large elements per group make the INT4 steps coarse for the rest
    x = torch.randn(world * m, generator=generator) * 0.02
    x[::97] = 1.0
    return x


def _exact(x: torch.Tensor, rank: int, m: int) -> torch.Tensor:
    summed = x.double().clone()
    dist.all_reduce(summed)
    return summed[rank * m : (rank + 1) * m]


def _run(rank: int, world: int, local_size: int) -> dict:
    topology = zcomm.Topology(world_size=world, local_size=local_size)
    m, group_size = 3000, 64
    x = _input(rank, world, m)
    exact = _exact(x, rank, m)
    kwargs = dict(group_size=group_size, topology=topology)

    stateless = torch.empty(m)
    zcomm.reduce_scatter_q4(stateless, x.clone(), **kwargs)
    one_call_error = (stateless.double() - exact).abs().mean().item()

    feedback = zcomm.ErrorFeedback(err_beta=BETA, reset_T=10_000)
    total = torch.zeros(m, dtype=torch.float64)
    outs = []
    for step in range(T):
        out = torch.empty(m)
        zcomm.reduce_scatter_q4(out, x.clone(), error_feedback=feedback, **kwargs)
        outs.append(out)
        total += out.double()
        if step == T // 2:
            restored = zcomm.ErrorFeedback(err_beta=BETA, reset_T=10_000)
            restored.load_state_dict(feedback.state_dict())
    mean_error = (total / T - exact).abs()

    # the restored copy continues exactly as the original did after the snapshot
    replay = []
    for _ in range(2):
        replay.append(torch.empty(m))
        zcomm.reduce_scatter_q4(replay[-1], x.clone(), error_feedback=restored, **kwargs)

    # reset: with reset_T = 1 every call starts from zero, i.e. equals the stateless one
    always_fresh = zcomm.ErrorFeedback(err_beta=BETA, reset_T=1)
    fresh_outs = []
    for _ in range(3):
        out = torch.empty(m)
        zcomm.reduce_scatter_q4(out, x.clone(), error_feedback=always_fresh, **kwargs)
        fresh_outs.append(out)

    other_geometry = None
    try:
        zcomm.reduce_scatter_q4(torch.empty(m // 2), x[: world * m // 2].clone(), error_feedback=feedback, **kwargs)
    except ValueError as err:
        other_geometry = str(err)
    # the error of a call is at most the sum of its INT4 half-steps; |e| is a moving average of such errors
    max_e = (stateless.double() - exact).abs().max().item() * 2
    return {
        "first_equal": torch.equal(outs[0], stateless),
        "one_call_error": one_call_error,
        "mean_error": mean_error.mean().item(),
        "mean_error_max": mean_error.max().item(),
        "bound": 2 * max_e / (T * (1 - BETA)),
        "replay_equal": all(torch.equal(a, b) for a, b in zip(replay, outs[T // 2 + 1 :], strict=False)),
        "fresh_equal": all(torch.equal(out, stateless) for out in fresh_outs),
        "other_geometry": other_geometry,
        "nbytes": feedback.nbytes,
        "calls": feedback.calls,
    }


@pytest.mark.parametrize("local_size", [2, 4])
def test_error_feedback_reduces_the_error_of_a_repeated_reduction(local_size):
    results = run_distributed(_run, 4, args=(local_size,), timeout=240)
    for rank, r in enumerate(results):
        assert r["first_equal"], rank
        assert r["replay_equal"], rank
        assert r["fresh_equal"], rank
        assert r["mean_error_max"] <= r["bound"], (rank, r)
        assert r["mean_error"] < r["one_call_error"] / 2, (rank, r)
        assert r["other_geometry"] and "geometry" in r["other_geometry"], rank
        assert r["calls"] == T
        # INT8 buffers: hop 1 holds W * m elements (+ hop 2's N * m with two nodes), one byte each plus scales
        elements = 4 * 3000 + (2 * 3000 if local_size == 2 else 0)
        assert elements <= r["nbytes"] <= elements * 1.1, r["nbytes"]


def test_error_feedback_arguments_are_checked():
    with pytest.raises(ValueError, match="err_beta"):
        zcomm.ErrorFeedback(err_beta=1.0)
    with pytest.raises(ValueError, match="reset_T"):
        zcomm.ErrorFeedback(reset_T=0)
    with pytest.raises(ValueError, match="err_beta"):
        zcomm.ErrorFeedback(err_beta=True)
    state = zcomm.ErrorFeedback(err_beta=0.5).state_dict()
    with pytest.raises(ValueError, match="err_beta"):
        zcomm.ErrorFeedback(err_beta=0.8).load_state_dict(state)
