"""The fused CPU Adam step against torch's single-tensor AdamW/Adam (the oracle), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zero_runtime.offload.cpu_adam import _BLOCK, SQRT_MATCHES_TORCH, AdamHyper, adam_step


def _run_both(numel: int, cls, *, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, steps=6,
              out_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param0 = torch.randn(numel, generator=gen)
    reference = torch.nn.Parameter(param0.clone())
    opt = cls([reference], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=out_dtype) if out_dtype is not None else None
    hyper = AdamHyper(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                      decoupled=cls is torch.optim.AdamW)
    threads = torch.get_num_threads()
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen) * 10 ** float(torch.randint(-4, 1, (1,), generator=gen))
        reference.grad = grad.clone()
        torch.set_num_threads(1)  # torch's sqrt on one thread, as the kernel's ([Note: torch's CPU sqrt])
        try:
            opt.step()
        finally:
            torch.set_num_threads(threads)
        adam_step(param, grad, exp_avg, exp_avg_sq, hyper=hyper, step=float(step), out=out)
    state = opt.state[reference]
    return (param, exp_avg, exp_avg_sq, out), (reference.detach(), state["exp_avg"], state["exp_avg_sq"])


def test_torch_sqrt_is_reproduced():
    # See [Note: torch's CPU sqrt]: without it no bit-identity below can hold.
    assert SQRT_MATCHES_TORCH


@pytest.mark.parametrize("numel", [1, 5, _BLOCK - 1, _BLOCK, _BLOCK + 1, 3 * _BLOCK + 17])
@pytest.mark.parametrize("cls, betas, weight_decay", [
    (torch.optim.AdamW, (0.9, 0.999), 0.01),
    (torch.optim.AdamW, (0.3, 0.95), 0.5),  # beta1 < 0.5: torch's lerp takes its other branch
    (torch.optim.Adam, (0.9, 0.999), 0.1),  # L2 folded into the gradient
    (torch.optim.Adam, (0.9, 0.99), 0.0),
])
def test_bit_identical_to_torch_single_tensor(numel, cls, betas, weight_decay):
    (param, exp_avg, exp_avg_sq, _), (ref_param, ref_avg, ref_avg_sq) = _run_both(
        numel, cls, betas=betas, weight_decay=weight_decay)
    assert torch.equal(exp_avg, ref_avg)
    assert torch.equal(exp_avg_sq, ref_avg_sq)
    assert torch.equal(param, ref_param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compute_copy_written_in_the_same_pass(dtype):
    (param, _, _, out), (ref_param, _, _) = _run_both(10_007, torch.optim.AdamW, out_dtype=dtype)
    assert torch.equal(param, ref_param)
    assert torch.equal(out, ref_param.to(dtype))  # Tensor.copy_'s rounding


def test_threads_do_not_change_the_result(monkeypatch):
    monkeypatch.setenv("ZCOMM_NUM_THREADS", "1")
    (one, *_), _ = _run_both(4 * _BLOCK + 3, torch.optim.AdamW, seed=3)
    monkeypatch.setenv("ZCOMM_NUM_THREADS", "2")
    (two, *_), _ = _run_both(4 * _BLOCK + 3, torch.optim.AdamW, seed=3)
    assert torch.equal(one, two)


def test_moves_towards_the_fp64_adam_step():
    # An independent oracle for the formula itself: one AdamW step in fp64 numpy.
    numel, lr, wd = 4096, 1e-2, 0.1
    (param, *_), _ = _run_both(numel, torch.optim.AdamW, lr=lr, weight_decay=wd, steps=1, seed=7)
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(numel, generator=gen).double().numpy()
    g = (torch.randn(numel, generator=gen) * 10 ** float(torch.randint(-4, 1, (1,), generator=gen))).double().numpy()
    m, v = 0.1 * g, 0.001 * g * g
    expect = p0 * (1 - lr * wd) - lr * (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)
    np.testing.assert_allclose(param.double().numpy(), expect, rtol=0, atol=1e-6)


def test_bad_inputs():
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="fp32"):
        adam_step(x.double(), x, x.clone(), x.clone(), hyper=hyper, step=1.0)
    with pytest.raises(ValueError, match="one size"):
        adam_step(x, torch.zeros(7), x.clone(), x.clone(), hyper=hyper, step=1.0)
    with pytest.raises(ValueError, match="out"):
        adam_step(x, x.clone(), x.clone(), x.clone(), hyper=hyper, step=1.0, out=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="step"):
        adam_step(x, x.clone(), x.clone(), x.clone(), hyper=hyper, step=0.0)
