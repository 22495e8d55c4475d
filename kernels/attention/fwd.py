"""FlashAttention forward in Triton: tiled online softmax, never materialising the (seq_q, seq_k) score matrix.

Loop order is FlashAttention-2's: one program owns a block of BLOCK_M query rows of one (batch, head) and streams
the K/V blocks of that head's KV group past it, keeping a running row max ``m_i``, a running row sum ``l_i`` and an
unnormalised output ``acc`` in fp32 (fp64 for fp64 inputs). Scores are kept in the log2 domain (log2(e) folded
into the softmax scale) so each exponential is one ``exp2``.

Per query block the key range splits (``masking._query_block_key_range``) into
  stage 1 (off-band): keys every row of the block sees: no mask at all;
  stage 2 (on-band):  blocks crossing the diagonal and the ragged tail of seq_k: elementwise mask;
and key blocks no row sees are never visited.

Two optional features, compiled in only when used (constexpr flags, so the plain kernel is unchanged):
  * a per-key additive bias (HAS_KEY_BIAS), (B, seq_k): key padding masks, -inf at padded keys (or any float
    key_padding_mask as nn.MultiheadAttention adds it to the scores); the key block's slice is loaded beside K and
    added to its scores, in both stages. Nothing (seq_q, seq_k)-sized is built.
  * attention dropout (DROPOUT): each probability P[b, h, i, j] is kept iff its Philox uniform under ``seed`` (a
    fixed function of (b, h, i, j): ``common._dropout_keep``) is >= p, and kept ones are scaled by 1 / (1 - p)
    (applied once, to the output). The row sums and the LSE are of the undropped P, so the backward regenerates
    the same mask from (seed, counter) and needs no stored bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from ..common import (LOG2E, _dropout_keep, _key_bias, _load_rows, _scale, allocate_outputs, block_d, cdiv,
                      lse_dtype, precision_for, split_scale)
from ..launch import on_input_device
from ..masking import (Varlen, _query_block_coords, _sequence, _tail_rows, _visible, _window_key_range, causal_sections,
                       window_mask)
from . import tiles


@triton.jit
def _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                         lo, hi, offs_m, offs_n, offs_d, seq_k, causal_offset, qk_scale, qk_scale_lo,
                         seed, rng_base, dropout_p,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                         PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                         SCALE_EARLY: tl.constexpr, left_offset=0, LOCAL: tl.constexpr = False):
    """Fold the key blocks [lo, hi) into the running (acc, l_i, m_i). MASKED selects stage 2.

    SCALE_EARLY scales the scores right after QK^T (fp64, whose scale has two parts; a key bias, which adds to
    scaled scores; a scale <= 0, which does not commute with max); otherwise the scale is folded into the
    exponent's FMA.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # the block's first row in int64 (rows * strides pass 2^31 at ~1M tokens), the tile's rows in int32
        k = _load_rows(k_base + start_n.to(tl.int64) * stride_kn + offs_n[:, None] * stride_kn, cols, seq_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        # scores: (BLOCK_M, BLOCK_N); log2 domain once scaled
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=acc.dtype)
        if SCALE_EARLY:
            qk = _scale(qk, qk_scale, qk_scale_lo)
            if HAS_KEY_BIAS:
                qk += _key_bias(kb_base, cols, seq_k)[None, :]
        if MASKED:
            qk = tl.where(_visible(offs_m[:, None], cols[None, :], seq_k, causal_offset, CAUSAL, left_offset, LOCAL),
                          qk, float("-inf"))
        if SCALE_EARLY:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        else:  # scale > 0 commutes with max: BLOCK_M multiplies here instead of BLOCK_M * BLOCK_N
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:
            # a row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        elif HAS_KEY_BIAS:
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        if SCALE_EARLY:
            p = tl.exp2(qk - m_new_safe[:, None])
        else:
            p = tl.exp2(qk * qk_scale - m_new_safe[:, None])  # scale and shift in one FMA per score
        alpha = tl.exp2(m_i - m_new_safe)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)  # the undropped row sum: dropout does not renormalise
        if DROPOUT:
            p = tl.where(_dropout_keep(seed, rng_base, offs_m[:, None], cols[None, :], seq_k, dropout_p), p, 0.0)
        v = _load_rows(v_base + start_n.to(tl.int64) * stride_vn + offs_n[:, None] * stride_vn, cols, seq_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION,
                     out_dtype=acc.dtype)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed", "sections", "WAVE_BUCKET"])
