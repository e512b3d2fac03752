"""A fused CPU Adam/AdamW step over flat fp32 states, bit-identical to ``torch.optim.AdamW``.

One parallel pass over blocks of ``_BLOCK`` elements: each thread of the rank's share (see
:func:`zcomm.quant.cpu_kernels.use_thread_share`) takes one contiguous slice of blocks and
walks it with its own sqrt buffer. Per block:

1. moments: ``exp_avg`` and ``exp_avg_sq`` updated from the gradient (Adam's L2 weight
   decay folded into the gradient first), ``exp_avg_sq`` kept in a per-thread buffer;
2. the square roots of that buffer, with the same routine torch's CPU ``sqrt`` uses (see
   [Note: torch's CPU sqrt]);
3. the update: AdamW's decoupled decay, ``denom = sqrt / bc2_sqrt + eps``, the parameter
   step, and the store of the new value into the compute-dtype copy (bf16/fp16 rounded to
   nearest even, as ``Tensor.copy_`` rounds).

Every byte of the five arrays is read and written once, where torch's single-tensor step
makes about ten passes. The block stays in L1/L2 between the three phases.

[Note: Adam kernel speed] What made the step slow, measured on 100M parameters (2 cores,
see ``bench/results/cpu_adam_*``): the stores to the optional ``out`` when it was a view of
``param`` (LLVM then could not prove the loop free of overlap and ran its scalar version),
the flags tested inside the loops (a conditional load or store keeps LLVM from vectorizing),
and a buffer allocated per block. What is left above torch's ``fused=True`` step is mostly
MKL's ``vsSqrt`` itself (about 0.6 ns per element in cache, against a streaming pass near
memory bandwidth): no in-kernel formula tried (x * rsqrt with one Newton step in fp32 or
fp64, the correctly rounded root) reproduces its bits, and numba's ``np.sqrt`` (correctly
rounded) differs from it in about a fifth of the elements.

[Note: Adam's operation order] The result equals torch's single-tensor step
(``foreach=False``, what torch picks for CPU parameters) only if every fp32 rounding is the
same, so the kernel replays torch 2.13's CPU kernels op by op, as measured element for
element against them (``tests/runtime/test_cpu_adam.py`` checks the whole step):

* ``param.mul_(1 - lr * wd)`` (AdamW): one fp32 multiply by the fp32-rounded scalar;
* ``grad.add(param, alpha=wd)`` (Adam): ``fma(param, wd, grad)`` (torch's vectorized add);
* ``exp_avg.lerp_(grad, 1 - beta1)``: ``fma(w, grad - m, m)`` for ``|w| < 0.5``, else
  ``fma(w - 1, grad - m, grad)`` (torch's ``lerp_vec``);
* ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``:
  ``fma((1 - beta2) * grad, grad, v * beta2)`` (the compiler contracts torch's addcmul);
* ``(exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)``: an fp32 division, not a reciprocal;
* ``param.addcdiv_(exp_avg, denom, value=-step_size)``: ``param + (-step_size * m) / denom``.

The scalars are computed in Python doubles exactly as torch computes them and rounded to
fp32 once (``_scalars``). numba compiles without fastmath, so no other contraction happens.
torch's ``fused=True`` CPU kernel uses a correctly rounded sqrt instead and differs from
the single-tensor step in the last bit of some elements; this kernel follows the
single-tensor step, which is what the runtime trains with when nothing is offloaded.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.extending import intrinsic

from zcomm.quant.cpu_kernels import kernel_view, shared_array, store_f32, use_thread_share

_BLOCK = 2048  # floats: a block of the five arrays (40 KiB) stays in L1/L2; 1K-16K measured alike
_KERNEL = dict(parallel=True, cache=True, nogil=True, error_model="numpy")


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (fp32)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(a, b, c), codegen


_SQRT_FN = ir.FunctionType(ir.VoidType(), [ir.IntType(32).as_pointer(), ir.FloatType().as_pointer(),
                                           ir.FloatType().as_pointer()])


@intrinsic
def _call_vssqrt(typingctx, address, count, source, target):
    """Call the Fortran-ABI ``VSSQRT_(&n, a, r)`` at ``address`` (integers: addresses)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = builder.inttoptr(args[0], _SQRT_FN.as_pointer())
        ptrs = [builder.inttoptr(arg, ty) for arg, ty in zip(args[1:], _SQRT_FN.args, strict=True)]
        builder.call(fn, ptrs)
        return context.get_dummy_value()

    return sig, codegen


