"""Ring attention: one sequence split across the ranks of a process group, exact, on flashtrain's kernels.

Each rank holds its queries, keys and values in the load-balanced layout (``layout.py``: chunks r and 2P-1-r of
2P). The keys and values travel around the ring: at step s rank r holds those of rank j = r - s (mod P), sends them
on to rank r + 1 while it attends to them, and receives rank j - 1's. Each step's partial attention, with its LSE,
is merged into the running output in float32 (float64 for float64 inputs):

    out = out - sigmoid(lse_blk - lse) * (out - out_blk),    lse = lse - logsigmoid(lse - lse_blk)

Causal, in the load-balanced layout, every step does the same work (half a full block pair, after the first):
    step 0 (j = r):  the local causal attention of both chunks (the second sees the first in full);
    j < r:           both query chunks see rank j's first chunk in full, its second not at all;
    j > r:           only the second query chunk sees anything: both of rank j's chunks, in full.

The backward runs the same ring again. A block's gradients come from the FlashAttention backward kernels given the
final output and LSE (so P and delta are the global ones, and each block's dQ, dK, dV are its exact share); dQ
sums locally, and dK, dV travel with the keys and values they belong to, one more hop bringing them home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from flashtrain.ops.attention import backward_kernels, forward_kernels
from flashtrain.ops.checks import check_inputs
from flashtrain.ops.lse import LN2, kernel_dlse, natural_lse

from .layout import group_rank_size

FN = "ring_attention"


def check_shards(fn: str, q: Tensor, k: Tensor, v: Tensor, causal, scale, return_lse) -> float:
    """``flash_attention``'s checks of a rank's shards, then equal, even shard lengths (two chunks of the
    load-balanced layout each); returns the softmax scale. ``fn`` names the caller in the error."""
    scale = check_inputs(q, k, v, causal, scale, return_lse, None, 0.0)
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"{fn}: q has {q.shape[2]} rows and k {k.shape[2]}; expected the same even number (two "
                         "chunks of the load-balanced layout each)")
    return scale


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                   group=None, return_lse: bool = False):
    """This rank's shard of ``flash_attention(Q, K, V, causal=causal, scale=scale)`` over the full sequences, from
    the shards of every rank in ``group`` (default: the whole world).

    Args:
        q: (batch, heads_q, N / P, head_dim), k, v: (batch, heads_kv, N / P, head_dim): this rank's shards in the
            load-balanced layout (``shard_sequence``); every rank's have the same shape. heads_q a multiple of
            heads_kv (GQA), as in ``flash_attention``.
        causal, scale: as in ``flash_attention``, over the full sequence.
        group: a ``torch.distributed`` process group; a group of one (or no initialised process group) runs
            ``flash_attention`` itself.
        return_lse: also return this rank's rows of the natural-log LSE, float32 (batch, heads_q, N / P).

    Differentiable in q, k and v: each rank gets the gradients of its own shards.
    """
    rank, size = group_rank_size(group)
    if size == 1:
        from flashtrain.ops.attention import flash_attention
        return flash_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    scale = check_shards(FN, q, k, v, causal, scale, return_lse)
    _check_same_shards(q, k, group, rank, size)
    out, lse2 = _RingAttention.apply(q, k, v, causal, scale, group)
    return (out, natural_lse(lse2)) if return_lse else out


_checked_shapes: set = set()


def _check_same_shards(q: Tensor, k: Tensor, group, rank: int, size: int) -> None:
    """Every rank's shards have the same shapes and dtype (a collective, once per shape and group)."""
    key = (tuple(q.shape), tuple(k.shape), q.dtype, id(group))
    if key in _checked_shapes:
        return
    mine = [*q.shape, *k.shape, _DTYPES.index(q.dtype)]
    shapes = [None] * size
    dist.all_gather_object(shapes, mine, group=group)
    if any(s != mine for s in shapes):
        raise ValueError(f"{FN}: the ranks' shards differ: (q shape, k shape, dtype index) per rank {shapes}; "
                         "expected the same on every rank")
    _checked_shapes.add(key)


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _peers(group, rank: int, size: int) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the ring."""
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    return to_global((rank + 1) % size), to_global((rank - 1) % size)


def _exchange(tensors: list[Tensor], group, rank: int, size: int):
    """Start sending ``tensors`` to the next rank and receiving the previous rank's into new buffers; returns
    (the requests, the buffers)."""
    nxt, prev = _peers(group, rank, size)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def merge(out: Tensor | None, lse: Tensor | None, rows, o_blk: Tensor, lse_blk: Tensor):
    """Fold a partial attention (o_blk, its natural-log lse_blk, on query ``rows``) into (out, lse), both in the
    accumulator's dtype; (o_blk, lse_blk) themselves when out is None (the first step covers every row)."""
    if out is None:
        return o_blk, lse_blk
    o_acc, lse_acc = out[:, :, rows], lse[:, :, rows]
    out[:, :, rows] = o_acc - torch.sigmoid(lse_blk - lse_acc)[..., None] * (o_acc - o_blk)
    lse[:, :, rows] = lse_acc - F.logsigmoid(lse_acc - lse_blk)
    return out, lse


