"""FlashAttention backward: scores recomputed from the saved LSE, no (seq_q, seq_k) storage.

With S = scale * Q K^T, P = exp(S - lse), O = P V and upstream gradients dO (and dlse, the gradient
of the natural-log LSE, if the caller used it):
    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - delta),   delta = rowsum(dO * O) - dlse      (preprocess kernel)
    dQ = scale * dS K,       dK = scale * dS^T Q

Two main kernels, no atomics, so results are bitwise deterministic:
  * ``attention_bwd_dkdv_kernel``: one program per (key block, KV head); it loops over the query heads of
    its GQA group and over query blocks, so dK/dV of a KV head are summed over the group in registers.
  * ``attention_bwd_dq_kernel``: one program per (query block, query head); loops over key blocks.
Causal blocks above the diagonal are skipped; only blocks that cross it pay for the elementwise mask.
(On an sm_90 GPU, long head_dim-64 sequences may run ``hopper/bwd.py`` instead, whose dQ sums with atomics:
``flashtrain.ops.dispatch`` decides.)

The key bias (key padding) is added to the recomputed scores as in the forward; rows whose LSE is -inf
(no visible key) read it as +inf, so their P is exactly 0 instead of exp2(-inf + inf) = NaN.
Attention dropout (see ``attention_fwd``) regenerates the forward's keep mask Z from the same Philox
counters; with r = 1 / (1 - p) the products become
    dV = (Z * P * r)^T dO,    dP = Z * r * (dO V^T),    dS = P * (dP - delta)
and delta = rowsum(dO * O) still equals rowsum(P * dP), since O is the dropped-out product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from ..common import (LOG2E, _dropout_keep, _key_bias, _load_rows, _scale, block_d, cdiv, precision_for,
                      split_scale)
from ..launch import INTERPRET, launch_kernel, on_input_device
from ..masking import (Varlen, _key_block_coords, _query_block_coords, _sequence, _tail_rows, _visible,
                       _window_key_range, _window_query_range, causal_sections, window_mask)
from . import tiles
from .fwd import dropout_args, key_bias_arg, varlen_grid


@triton.jit
def attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, DQ_ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    ZERO_DQ_ACC: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse, per query row. Grid (cdiv(seq_q, BLOCK_M), H_q, B).

    DLSE and DELTA: (B, H_q, seq_q) contiguous. Accumulates in fp32 (fp64 for fp64 inputs). ZERO_DQ_ACC: also
    zero this program's block of DQ_ACC, the Hopper backward's fp32 dQ buffer (B, H_q, cdiv(seq_q, 64) * 64, D),
    contiguous, BLOCK_M = 64: one pass over the rows instead of a separate fill kernel.
    """
    start_m = tl.program_id(0) * BLOCK_M
    tile_m = tl.arange(0, BLOCK_M)
    off_m = start_m + tile_m
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    acc_dtype = DELTA.dtype.element_ty
    # the block's first row in the int64 base: rows * strides pass 2^31 at ~1M tokens
    o = _load_rows(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                   + start_m.to(tl.int64) * stride_om + tile_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                   off_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                    + start_m.to(tl.int64) * stride_dom + tile_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    off_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(acc_dtype) * do.to(acc_dtype), 1)
    row = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q + off_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=off_m < seq_q, other=0.0).to(acc_dtype)
    tl.store(DELTA + row, delta, mask=off_m < seq_q)
    if ZERO_DQ_ACC:
        tl.static_assert(BLOCK_M == 64, "the dQ buffer comes in blocks of 64 rows")
        block = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * tl.num_programs(0) + tl.program_id(0)
        r = tl.arange(0, BLOCK_M)[:, None]
        tl.store(DQ_ACC + block * (BLOCK_M * HEAD_DIM) + r * HEAD_DIM + offs_d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=offs_d[None, :] < HEAD_DIM)