@njit(**_KERNEL)
def _adam_kernel(param, grad, exp_avg, exp_avg_sq, out, has_out, decoupled, decay, l2, w1, beta2, omb2, bc2_sqrt,
                 eps, neg_step, sqrt_address, threads):
    n = param.shape[0]
    blocks = (n + _BLOCK - 1) // _BLOCK
    threads = max(1, min(threads, blocks))
    per_thread = (blocks + threads - 1) // threads
    small = abs(w1) < np.float32(0.5)
    w1_minus_one = w1 - np.float32(1.0)
    # [Note: Adam's thread slices] One contiguous run of blocks per thread, with its sqrt
    # buffer allocated once: a prange over the blocks themselves allocated a buffer per block
    # and measured about 1.5x slower (see bench/results/cpu_adam_*).
    for t in prange(threads):
        roots = np.empty(_BLOCK, np.float32)
        count = np.empty(1, np.int32)
        for b in range(t * per_thread, min((t + 1) * per_thread, blocks)):
            # Unsigned indices: numba then emits no negative-index wraparound, which would keep
            # LLVM from vectorizing the loops.
            lo = np.uint64(b) * np.uint64(_BLOCK)
            size = min(np.uint64(_BLOCK), np.uint64(n) - lo)
            p_block, g_block = param[lo:lo + size], grad[lo:lo + size]
            m_block, v_block = exp_avg[lo:lo + size], exp_avg_sq[lo:lo + size]
            # Branch-free loop bodies (the flags hoisted, selects on computed values): a
            # conditional load or store in the loop keeps LLVM from vectorizing it.
            if decoupled:
                for i in range(np.uint64(0), size):
                    m, v = _moments(g_block[i], m_block[i], v_block[i], small, w1, w1_minus_one, beta2, omb2)
                    m_block[i] = m
                    v_block[i] = v
                    roots[i] = v
            else:
                for i in range(np.uint64(0), size):
                    m, v = _moments(_fma(p_block[i], l2, g_block[i]), m_block[i], v_block[i], small, w1,
                                    w1_minus_one, beta2, omb2)
                    m_block[i] = m
                    v_block[i] = v
                    roots[i] = v
            if sqrt_address != 0:
                count[0] = np.int32(size)
                address = roots.ctypes.data
                _call_vssqrt(sqrt_address, count.ctypes.data, address, address)
            else:
                for i in range(np.uint64(0), size):
                    roots[i] = np.sqrt(roots[i])
            if has_out:
                for i in range(np.uint64(0), size):
                    p = _update(p_block[i], m_block[i], roots[i], decoupled, decay, bc2_sqrt, eps, neg_step)
                    p_block[i] = p
                    store_f32(out, lo + i, p)
            else:
                for i in range(np.uint64(0), size):
                    p_block[i] = _update(p_block[i], m_block[i], roots[i], decoupled, decay, bc2_sqrt, eps, neg_step)


@njit(inline="always")
def _moments(g, m, v, small, w1, w1_minus_one, beta2, omb2):
    """The new ``exp_avg`` and ``exp_avg_sq`` (see [Note: Adam's operation order])."""
    diff = g - m
    m_new = _fma(w1, diff, m) if small else _fma(w1_minus_one, diff, g)
    return m_new, _fma(omb2 * g, g, v * beta2)


@njit(inline="always")
def _update(p, m, root, decoupled, decay, bc2_sqrt, eps, neg_step):
    """The new parameter from its ``exp_avg`` and the square root of its ``exp_avg_sq``."""
    decayed = p * decay
    p = decayed if decoupled else p
    return p + (neg_step * m) / (root / bc2_sqrt + eps)


