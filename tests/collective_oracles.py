"""Independent oracles for the quantized collectives: error bounds and byte volumes.

Written from the definitions of the wire format and of the collectives, not from zcomm's code.

Error of one quantization (wire format: ``s = fp32(absmax) / qmax`` per group of
``group_size`` consecutive elements of a payload, ``q = rint(fp32(x / s))``, ``y = fp32(q * s)``):
``|y - x| <= s/2 + |x| 2^-24 (division) + |y| 2^-24 (multiplication) <= s/2 + 2^-22 (|x| + s)``.

all_gather_q8: one quantization, then rounding to the output dtype (unit roundoff ``u``):
``|out - x| <= e + u (|x| + e)`` with ``e = s/2 + 2^-22 (|x| + s)``.

reduce_scatter_q4 for element ``t`` of stage ``s`` of rank ``r``'s slice, two INT4 hops:

* hop A (each source ``i`` quantizes its reordered row; with ``L > 1`` the row for local
  rank ``l_r`` is ``N`` parts ``s`` for the ranks ``(n', l_r)``, element at offset
  ``n_r q + t``; with ``L = 1`` the row is just rank ``r``'s part): error ``a_i <= s_A,i/2 + 2^-22 (|x_i| + s_A,i)``.
* hop B (``L > 1`` and ``N > 1``: rank ``(n, l_r)`` re-quantizes its node's fp32 partial
  sum ``P_n``; the chunk for ``r`` is part ``s`` of ``r``'s slice, groups restart at
  ``t = 0``): ``|P_n| <= |sum_{i in n} x_i| + sum_{i in n} a_i`` so its scale
  ``s_B,n <= max_group(|sum x| + sum a) / 7``, error ``b_n <= s_B,n/2 + 2^-22 (|P_n| + s_B,n)``.
* fp32 sums of at most ``W`` terms, a division, conversions: ``<= 2^-20 (sum_i |x_i| + sum a + sum b)``.

So ``|out - exact| <= E + u (|exact| + E)`` with ``E = (sum_i a_i + sum_n b_n + fp32 term) / divide_by``.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_QUANT_SLACK = 2.0**-22
_FP32_SLACK = 2.0**-20


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def payload_bytes(numel: int, bits: int, group_size: int) -> int:
    """Wire format: values (1 byte or a nibble each), zero padding to 4 bytes, one fp32 scale per group."""
    if numel == 0:
        return 0
    values = numel if bits == 8 else _ceil_div(numel, 2)
    return _ceil_div(values, 4) * 4 + 4 * _ceil_div(numel, group_size)


def ring_volume(chunk_bytes: int, rank: int, world: int, local_size: int) -> tuple[int, int]:
    """(intra, inter) bytes a rank sends in the ring model: W-1 chunks to rank (r+1) % W."""
    sent = (world - 1) * chunk_bytes
    same_node = rank // local_size == ((rank + 1) % world) // local_size
    return (sent, 0) if same_node else (0, sent)


def qwz_volume(numel: int, nodes: int, local: int, group_size: int, *, bits: int = 8) -> tuple[int, int]:
    """(intra, inter) bytes per rank of all_gather_q8 (``bits`` 4: all_reduce_q4's INT4 gather).

    Its own INT8 payload to the N-1 other nodes (one rank each), then the N payloads of its
    local rank's column to the node's L-1 other ranks.
    """
    payload = payload_bytes(numel, bits, group_size)
    return (local - 1) * nodes * payload, (nodes - 1) * payload


def qgz_volume(slice_numel: int, nodes: int, local: int, stages: int, group_size: int, *,
               first_bits: int = 4) -> tuple[int, int]:
    """(intra, inter) bytes per rank of reduce_scatter_q4.

    Per stage: (L-1) rows of N parts (INT4, or INT8 with ``first_bits=8``) to the node's other
    ranks, then (N-1) INT4 rows of one part (the re-quantized 1/L of this rank's share) to the
    other nodes.
    """
    part = _ceil_div(slice_numel, stages)
    if part == 0:
        return 0, 0
    intra = stages * (local - 1) * payload_bytes(nodes * part, first_bits, group_size)
    inter = stages * (nodes - 1) * payload_bytes(part, 4, group_size)
    return intra, inter


def _element_scales(rows: torch.Tensor, group_size: int, qmax: int) -> torch.Tensor:
    """Per element, its group's scale as the wire format computes it (fp32 division), as fp64."""
    length = rows.shape[-1]
    padded = torch.nn.functional.pad(rows.abs(), (0, _ceil_div(length, group_size) * group_size - length))
    absmax = padded.unflatten(-1, (-1, group_size)).amax(-1)
    scale = (absmax.float() / qmax).double()
    return scale.repeat_interleave(group_size, dim=-1)[..., :length]


def _group_max(values: torch.Tensor, group_size: int) -> torch.Tensor:
    length = values.shape[-1]
    padded = torch.nn.functional.pad(values, (0, _ceil_div(length, group_size) * group_size - length))
    return padded.unflatten(-1, (-1, group_size)).amax(-1).repeat_interleave(group_size, dim=-1)[..., :length]


def _one_quantization_error(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale / 2 + _QUANT_SLACK * (x.abs() + scale)


def all_gather_bound(inputs: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of |all_gather_q8 output - inputs| for fp64 ``inputs`` of shape (W, n)."""
    err = _one_quantization_error(inputs, _element_scales(inputs, group_size, 127))
    return err + UNIT_ROUNDOFF[dtype] * (inputs.abs() + err)


def reduce_scatter_bound(
    inputs: torch.Tensor,
    rank: int,
    *,
    nodes: int,
    local: int,
    stages: int,
    group_size: int,
    dtype: torch.dtype,
    divide_by: float,
    exact: torch.Tensor,
    first_bits: int = 4,
) -> torch.Tensor:
    """Per-element bound of |reduce_scatter_q4 output - exact| on ``rank``.

    ``inputs`` (W, W*m) fp64 are all ranks' inputs; ``exact`` (m,) the fp64 reference;
    ``first_bits`` the width of the first hop's rows (qmax 7 for INT4, 127 for INT8).
    """
    first_qmax = {4: 7, 8: 127}[first_bits]
    world = nodes * local
    slice_numel = inputs.shape[1] // world
    part = _ceil_div(slice_numel, stages)
    padded = torch.zeros(world, world, stages * part, dtype=torch.float64)
    padded[:, :, :slice_numel] = inputs.view(world, world, slice_numel)
    parts = padded.view(world, world, stages, part)  # [source, destination, stage, t]
    mine = parts[:, rank]  # [source, stage, t]
    node_r, local_r = divmod(rank, local)
    if local > 1:
        peers = [n * local + local_r for n in range(nodes)]
        rows_a = parts[:, peers].permute(0, 2, 1, 3).reshape(world, stages, nodes * part)
        scale_a = _element_scales(rows_a, group_size, first_qmax)[..., node_r * part : (node_r + 1) * part]
    else:
        scale_a = _element_scales(mine, group_size, first_qmax)
    err_a = _one_quantization_error(mine, scale_a)
    total = err_a.sum(0)
    if local > 1 and nodes > 1:
        node_exact = mine.view(nodes, local, stages, part).sum(1).abs()
        node_err = err_a.view(nodes, local, stages, part).sum(1)
        scale_b = _group_max(node_exact + node_err, group_size) / 7 * (1 + _FP32_SLACK)
        total = total + _one_quantization_error(node_exact + node_err, scale_b).sum(0)
    total = (total + _FP32_SLACK * (mine.abs().sum(0) + total)) / divide_by
    total = total.reshape(-1)[:slice_numel]
    return total + UNIT_ROUNDOFF[dtype] * (exact.abs() + total)


def all_reduce_bound(
    inputs: torch.Tensor,
    *,
    nodes: int,
    local: int,
    stages: int,
    group_size: int,
    gather_group_size: int | None,
    dtype: torch.dtype,
    divide_by: float,
    exact: torch.Tensor,
    first_bits: int = 4,
    gather_bits: int = 8,
) -> torch.Tensor:
    """Per-element bound of |all_reduce_q4 output - exact| for fp64 ``inputs`` (W, M).

    all_reduce_q4 is reduce_scatter_q4 of the inputs zero-padded to ``W * m`` (``m = ceil(M / W)``),
    then an all-gather of each rank's reduced slice ``y_r``: exact (``gather_group_size`` None) or
    one INT8 (``gather_bits`` 4: INT4) quantization of ``y_r`` in groups restarting at each slice's
    start, and one more rounding to the output dtype. With ``R`` the reduce-scatter's bound,
    ``|y| <= |exact| + R`` bounds the scale ``s <= max_group(|exact| + R) / qmax`` (127 or 7) and
    the gather adds ``g = s/2 + 2^-22 (|y| + s)``, then ``u (|exact| + R + g)``.
    """
    world = nodes * local
    numel = inputs.shape[1]
    slice_numel = _ceil_div(numel, world)
    padded = torch.zeros(world, world * slice_numel, dtype=torch.float64)
    padded[:, :numel] = inputs
    padded_exact = torch.zeros(world * slice_numel, dtype=torch.float64)
    padded_exact[:numel] = exact
    slices = padded_exact.view(world, slice_numel)
    reduce_bound = torch.stack([
        reduce_scatter_bound(padded, rank, nodes=nodes, local=local, stages=stages, group_size=group_size,
                             dtype=dtype, divide_by=divide_by, exact=slices[rank], first_bits=first_bits)
        for rank in range(world)
    ]) if slice_numel else torch.zeros(world, 0, dtype=torch.float64)
    if gather_group_size is None:
        return reduce_bound.reshape(-1)[:numel]
    largest = slices.abs() + reduce_bound  # (W, m): |y| per element, bounded
    scale = _group_max(largest, gather_group_size) / {8: 127, 4: 7}[gather_bits] * (1 + _FP32_SLACK)
    gather_error = _one_quantization_error(largest, scale)
    total = reduce_bound + gather_error + UNIT_ROUNDOFF[dtype] * (largest + gather_error)
    return total.reshape(-1)[:numel]


def all_reduce_volume(numel: int, nodes: int, local: int, stages: int, group_size: int,
                      gather_group_size: int, *, first_bits: int = 4, gather_bits: int = 8) -> dict[str, tuple[int, int]]:
    """comm_stats rows of one all_reduce_q4 call with a quantized gather: its reduce-scatter's and its
    gather's (``all_gather_q8``, or with ``gather_bits`` 4 the ``all_gather_hierarchical`` of INT4 bytes)."""
    slice_numel = _ceil_div(numel, nodes * local)
    gather = "all_gather_q8" if gather_bits == 8 else "all_gather_hierarchical"
    return {"reduce_scatter_q4": qgz_volume(slice_numel, nodes, local, stages, group_size, first_bits=first_bits),
            gather: qwz_volume(slice_numel, nodes, local, gather_group_size, bits=gather_bits)}