@triton.jit
def _attention_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, bias_n,
                              stride_qm, stride_dom, lo, hi, offs_m, offs_n, offs_d,
                              seq_q, seq_k, causal_offset, qk_scale, qk_scale_lo,
                              seed, rng_base, dropout_p, keep_scale, keep_scale_lo,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              MASKED: tl.constexpr, PRECISION: tl.constexpr,
                              HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr, EVEN_M: tl.constexpr,
                              CAUSAL: tl.constexpr = True, left_offset=0, LOCAL: tl.constexpr = False,
                              WANT_DK: tl.constexpr = True, WANT_DV: tl.constexpr = True):
    """Accumulate one query head's query blocks [lo, hi) into dK, dV of the resident key block (WANT_DK,
    WANT_DV: only the one asked for, the other returned as it came).

    Works on transposed tiles, (BLOCK_N, BLOCK_M), so K and V stay the left operands. Query rows past
    seq_q load as zeros with lse = +inf, so their P is exactly 0 and they add nothing; MASKED adds the
    window's mask for the blocks that cross a diagonal (CAUSAL: the right one, LOCAL: the left one).
    EVEN_M (seq_q a multiple of BLOCK_M: no row past seq_q) drops the row masks of the loads: ~20% fewer
    instructions per loop step, the backward 5-7% faster at head_dim 64 and 16k tokens
    (docs/performance-notes.md).
    """
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q = _load_rows(q_base + start_m.to(tl.int64) * stride_qm + offs_m[:, None] * stride_qm, rows, seq_q, offs_d,
                       HEAD_DIM, BLOCK_D, not EVEN_M)
        do = _load_rows(do_base + start_m.to(tl.int64) * stride_dom + offs_m[:, None] * stride_dom, rows, seq_q,
                        offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
        if EVEN_M:
            lse2 = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        else:
            lse2 = tl.load(lse_base + rows, mask=rows < seq_q, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < seq_q, other=0.0)
        # P^T, recomputed: (BLOCK_N, BLOCK_M)
        qk_t = _scale(tl.dot(k, tl.trans(q), input_precision=PRECISION, out_dtype=dk.dtype), qk_scale, qk_scale_lo)
        if HAS_KEY_BIAS:
            qk_t += bias_n[:, None]
            lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows that see no key: P = 0
        p_t = tl.exp2(qk_t - lse2[None, :])
        if MASKED:
            if LOCAL:
                visible = offs_n[:, None] >= rows[None, :] + left_offset
                if CAUSAL:
                    visible = visible & (offs_n[:, None] <= rows[None, :] + causal_offset)
                p_t = tl.where(visible, p_t, 0.0)
            elif CAUSAL:
                p_t = tl.where(offs_n[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
        if WANT_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION, out_dtype=dk.dtype)
        if DROPOUT:
            keep_t = _dropout_keep(seed, rng_base, rows[None, :], offs_n[:, None], seq_k, dropout_p)
            if WANT_DV:
                dv = tl.dot(tl.where(keep_t, _scale(p_t, keep_scale, keep_scale_lo), 0.0).to(do.dtype), do, dv,
                            input_precision=PRECISION, out_dtype=dv.dtype)
            if WANT_DK:
                dp_t = tl.where(keep_t, _scale(dp_t, keep_scale, keep_scale_lo), 0.0)
        elif WANT_DV:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION, out_dtype=dv.dtype)
        if WANT_DK:
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION, out_dtype=dk.dtype)
    return dk, dv