# [Note: torch's CPU sqrt] torch's CPU ``sqrt`` of a float32 tensor is MKL's VML ``vsSqrt``
# where torch is built with MKL (x86 wheels), and it is not correctly rounded: about a fifth
# of the results differ from the exact square root in the last bit. To equal torch's Adam,
# the kernel calls the same routine, through the Fortran-ABI ``VSSQRT_`` symbol that
# libtorch_cpu exports. Which routine reproduces ``torch.sqrt`` is checked once per process
# on a probe vector; a torch without MKL (whose sqrt is then the vectorized, correctly
# rounded one) gets numba's ``np.sqrt``. If neither reproduces torch, the step is still
# correct Adam but not bit-identical: ``SQRT_MATCHES_TORCH`` says which case holds. The probe
# takes torch's result on one thread, as the kernel calls the routine on one: with more, torch
# splits the vector into chunks for its OpenMP threads, and in a few percent of the processes
# on a 2-vCPU VM one chunk came out different (4096 of 8195 elements, several ulps; the cause
# is inside torch/MKL), which made the probe reject the routine for the whole process.
def _probe_sqrt() -> tuple[int, bool]:
    values = torch.rand(4 * _BLOCK + 3, generator=torch.Generator().manual_seed(0)) * 1e-3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = values.sqrt()
    finally:
        torch.set_num_threads(threads)
    address = _mkl_vssqrt_address()
    if address:
        got = values.clone()
        count = ctypes.c_int32(got.numel())
        ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(address)(
            ctypes.addressof(count), got.data_ptr(), got.data_ptr())
        if torch.equal(got, want):
            return address, True
    exact = torch.from_numpy(np.sqrt(values.numpy()))
    return 0, torch.equal(exact, want)


def _mkl_vssqrt_address() -> int:
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists():
        return 0
    try:
        return ctypes.cast(ctypes.CDLL(str(library)).VSSQRT_, ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


SQRT_ADDRESS, SQRT_MATCHES_TORCH = _probe_sqrt()
_NO_OUT = np.empty(0, np.float32)


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyper-parameters, as ``torch.optim.Adam``/``AdamW`` hold them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (decay applied to the weights) or Adam (L2 added to the gradient)


def _scalars(h: AdamHyper, step: float):
    """The fp32 scalars of step number ``step``, computed as torch's single-tensor Adam does."""
    f = np.float32
    bias_correction1 = 1 - h.beta1**step
    bias_correction2 = 1 - h.beta2**step
    step_size = h.lr / bias_correction1
    return (f(1 - h.lr * h.weight_decay), f(h.weight_decay), f(1 - h.beta1), f(h.beta2), f(1 - h.beta2),
            f(bias_correction2**0.5), f(h.eps), f(-step_size))


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              hyper: AdamHyper, step: float, out: torch.Tensor | None = None) -> None:
    """One Adam/AdamW step, in place, on contiguous fp32 CPU tensors of one size; ``step``
    is the step number after this update (torch's ``state["step"]`` once incremented).
    ``out`` (optional, same size, fp32/bf16/fp16, CPU) receives the updated parameters in
    its dtype in the same pass."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    numel = param.numel()
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel:
            raise ValueError("adam_step takes contiguous fp32 CPU tensors of one size")
    if out is not None and (out.device.type != "cpu" or not out.is_contiguous() or out.numel() != numel
                            or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError("adam_step's out must be a contiguous fp32/bf16/fp16 CPU tensor of the parameters' size")
    if not math.isfinite(step) or step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if numel == 0:
        return
    arrays = [shared_array(t.detach().view(-1)) for t in tensors]
    # Not a view of ``param`` when there is no ``out``: LLVM would then see the stores to
    # ``out`` possibly overlapping ``param`` and run the scalar version of the loop.
    target = kernel_view(out.detach().view(-1)) if out is not None else _NO_OUT
    use_thread_share()
    _adam_kernel(*arrays, target, out is not None, hyper.decoupled, *_scalars(hyper, step), SQRT_ADDRESS,
                 get_num_threads())