def rank_forward(q: Tensor, kv_of, rank: int, size: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s forward without communication: (out in q's dtype, log2-domain LSE) of its shard q against
    every rank's keys and values, ``kv_of(j)`` -> (k, v) of rank j, in ring order. The one-GPU simulation of the
    ring (scripts/bench/ring.py) times it rank by rank."""
    half = q.shape[2] // 2
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = lse = None
    for step in range(size):
        j = (rank - step) % size
        k_j, v_j = kv_of(j)
        rows, keys, blk_causal = _step_blocks(step, j, rank, causal, half)
        o_blk, lse2_blk = forward_kernels(q[:, :, rows], k_j[:, :, keys], v_j[:, :, keys], blk_causal, scale, None,
                                          0.0, 0)
        out, lse = merge(out, lse, rows, o_blk.to(acc_dtype), lse2_blk.to(acc_dtype) * LN2)
    return out.to(q.dtype), (lse / LN2).to(acc_dtype)


def rank_backward(dout: Tensor, q: Tensor, out: Tensor, lse2: Tensor, kv_of, rank: int, size: int, causal: bool,
                  scale: float):
    """Rank ``rank``'s backward without communication: (dq, {j: (dk_j, dv_j)}) in the accumulator's dtype, its
    shares of every rank's key and value gradients (which the ring sends home)."""
    half = q.shape[2] // 2
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dkv = {}
    for step in range(size):
        j = (rank - step) % size
        k_j, v_j = kv_of(j)
        rows, keys, blk_causal = _step_blocks(step, j, rank, causal, half)
        dq_blk, dk_blk, dv_blk = backward_kernels(dout[:, :, rows], q[:, :, rows], k_j[:, :, keys], v_j[:, :, keys],
                                                  out[:, :, rows], lse2[:, :, rows], None, blk_causal, scale)
        dq[:, :, rows] += dq_blk
        dk = torch.zeros(k_j.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v_j.shape, dtype=acc_dtype, device=q.device)
        dk[:, :, keys], dv[:, :, keys] = dk_blk.to(acc_dtype), dv_blk.to(acc_dtype)
        dkv[j] = (dk, dv)
    return dq, dkv


def _step_blocks(step: int, j: int, rank: int, causal: bool, half: int):
    """(query rows, key rows, causal) of step ``step``'s partial attention against rank j's keys, or the rows as
    slices of the local shards (see the module docstring)."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    if j < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group):
        rank, size = group_rank_size(group)
        half = q.shape[2] // 2
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = lse = None
        k_cur, v_cur = k, v
        for step in range(size):
            j = (rank - step) % size
            pending = _exchange([k_cur, v_cur], group, rank, size) if step + 1 < size else None
            rows, keys, blk_causal = _step_blocks(step, j, rank, causal, half)
            o_blk, lse2_blk = forward_kernels(q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys], blk_causal, scale,
                                              None, 0.0, 0)
            out, lse = merge(out, lse, rows, o_blk.to(acc_dtype), lse2_blk.to(acc_dtype) * LN2)
            if pending is not None:
                _wait(pending[0])
                k_cur, v_cur = pending[1]
        out = out.to(q.dtype)
        lse2 = (lse / LN2).to(acc_dtype)
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.causal, ctx.scale, ctx.group = causal, scale, group
        ctx.set_materialize_grads(False)
        return out, lse2

    @staticmethod
    def backward(ctx, dout, dlse2):
        q, k, v, out, lse2 = ctx.saved_tensors
        group = ctx.group
        rank, size = group_rank_size(group)
        half = q.shape[2] // 2
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        dlse = kernel_dlse(dlse2)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)  # for the keys held at this step
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        k_cur, v_cur = k, v
        for step in range(size):
            j = (rank - step) % size
            pending = _exchange([k_cur, v_cur], group, rank, size) if step + 1 < size else None
            rows, keys, blk_causal = _step_blocks(step, j, rank, ctx.causal, half)
            dq_blk, dk_blk, dv_blk = backward_kernels(
                dout[:, :, rows], q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys], out[:, :, rows],
                lse2[:, :, rows], None if dlse is None else dlse[:, :, rows], blk_causal, ctx.scale)
            dq[:, :, rows] += dq_blk
            dk[:, :, keys] += dk_blk
            dv[:, :, keys] += dv_blk
            # dK, dV go on with the keys they belong to; after the last step one more hop brings them home
            requests, (dk, dv) = _exchange([dk, dv], group, rank, size)
            _wait(requests)
            if pending is not None:
                _wait(pending[0])
                k_cur, v_cur = pending[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