@triton.jit(do_not_specialize=["seed", "sections", "WAVE_BUCKET"])
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_kbb,
    seq_q, seq_k, sm_scale, sm_scale_lo, qk_scale, qk_scale_lo, window_left, window_right,
    seed, dropout_p, keep_scale, keep_scale_lo, sections,
    SEQ_BUCKET, WAVE_BUCKET,  # autotune keys only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, LOCAL: tl.constexpr, VARLEN: tl.constexpr,  # the window and packing, as in the forward
    PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_M: tl.constexpr,  # seq_q % BLOCK_M == 0 (the launcher tests seq_q % tiles.EVEN_M_MULTIPLE)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WANT_DK: tl.constexpr = True, WANT_DV: tl.constexpr = True,  # False, False is not a launch
):
    """One program: BLOCK_N keys of one (batch, KV head). Grid (cdiv(seq_k, BLOCK_N), H_kv, B).

    Q, DO: (B, H_q, seq_q, D); K, V, DK, DV: (B, H_kv, seq_k, D); LSE (log2 domain), DELTA: (B, H_q, seq_q)
    contiguous; KB, seed, dropout_p as in the forward. Scales come as ``split_scale`` pairs. sections: the causal
    launch sections of the (batch, KV head) pairs (``masking.causal_sections``). VARLEN: as in the forward, the
    grid's last batch index zeroing dK, dV of the keys past CU_K[n]. WANT_DK / WANT_DV: compute and write only dK
    (three products a block pair: S, dP, dK) or only dV (two: S, dV); two such launches hold one fp32 accumulator
    each, so larger key tiles fit (``dispatch.split_dkdv``).
    """
    pid_n, off_hk, off_b = _key_block_coords(sections, CAUSAL)  # causal: heaviest (first) key blocks first
    b, q_start, k_start, len_q, len_k = _sequence(CU_Q, CU_K, off_b, seq_q, seq_k, VARLEN)
    heads_q = tl.num_programs(1) * GROUP
    acc_dtype = DELTA.dtype.element_ty
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k_base = K + b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    dk_base = DK + b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh
    dv_base = DV + b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh
    if VARLEN:
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        dk_base += k_start.to(tl.int64) * stride_dkn
        dv_base += k_start.to(tl.int64) * stride_dvn
    # the block's first key in the int64 bases: rows * strides pass 2^31 at ~1M tokens
    tile_n = tl.arange(0, BLOCK_N)
    k_base += start_n.to(tl.int64) * stride_kn
    v_base += start_n.to(tl.int64) * stride_vn
    dk_base += start_n.to(tl.int64) * stride_dkn
    dv_base += start_n.to(tl.int64) * stride_dvn
    k = _load_rows(k_base + tile_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, True)
    if WANT_DK:  # V only enters dP
        v = _load_rows(v_base + tile_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                       offs_n, len_k, offs_d, HEAD_DIM, BLOCK_D, True)
    else:
        v = k
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    bias_n = tl.zeros([BLOCK_N], dtype=acc_dtype)
    if HAS_KEY_BIAS:
        bias_n = _key_bias(KB + off_b.to(tl.int64) * stride_kbb, offs_n, seq_k)

    causal_offset = len_k - len_q + window_right  # the window's diagonals, as in the forward
    left_offset = len_k - len_q - window_left
    lo, mid, full_hi, hi = _window_query_range(start_n, len_q, len_k, causal_offset, left_offset, CAUSAL, LOCAL,
                                               BLOCK_M, BLOCK_N, VARLEN)

    for g in range(GROUP):  # the query heads sharing this KV head: GQA sum in registers
        off_h = off_hk * GROUP + g
        q_base = Q + b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
        do_base = (DO + b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                   + offs_d[None, :] * stride_dod)
        if VARLEN:
            q_base += q_start.to(tl.int64) * stride_qm
            do_base += q_start.to(tl.int64) * stride_dom
        row_base = (b.to(tl.int64) * heads_q + off_h) * seq_q + q_start  # also the Philox base of this head
        # stage 1: query blocks crossing the right diagonal, masked
        dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                                           bias_n, stride_qm, stride_dom, lo, mid, offs_m, offs_n, offs_d,
                                           len_q, len_k, causal_offset, qk_scale, qk_scale_lo,
                                           seed, row_base, dropout_p, keep_scale, keep_scale_lo,
                                           HEAD_DIM, BLOCK_D, BLOCK_M, True, PRECISION, HAS_KEY_BIAS, DROPOUT, EVEN_M,
                                           CAUSAL, left_offset, LOCAL, WANT_DK, WANT_DV)
        # stage 2: query blocks that see the whole key block, no mask (packed: whole blocks of the sequence only)
        dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                                           bias_n, stride_qm, stride_dom, mid, full_hi, offs_m, offs_n, offs_d,
                                           len_q, len_k, causal_offset, qk_scale, qk_scale_lo,
                                           seed, row_base, dropout_p, keep_scale, keep_scale_lo,
                                           HEAD_DIM, BLOCK_D, BLOCK_M, False, PRECISION, HAS_KEY_BIAS, DROPOUT,
                                           EVEN_M or VARLEN, WANT_DK=WANT_DK, WANT_DV=WANT_DV)
        if LOCAL or VARLEN:  # stage 3: blocks crossing the window's left edge, or the sequence's ragged end: masked
            dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                                               bias_n, stride_qm, stride_dom, full_hi, hi, offs_m, offs_n, offs_d,
                                               len_q, len_k, causal_offset, qk_scale, qk_scale_lo,
                                               seed, row_base, dropout_p, keep_scale, keep_scale_lo,
                                               HEAD_DIM, BLOCK_D, BLOCK_M, True, PRECISION, HAS_KEY_BIAS, DROPOUT,
                                               EVEN_M, CAUSAL, left_offset, LOCAL, WANT_DK, WANT_DV)

    out_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_DIM)
    if WANT_DK:
        dk_ptrs = dk_base + tile_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        tl.store(dk_ptrs, _scale(dk, sm_scale, sm_scale_lo).to(DK.dtype.element_ty), mask=out_mask)
    if WANT_DV:
        dv_ptrs = dv_base + tile_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=out_mask)

    if VARLEN:  # keys past the last sequence: no gradient
        first, stop, step = _tail_rows(CU_K, off_b, pid_n, seq_k, BLOCK_N)
        for r in range(first, stop, step):
            rows = r + tl.arange(0, BLOCK_N)
            tail_mask = (rows[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
            zeros = tl.zeros([BLOCK_N, BLOCK_D], DK.dtype.element_ty)
            if WANT_DK:
                tl.store(DK + off_hk.to(tl.int64) * stride_dkh + rows[:, None].to(tl.int64) * stride_dkn
                         + offs_d[None, :] * stride_dkd, zeros, mask=tail_mask)
            if WANT_DV:
                tl.store(DV + off_hk.to(tl.int64) * stride_dvh + rows[:, None].to(tl.int64) * stride_dvn
                         + offs_d[None, :] * stride_dvd, zeros, mask=tail_mask)


@triton.jit
def _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, kb_base, stride_kn, stride_vn,
                            lo, hi, offs_m, offs_n, offs_d, seq_k, causal_offset, qk_scale, qk_scale_lo,
                            seed, rng_base, dropout_p, keep_scale, keep_scale_lo,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                            HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr, left_offset=0,
                            LOCAL: tl.constexpr = False):
    """Accumulate key blocks [lo, hi) into dQ of the resident query block. MASKED: diagonal and tail."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(k_base + start_n.to(tl.int64) * stride_kn + offs_n[:, None] * stride_kn, cols, seq_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        v = _load_rows(v_base + start_n.to(tl.int64) * stride_vn + offs_n[:, None] * stride_vn, cols, seq_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        qk = _scale(tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=dq.dtype), qk_scale, qk_scale_lo)
        if HAS_KEY_BIAS:
            qk += _key_bias(kb_base, cols, seq_k)[None, :]
        p = tl.exp2(qk - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m[:, None], cols[None, :], seq_k, causal_offset, CAUSAL, left_offset, LOCAL),
                         p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=dq.dtype)
        if DROPOUT:
            keep = _dropout_keep(seed, rng_base, offs_m[:, None], cols[None, :], seq_k, dropout_p)
            dp = tl.where(keep, _scale(dp, keep_scale, keep_scale_lo), 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION, out_dtype=dq.dtype)
    return dq


@triton.jit(do_not_specialize=["seed", "sections", "WAVE_BUCKET"])
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KB, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_kbb,
    seq_q, seq_k, sm_scale, sm_scale_lo, qk_scale, qk_scale_lo, window_left, window_right,
    seed, dropout_p, keep_scale, keep_scale_lo, sections,
    SEQ_BUCKET, WAVE_BUCKET,  # autotune keys only
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, LOCAL: tl.constexpr, VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK_M), H_q, B); sections
    as in the forward; VARLEN too, the grid's last batch index zeroing dQ of the rows past CU_Q[n]."""
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    b, q_start, k_start, len_q, len_k = _sequence(CU_Q, CU_K, off_b, seq_q, seq_k, VARLEN)
    off_hk = off_h // GROUP
    acc_dtype = DELTA.dtype.element_ty
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    dq_base = DQ + b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    k_base = K + b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd
    if VARLEN:
        q_base += q_start.to(tl.int64) * stride_qm
        do_base += q_start.to(tl.int64) * stride_dom
        dq_base += q_start.to(tl.int64) * stride_dqm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
    tile_m = tl.arange(0, BLOCK_M)  # rows within the block; the block's first row goes in the int64 bases
    q_base += start_m.to(tl.int64) * stride_qm
    do_base += start_m.to(tl.int64) * stride_dom
    dq_base += start_m.to(tl.int64) * stride_dqm
    q = _load_rows(q_base + tile_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(do_base + tile_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, len_q, offs_d, HEAD_DIM, BLOCK_D, True)
    row = (b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q + q_start + offs_m
    # rows past seq_q: lse = +inf gives P = 0 (their dQ is not stored anyway)
    lse2 = tl.load(LSE + row, mask=offs_m < len_q, other=float("inf"))
    if HAS_KEY_BIAS or LOCAL or VARLEN:  # rows that see no key: +inf makes P exactly 0, not exp2(-inf - -inf) = NaN
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(DELTA + row, mask=offs_m < len_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    kb_base = KB + off_b.to(tl.int64) * stride_kbb
    rng_base = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q

    causal_offset = len_k - len_q + window_right  # the window's diagonals, as in the forward
    left_offset = len_k - len_q - window_left
    lo, full_lo, mid, hi = _window_key_range(start_m, len_q, len_k, causal_offset, left_offset, CAUSAL, LOCAL,
                                             BLOCK_M, BLOCK_N, VARLEN)
    if LOCAL:  # stage 0: blocks crossing the window's left edge
        dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, kb_base, stride_kn, stride_vn,
                                     lo, full_lo, offs_m, offs_n, offs_d, len_k, causal_offset, qk_scale, qk_scale_lo,
                                     seed, rng_base, dropout_p, keep_scale, keep_scale_lo,
                                     HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, PRECISION, HAS_KEY_BIAS, DROPOUT,
                                     left_offset, LOCAL)
    # stage 1: off-band, no mask
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, kb_base, stride_kn, stride_vn,
                                 full_lo, mid, offs_m, offs_n, offs_d, len_k, causal_offset, qk_scale, qk_scale_lo,
                                 seed, rng_base, dropout_p, keep_scale, keep_scale_lo,
                                 HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, PRECISION, HAS_KEY_BIAS, DROPOUT)
    # stage 2: diagonal blocks and the ragged tail of seq_k
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, kb_base, stride_kn, stride_vn,
                                 mid, hi, offs_m, offs_n, offs_d, len_k, causal_offset, qk_scale, qk_scale_lo,
                                 seed, rng_base, dropout_p, keep_scale, keep_scale_lo,
                                 HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, PRECISION, HAS_KEY_BIAS, DROPOUT,
                                 left_offset, LOCAL)

    dq_ptrs = dq_base + tile_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, _scale(dq, sm_scale, sm_scale_lo).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM))

    if VARLEN:  # rows past the last sequence: no gradient
        first, stop, step = _tail_rows(CU_Q, off_b, pid_m, seq_q, BLOCK_M)
        for r in range(first, stop, step):
            rows = r + tl.arange(0, BLOCK_M)
            tl.store(DQ + off_h.to(tl.int64) * stride_dqh + rows[:, None].to(tl.int64) * stride_dqm
                     + offs_d[None, :] * stride_dqd, tl.zeros([BLOCK_M, BLOCK_D], DQ.dtype.element_ty),
                     mask=(rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))