def attention_fwd_kernel(
    Q, K, V, O, LSE, KB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kbb,
    seq_q, seq_k, qk_scale, qk_scale_lo, window_left, window_right,
    seed, dropout_p, keep_scale, keep_scale_lo, sections,
    SEQ_BUCKET, WAVE_BUCKET,  # autotune keys only
    GROUP: tl.constexpr,  # query heads per KV head (GQA); 1 for plain multi-head attention
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,  # the right side of the window is bounded (causal: window_right = 0)
    LOCAL: tl.constexpr,  # the left side is bounded (window_left >= 0)
    VARLEN: tl.constexpr,  # packed sequences: CU_Q, CU_K give their offsets
    PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    SCALE_EARLY: tl.constexpr,  # fp64, HAS_KEY_BIAS or scale <= 0: see _attention_fwd_inner
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK_M), H_q, B).

    Q, O: (B, H_q, seq_q, HEAD_DIM); K, V: (B, H_q // GROUP, seq_k, HEAD_DIM); any strides.
    LSE: (B, H_q, seq_q) contiguous, log2-domain logsumexp of the scaled scores (-inf: row sees no key).
    KB: (B, seq_k) log2-domain key bias (-inf = padding), unit stride along keys, the accumulator's dtype
    (read only if HAS_KEY_BIAS).
    (qk_scale, qk_scale_lo) = split_scale(softmax scale * log2(e)); with DROPOUT, (keep_scale,
    keep_scale_lo) = split_scale(1 / (1 - dropout_p)) and ``seed`` keys the Philox stream.
    (window_left, window_right): the window (``masking``), read where LOCAL or CAUSAL.
    VARLEN: B = 1, seq_q and seq_k are the packed totals, CU_Q, CU_K (n + 1,) int32 offsets of the n sequences;
    grid (cdiv(longest seq_q, BLOCK_M), H_q, n + 1), the last index writing the rows past CU_Q[n].
    """
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    b, q_start, k_start, len_q, len_k = _sequence(CU_Q, CU_K, off_b, seq_q, seq_k, VARLEN)
    off_hk = off_h // GROUP
    acc_dtype = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # int64 base offsets: B * H * seq * D overflows int32 at long context
    q_base = Q + b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd
    o_base = O + b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    if VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        o_base += q_start.to(tl.int64) * stride_om

    tile_m = tl.arange(0, BLOCK_M)  # rows within the block; the block's first row goes in the int64 base
    q_base += start_m.to(tl.int64) * stride_qm
    o_base += start_m.to(tl.int64) * stride_om
    q = _load_rows(q_base + tile_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)

    kb_base = KB + off_b.to(tl.int64) * stride_kbb
    rng_base = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q

    causal_offset = len_k - len_q + window_right  # the right diagonal (masking's right_offset)
    left_offset = len_k - len_q - window_left
    lo, full_lo, mid, hi = _window_key_range(start_m, len_q, len_k, causal_offset, left_offset, CAUSAL, LOCAL,
                                             BLOCK_M, BLOCK_N, VARLEN)

    if LOCAL:  # stage 0: blocks crossing the window's left edge
        acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                                             lo, full_lo, offs_m, offs_n, offs_d, len_k, causal_offset,
                                             qk_scale, qk_scale_lo, seed, rng_base, dropout_p,
                                             HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, PRECISION,
                                             HAS_KEY_BIAS, DROPOUT, SCALE_EARLY, left_offset, LOCAL)
    # stage 1: off-band, no mask
    acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                                         full_lo, mid, offs_m, offs_n, offs_d, len_k, causal_offset,
                                         qk_scale, qk_scale_lo, seed, rng_base, dropout_p,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, PRECISION,
                                         HAS_KEY_BIAS, DROPOUT, SCALE_EARLY)
    # stage 2: blocks crossing the diagonal, and the ragged tail of seq_k
    acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                                         mid, hi, offs_m, offs_n, offs_d, len_k, causal_offset,
                                         qk_scale, qk_scale_lo, seed, rng_base, dropout_p,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, PRECISION,
                                         HAS_KEY_BIAS, DROPOUT, SCALE_EARLY, left_offset, LOCAL)

    # epilogue: one division by the row sum; rows that saw no key have acc = 0, l = 0 -> output 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = _scale(out, keep_scale, keep_scale_lo)  # 1 / (1 - p) for the kept probabilities
    # kept in the log2 domain: the backward needs it there, and a float literal (ln 2) would be fp32
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    row_ok = offs_m < len_q
    o_ptrs = o_base + tile_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    lse_base = LSE + (b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q + q_start
    tl.store(lse_base + offs_m, lse.to(LSE.dtype.element_ty), mask=row_ok)

    if VARLEN:  # rows past the last sequence: zeros, LSE -inf
        first, stop, step = _tail_rows(CU_Q, off_b, pid_m, seq_q, BLOCK_M)
        o_tail = O + off_h.to(tl.int64) * stride_oh
        lse_tail = LSE + off_h.to(tl.int64) * seq_q
        for r in range(first, stop, step):
            rows = r + tl.arange(0, BLOCK_M)
            tl.store(o_tail + rows[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
                     tl.zeros([BLOCK_M, BLOCK_D], O.dtype.element_ty),
                     mask=(rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))
            tl.store(lse_tail + rows, tl.full([BLOCK_M], float("-inf"), LSE.dtype.element_ty), mask=rows < seq_q)


_attention_fwd_tuned = tuning.autotuned(attention_fwd_kernel, tiles.FWD_CANDIDATES, tiles.FWD_CANDIDATES_WIDE,
                                        tiles.WIDE_HEAD_DIM)


@on_input_device
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0,
                  window_size: tuple[int, int] = (-1, -1), varlen: Varlen | None = None):
    """Launch the forward kernel. Returns (out, lse).

    q: (B, H_q, N_q, D), k/v: (B, H_kv, N_k, D), any strides, validated by the caller.
    key_padding_mask: None, bool (B, N_k) with True = padding, or float (B, N_k) added to the scaled scores
    (``flash_attention``'s semantics). dropout_p in [0, 1), with the Philox ``seed`` (an int in [0, 2**31): one
    argument type, so one compiled kernel). window_size: flash-attn's (left, right), -1 unbounded.
    varlen: packed sequences in a batch of one (B = 1; N_q, N_k the packed totals); no key padding mask or dropout.
    out: like q (same dtype, ``empty_like`` layout); lse: (B, H_q, N_q), the log2-domain LSE (log2 of the row sum
    of exp(scores)), float32 (float64 for fp64 inputs).
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    out, lse, done = allocate_outputs(q, k)
    if done:
        return out, lse
    mask = window_mask(causal, window_size)
    cu_q, cu_k, grid_q, grid_k, grid_b = varlen_grid(varlen, seq_q, seq_k, batch, lse)

    def grid(meta):
        return (cdiv(grid_q, meta["BLOCK_M"]), heads_q, grid_b)

    bd = block_d(head_dim)
    kb, stride_kbb = key_bias_arg(key_padding_mask, q, unused=lse)
    keys = (tuning.seq_bucket(grid_k), tuning.wave_bucket(grid_b * heads_q, grid_q, q.device))

    def launch_args(q, k, v, out, lse, kb, rows_q, rows_k, grid_q, grid_k):
        """The kernel's arguments for these tensors (the launch's, or its tuning proxy's) under the launch's keys."""
        return (q, k, v, out, lse, kb, cu_q, cu_k, *q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_kbb,
                rows_q, rows_k, *split_scale(scale * LOG2E), mask.left, mask.right, *dropout_args(dropout_p, seed),
                causal_sections(mask.causal, grid_b * heads_q, cdiv(grid_q, tiles.largest_tile("fwd", head_dim)),
                                heads_q // heads_kv, grid_k, 2 * head_dim * k.element_size(), q.device), *keys)

    def proxy():
        """The first ``rows`` rows of every tensor (a fresh LSE: the kernel indexes it by its length)."""
        p_lse = torch.empty(batch, heads_q, rows, device=q.device, dtype=lse.dtype)
        p_kb = kb[:, :rows] if key_padding_mask is not None else p_lse
        return ((lambda meta: (cdiv(rows, meta["BLOCK_M"]), heads_q, batch)),
                launch_args(q[:, :, :rows], k[:, :, :rows], v[:, :, :rows], out[:, :, :rows], p_lse, p_kb, rows,
                            rows, rows, rows))

    args = launch_args(q, k, v, out, lse, kb, seq_q, seq_k, grid_q, grid_k)
    fixed = tiles.fixed_config("fwd", bd, max(grid_q, grid_k)) if tuning.uses_fixed_tiles(q.dtype) else None
    rows = tuning.proxy_rows(batch * heads_q, seq_q, q.device) if varlen is None and seq_q == seq_k else None
    tuning.launch_tuned("fwd", _attention_fwd_tuned, attention_fwd_kernel, grid, args, fixed,
                        proxy if rows is not None else None,
                        GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, BLOCK_D=bd, CAUSAL=mask.causal,
                        LOCAL=mask.local, VARLEN=varlen is not None, PRECISION=precision_for(q.dtype),
                        HAS_KEY_BIAS=key_padding_mask is not None, DROPOUT=dropout_p > 0,
                        SCALE_EARLY=q.dtype == torch.float64 or key_padding_mask is not None or scale <= 0)
    return out, lse


def varlen_grid(varlen: Varlen | None, seq_q: int, seq_k: int, batch: int, unused: torch.Tensor):
    """(cu_q, cu_k, rows_q, rows_k, grid_b): the offsets the kernels take (``unused``, any tensor the launch
    has, when dense), the sequence lengths the grid is sized for, and the grid's batch axis (the sequences and
    one more for the rows past the last, when packed)."""
    if varlen is None:
        return unused, unused, seq_q, seq_k, batch
    return varlen.cu_q, varlen.cu_k, varlen.max_q, varlen.max_k, varlen.cu_q.shape[0]


def key_bias_arg(key_padding_mask: torch.Tensor | None, like: torch.Tensor,
                 unused: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The (KB, stride_kbb) kernel arguments: the key padding mask as a contiguous log2-domain bias (B, N_k) in the
    accumulator's dtype (-inf at True entries of a bool mask; a float mask times log2(e)) and its batch stride.
    Without a mask: ``unused``, any tensor of that dtype the launch already has (the kernel never reads it, so the
    common call allocates nothing), and stride 0 (one specialisation for all shapes). O(B * N_k) work on the host
    side of the launch when there is a mask."""
    dtype = lse_dtype(like.dtype)
    if key_padding_mask is None:
        return unused, 0
    if key_padding_mask.dtype == torch.bool:
        bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=like.device)
        bias.masked_fill_(key_padding_mask, float("-inf"))
    else:
        bias = (key_padding_mask.to(dtype) * LOG2E).contiguous()
    return bias, bias.stride(0)


def dropout_args(dropout_p: float, seed: int) -> tuple:
    """(seed, p, keep_scale, keep_scale_lo) kernel arguments; 1 / (1 - p) as a ``split_scale`` pair."""
    return (seed, dropout_p, *split_scale(1.0 / (1.0 - dropout_p)))