_attention_bwd_dkdv_tuned = tuning.autotuned(attention_bwd_dkdv_kernel, tiles.DKDV_CANDIDATES,
                                              tiles.DKDV_CANDIDATES_WIDE, tiles.WIDE_HEAD_DIM, extra_key=["EVEN_M"])
# dK and dV in two launches (``split_dkdv``): one fp32 accumulator a program, so wide heads get larger key tiles
_attention_bwd_dkdv_split_tuned = tuning.autotuned(attention_bwd_dkdv_kernel, tiles.DKDV_CANDIDATES,
                                                    tiles.DKDV_SPLIT_CANDIDATES_WIDE, tiles.WIDE_HEAD_DIM,
                                                    extra_key=["EVEN_M", "WANT_DK", "WANT_DV"])
_attention_bwd_dq_tuned = tuning.autotuned(attention_bwd_dq_kernel, tiles.DQ_CANDIDATES, tiles.DQ_CANDIDATES_WIDE,
                                           tiles.WIDE_HEAD_DIM)

PREPROCESS_BLOCK_M = 64  # rows a delta program; also the Hopper backward's dQ buffer block, which it zeroes


def backward_delta(out: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None, lse: torch.Tensor,
                   dq_acc: torch.Tensor | None = None) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse, (B, H_q, N_q) like ``lse`` (contiguous, the accumulator's dtype), by the
    preprocess kernel; out, do: (B, H_q, N_q, D), any strides. Shared by the 16-bit, the Hopper and the FP8
    backwards. dq_acc: the Hopper backward's dQ buffer (``hopper.bwd.dq_buffer``), zeroed on the way."""
    batch, heads_q, seq_q, head_dim = out.shape
    delta = torch.empty_like(lse)
    block_m = 16 if INTERPRET and dq_acc is None else PREPROCESS_BLOCK_M
    launch_kernel(
        attention_bwd_preprocess_kernel, (cdiv(seq_q, block_m), heads_q, batch),
        out, do, dlse.contiguous() if dlse is not None else delta, delta, dq_acc if dq_acc is not None else delta,
        *out.stride(), *do.stride(), seq_q, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m,
        HAS_DLSE=dlse is not None, ZERO_DQ_ACC=dq_acc is not None)
    return delta


@on_input_device
def attention_bwd(do, q, k, v, out, lse, dlse, causal: bool, scale: float,
                  key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0,
                  window_size: tuple[int, int] = (-1, -1), varlen: Varlen | None = None, split_dkdv: bool = False):
    """Launch the backward kernels. Returns (dq, dk, dv), each ``empty_like`` its input.

    do, out: (B, H_q, N_q, D); lse: (B, H_q, N_q), the log2-domain LSE from ``attention_fwd``; dlse: the gradient of
    the natural-log LSE, same shape, or None. Any strides for do, q, k, v, out. key_padding_mask, dropout_p, seed,
    window_size and varlen: exactly as given to ``attention_fwd``. split_dkdv: dK and dV in two launches of the
    dK/dV kernel (one product more a block pair, one accumulator each; ``flashtrain.ops.dispatch`` decides).
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = backward_delta(out, do, dlse, lse)
    bd = block_d(head_dim)
    group = heads_q // heads_kv
    mask = window_mask(causal, window_size)
    cu_q, cu_k, grid_q, grid_k, grid_b = varlen_grid(varlen, seq_q, seq_k, batch, delta)

    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=bd, CAUSAL=mask.causal, LOCAL=mask.local,
                VARLEN=varlen is not None, PRECISION=precision_for(q.dtype),
                HAS_KEY_BIAS=key_padding_mask is not None, DROPOUT=dropout_p > 0)
    kb, stride_kbb = key_bias_arg(key_padding_mask, q, unused=delta)
    # the tuner's keys: dK/dV has a program per key block, dQ per query block
    dkdv_keys = (tuning.seq_bucket(grid_q), tuning.wave_bucket(grid_b * heads_kv, grid_k, q.device))
    dq_keys = (tuning.seq_bucket(grid_k), tuning.wave_bucket(grid_b * heads_q, grid_q, q.device))
    row_bytes = 2 * head_dim * q.element_size()

    def launch_args(q, k, v, do, lse, delta, dq, dk, dv, kb, rows_q, rows_k, grid_q, grid_k):
        """(dK/dV's, dQ's) kernel arguments for these tensors (the launch's, or its tuning proxy's) under the
        launch's keys. Causal launch sections are counted in the largest tile the tuner may pick: dK/dV streams Q
        and dO of its KV head's group (with LSE and delta), dQ streams K and V."""
        common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
        scalars = (rows_q, rows_k, *split_scale(scale), *split_scale(scale * LOG2E), mask.left, mask.right,
                   *dropout_args(dropout_p, seed))
        dkdv_sections = causal_sections(mask.causal, grid_b * heads_kv,
                                        cdiv(grid_k, tiles.largest_tile(dkdv_tiles, head_dim)), 1, grid_q,
                                        group * (row_bytes + 2 * lse.element_size()), q.device)
        dq_sections = causal_sections(mask.causal, grid_b * heads_q, cdiv(grid_q, tiles.largest_tile("dq", head_dim)),
                                      group, grid_k, row_bytes, q.device)
        return ((q, k, v, do, lse, delta, dk, dv, kb, cu_q, cu_k, *common, *dk.stride(), *dv.stride(), stride_kbb,
                 *scalars, dkdv_sections, *dkdv_keys),
                (q, k, v, do, lse, delta, dq, kb, cu_q, cu_k, *common, *dq.stride(), stride_kbb, *scalars,
                 dq_sections, *dq_keys))

    dkdv_tiles = "dkdv_split" if split_dkdv else "dkdv"
    dense_self = varlen is None and seq_q == seq_k
    # each kernel's proxy in its own wave bucket: dK/dV has a program per (key block, KV head), dQ per query head's
    dkdv_rows = tuning.proxy_rows(batch * heads_kv, seq_k, q.device) if dense_self else None
    dq_rows = tuning.proxy_rows(batch * heads_q, seq_q, q.device) if dense_self else None

    def proxy_args(rows):
        """The first ``rows`` rows of every tensor (LSE and delta copied: the kernels index them by their length);
        the gradients' first rows are written again by the launch that follows."""
        cut = [t[:, :, :rows] for t in (q, k, v, do)]
        stats = [t[:, :, :rows].contiguous() for t in (lse, delta)]
        return launch_args(*cut, *stats, dq[:, :, :rows], dk[:, :, :rows], dv[:, :, :rows],
                           kb[:, :rows] if key_padding_mask is not None else delta, rows, rows, rows, rows)

    dkdv_args, dq_args = launch_args(q, k, v, do, lse, delta, dq, dk, dv, kb, seq_q, seq_k, grid_q, grid_k)
    fixed = tuning.uses_fixed_tiles(q.dtype)
    longest = max(grid_q, grid_k)
    # EVEN_M drops the row masks of the query loads: packed sequences have ragged ends wherever they stop
    even_m = varlen is None and seq_q % tiles.EVEN_M_MULTIPLE == 0
    # split: a dK launch, then a dV launch, each tuned on its own; otherwise one launch writes both
    dkdv_tuned = _attention_bwd_dkdv_split_tuned if split_dkdv else _attention_bwd_dkdv_tuned
    dkdv_launches = [dict(WANT_DK=True, WANT_DV=False), dict(WANT_DK=False, WANT_DV=True)] if split_dkdv else [{}]
    for dkdv_meta in dkdv_launches:
        tuning.launch_tuned("dkdv", dkdv_tuned, attention_bwd_dkdv_kernel,
                            lambda m: (cdiv(grid_k, m["BLOCK_N"]), heads_kv, grid_b), dkdv_args,
                            tiles.fixed_config("dkdv", bd, longest) if fixed else None,
                            None if dkdv_rows is None else lambda: (
                                lambda m: (cdiv(dkdv_rows, m["BLOCK_N"]), heads_kv, batch), proxy_args(dkdv_rows)[0]),
                            **meta, EVEN_M=even_m, **dkdv_meta)
    tuning.launch_tuned("dq", _attention_bwd_dq_tuned, attention_bwd_dq_kernel,
                        lambda m: (cdiv(grid_q, m["BLOCK_M"]), heads_q, grid_b), dq_args,
                        tiles.fixed_config("dq", bd, longest) if fixed else None,
                        None if dq_rows is None else lambda: (
                            lambda m: (cdiv(dq_rows, m["BLOCK_M"]), heads_q, batch), proxy_args(dq_rows)[1]),
                        **meta)
    return dq, dk, dv
