"""FP8 (e4m3) attention backward: the four gradient matmuls on FP8 operands with per-tile scales.

With the forward's notation (S in the log2 domain, lse from the FP8 forward), per tile pair:
    P   = exp2(S - lse),         S recomputed from the FP8 Q and K tiles as in the forward
    dP  = (dO8 V8^T)  * (do_scale * v_scale)
    dS  = P * (dP - delta)                        fp32; delta = rowsum(dO8 * O) - dlse (dO's quantisation pass)
    dV += P8^T dO8                                P8 = round_e4m3(448 P * do_scale / dv_unit)
    dK += dS8^T Q8                                dS8 = round_e4m3(dS * q_scale / dk_unit), per key row
    dQ += (dS8 K8)    * (ds_scale * k_scale)      dS8 = round_e4m3(dS / ds_scale), per query row
and at the end dV *= dv_unit / 448, dK *= dk_unit * softmax scale, dQ *= softmax scale. dV and dK thus
accumulate in place in the tensor core's accumulator (a second fp32 tile for each product's scaled copy does
not fit in registers beside them at 128 keys and head_dim 128): dv_unit is the largest dO tile scale of the
GQA group; dk_unit, per key, the running largest (dS row scale) * q_scale (at least 2^-126, so that 1 / dk_unit
is finite), which rescales the key's dK row when it grows (powers of two: exact). An all-zero Q or dO tile has
scale 0 here, so it never sets a unit.
Q and dO are quantised in tiles of SCALE_M rows, K and V in tiles of SCALE_N rows (``tiles.fp8_bwd_tiles``);
the kernels' tiles divide them, so every tile a loop step loads has one scale. dS is quantised in the kernel
that uses it, one power-of-two scale per row of the tile it holds: per key over BLOCK_M queries in the dK/dV
kernel (dS^T's rows), per query over BLOCK_N keys in the dQ kernel. A row's scale multiplies a row of the
product (dK's row for a key, dQ's for a query), so it comes out of the sum; a row amax is a reduction inside a
warp, where one scale per tile needs all warps' maxima (a shared-memory round trip and a barrier every step).
When the forward rotated Q and K, the kernels rotate dQ and dK back before storing them: the inverse
transform on the fp32 tile in registers (``hadamard._inverse_rotation``, the arithmetic of ``hadamard``'s
inverse; on the GPU the compiler may fuse the softmax scale's product into its first adds), then one rounding
to the output dtype (dK's stays fp32 where the caller centres it).
``flashtrain.ops.reference.fp8_attention_bwd_ref`` simulates all of it in float64.

The products that reduce over the sequence (dV, dK, dQ) read Q, K and dO from transposed copies (quantised
straight into that layout), so every FP8 tensor-core operand has its reduced dim contiguous and every tile in
the loops is a pipelined async copy.

Two kernels as in the 16-bit backward, no atomics: ``attention_fp8_bwd_dkdv_kernel`` (key tile resident,
GQA group summed in registers) and ``attention_fp8_bwd_dq_kernel`` (query tile resident). Causal tiles
above the diagonal are skipped; only the tiles that cross it (and every tile of a ragged shape, whose
sequence is not a multiple of the tiles) pay for masks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import common
from ..common import LOG2E, _load_rows, cdiv, split_scale
from ..launch import launch_kernel, on_input_device
from ..masking import _dkdv_query_range, _key_block_coords, _query_block_coords, _query_block_key_range, causal_sections
from .hadamard import _inverse_rotation
from .quant import (MIN_SCALE, SOFTWARE_ROUNDING, _chunked_amax, _prepared_rows, _quantize_with_pow2_scale,
                    _store_copies, _tile_scale, _to_e4m3, fp8_quantize, quant_chunk, quantize_scores_operands,
                    transposed_e4m3)
from .tiles import fp8_block_d, fp8_bwd_tiles


@triton.jit
def _load_cols(ptrs, cols, seq, offs_d, DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_COLS: tl.constexpr):
    """A (BLOCK_D, cols) tile of a transposed (DIM, seq) matrix; zero-fill columns >= seq (if MASK_COLS) and
    rows >= DIM."""
    if MASK_COLS:
        return tl.load(ptrs, mask=(offs_d[:, None] < DIM) & (cols[None, :] < seq), other=0.0)
    if DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[:, None] < DIM, other=0.0)


@triton.jit
def _to_e4m3_sat(x):
    """fp32 x in e4m3, saturating at +-448: the GPU's conversion saturates (cvt.rn.satfinite); the interpreter's
    software rounding needs |x| <= 448 first."""
    if SOFTWARE_ROUNDING:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return _to_e4m3(x)


@triton.jit
def _settled(acc):
    """acc, read by an empty inline asm (no instruction): Triton then waits for the wgmma that wrote it within
    the loop step. Left in flight across the loop's back edge, dK's accumulator makes ptxas serialise every
    wgmma of the dK/dV kernel (warning C7515: each waits for the one before; ``tiles.FP8_BWD_SETTLE_DK`` says
    where that is slower). Not for the interpreter, which runs no asm."""
    return tl.inline_asm_elementwise("// $0 settled", "=r,0", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _ds_factor(q_scale, inv_unit):
    """q_scale / unit, dK's quantisation factor per key row, at most 2^127. At the unit's floor (2^-126: a row whose
    dS is zero or below 2^-126 / q_scale so far) the product overflows for q_scale >= 4, and a zero dS (a key no
    query of the tile sees) times infinity was NaN: in the interpreter (whose e4m3 conversion turns NaN into
    +-384, so the outputs stayed finite there), and by the GPU's conversion rules (cvt.rn.satfinite keeps NaN) a
    NaN e4m3 and a NaN dK row. Clamped, such a row's dS lands in a lower binade than its unit says, an error
    below 448 * 2^-126 * |Q8| in dK: none in practice."""
    return tl.minimum(q_scale * inv_unit, 2.0 ** 127)


@triton.jit
def _row_scales(x):
    """Per row of the fp32 tile x: ``_tile_scale`` of its amax (amax / 448 up to a power of two), 0 for an
    all-zero row."""
    amax = tl.max(tl.abs(x), 1)
    return tl.where(amax > 0.0, _tile_scale(amax, True), 0.0)


@triton.jit
def _quantize_rows(x):
    """(x8, scale): the fp32 tile x in e4m3 with one power-of-two scale per row ((rows,) fp32; 1 for an all-zero
    row). The scale being a power of two, x * (1 / scale) is x / scale exactly."""
    scale = _tile_scale(tl.max(tl.abs(x), 1), True)
    return _to_e4m3_sat(x * (1.0 / scale)[:, None]), scale


@triton.jit
def _attention_fp8_bwd_dkdv_inner(dk, dv, dk_unit, inv_dv_unit, k, v, k_scale, v_scale, q_rows, qt_cols, do_rows,
                                  dot_cols, q_scales, do_scales, lse_rows, delta_rows, lo, hi, offs_m, offs_n,
                                  offs_dk, offs_dv, seq_q, seq_k, causal_offset, qk_scale, stride_qt_row,
                                  stride_dot_row,
                                  QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
                                  BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, SCALE_M: tl.constexpr,
                                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, SETTLE_DK: tl.constexpr):
    """Accumulate query tiles [lo, hi) of one query head into dK, dV of the resident key tile, on transposed
    tiles (BLOCK_N keys, BLOCK_M queries) so that K and V stay the left operands. MASKED: bounds and the causal
    mask (tiles crossing the diagonal, or a ragged shape); otherwise every element is visible and in bounds."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q = _load_rows(q_rows + rows[:, None] * QK_DIM + offs_dk[None, :], rows, seq_q, offs_dk, QK_DIM, BLOCK_DK,
                       MASKED)
        do = _load_rows(do_rows + rows[:, None] * HEAD_DIM + offs_dv[None, :], rows, seq_q, offs_dv, HEAD_DIM,
                        BLOCK_DV, MASKED)
        q_t = _load_cols(qt_cols + offs_dk[:, None] * stride_qt_row + rows[None, :], rows, seq_q, offs_dk, QK_DIM,
                         BLOCK_DK, MASKED)  # (BLOCK_DK, BLOCK_M)
        do_t = _load_cols(dot_cols + offs_dv[:, None] * stride_dot_row + rows[None, :], rows, seq_q, offs_dv, HEAD_DIM,
                          BLOCK_DV, MASKED)  # (BLOCK_DV, BLOCK_M)
        q_scale = tl.load(q_scales + start_m // SCALE_M)
        do_scale = tl.load(do_scales + start_m // SCALE_M)
        if MASKED:  # rows past seq_q: P = exp2(-inf) = 0
            lse2 = tl.load(lse_rows + rows, mask=rows < seq_q, other=float("inf"))
            delta = tl.load(delta_rows + rows, mask=rows < seq_q, other=0.0)
        else:
            lse2 = tl.load(lse_rows + rows)
            delta = tl.load(delta_rows + rows)
        # stage A: P^T, recomputed from the FP8 scores, (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * (k_scale * q_scale * qk_scale) - lse2[None, :])
        if MASKED:  # keys past seq_k, and above the diagonal (rows that see no key have lse -inf: p = inf there)
            visible = offs_n[:, None] < seq_k
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + causal_offset)
            p_t = tl.where(visible, p_t, 0.0)
        # stage B: dV, in units of dv_unit / 448 (dv_unit: the largest dO scale of the GQA group), so that the
        # product accumulates in place: P8 = round_e4m3(448 P * do_scale / dv_unit), P's fixed scale (P <= 1
        # fills e4m3's range) for the largest dO tiles, lower binades for smaller ones
        dv = tl.dot(_to_e4m3_sat(p_t * (448.0 * do_scale * inv_dv_unit)), tl.trans(do_t), dv)
        # stage C: dS^T and dK. dK's rows are kept in units of dk_unit, the running max over the steps so far of
        # c = (dS's row scale) * q_scale, so the product accumulates in place (no second fp32 tile): a larger c
        # rescales the row (powers of two: exact), and dS is quantised as dS * q_scale / dk_unit, which is
        # dS / (its row scale) where c is the max, and lower binades where an earlier step's c was larger.
        dp_t = tl.dot(v, tl.trans(do)) * (v_scale * do_scale)
        ds_t = p_t * (dp_t - delta[None, :])
        # at least MIN_SCALE (2^-126), as the tile scales: a (dS row scale) x q_scale below fp32's normal range made
        # 1 / unit infinite and dK NaN; rows whose dS is zero so far (dK zero) take it too, harmlessly
        unit = tl.maximum(dk_unit, tl.maximum(_row_scales(ds_t) * q_scale, MIN_SCALE))
        inv_unit = 1.0 / unit
        dk = dk * (dk_unit * inv_unit)[:, None]
        ds8_t = _to_e4m3_sat(ds_t * _ds_factor(q_scale, inv_unit)[:, None])
        dk = tl.dot(ds8_t, tl.trans(q_t), dk)
        if SETTLE_DK:
            dk = _settled(dk)
        dk_unit = unit
    return dk, dv, dk_unit


@triton.jit(do_not_specialize=["sections"])
def attention_fp8_bwd_dkdv_kernel(
    Q8, QT8, QS, K8, KS, V8, VS, DO8, DOT8, DOS, DV_UNIT, LSE, DELTA, SIGNS, DK, DK_SUM, DV,
    stride_qt_h, stride_qt_row, stride_dot_h, stride_dot_row,
    seq_q, seq_k, qk_scale, sm_scale, norm, norm_lo, sections,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_M: tl.constexpr, SCALE_N: tl.constexpr,
    SETTLE_DK: tl.constexpr, ROTATED: tl.constexpr, KEY_SUMS: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, KV head). Grid (cdiv(seq_k, BLOCK_N), H_kv, B).

    Q8 (B, H_q, seq_q, QK_DIM), K8 (B, H_kv, seq_k, QK_DIM), V8 (B, H_kv, seq_k, HEAD_DIM), DO8 (B, H_q, seq_q,
    HEAD_DIM): e4m3, contiguous; QS, DOS (B, H_q, cdiv(seq_q, SCALE_M)) and KS, VS (B, H_kv, cdiv(seq_k,
    SCALE_N)) their fp32 scales. QT8, DOT8: Q8 and DO8 transposed, (B, H_q, dim, seq) with the seq stride 1 and
    the given head and dim strides (FP8 tensor cores read both operands with the reduced dim contiguous). LSE
    (log2 domain), DELTA: (B, H_q, seq_q) fp32. DV_UNIT (B * H_kv,) fp32: the largest of DOS over each GQA
    group. DK (B, H_kv, seq_k, HEAD_DIM), DV (B, H_kv, seq_k, HEAD_DIM) in V's dtype, contiguous. ROTATED: Q8 and
    K8 are rotated (QK_DIM the transform's width, SIGNS its (QK_DIM,) signs, (norm, norm_lo) the split
    1 / sqrt(QK_DIM)); dK is rotated back before it is stored (``hadamard._inverse_rotation``), else QK_DIM ==
    HEAD_DIM. KEY_SUMS: DK_SUM (B, H_kv, cdiv(seq_k, BLOCK_N), HEAD_DIM) fp32 gets each program's sum of dK
    over its keys (fp32, before DK's rounding), for the centring of K smoothing's backward. EVEN: seq_q %
    BLOCK_M == 0 and seq_k % BLOCK_N == 0 (else every tile is masked). SETTLE_DK: wait for dK's wgmma within
    each step (``_settled``; GPU only). sections: the causal launch sections of the (batch, KV head) pairs
    (``masking.causal_sections``).
    """
    pid_n, off_hk, off_b = _key_block_coords(sections, CAUSAL)  # causal: heaviest (first) key blocks first
    heads_kv = tl.num_programs(1)
    heads_q = heads_kv * GROUP
    scale_tiles_q = tl.cdiv(seq_q, SCALE_M)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)

    head_kv = off_b.to(tl.int64) * heads_kv + off_hk
    k = _load_rows(K8 + (head_kv * seq_k + offs_n[:, None]) * QK_DIM + offs_dk[None, :],
                   offs_n, seq_k, offs_dk, QK_DIM, BLOCK_DK, not EVEN)
    v = _load_rows(V8 + (head_kv * seq_k + offs_n[:, None]) * HEAD_DIM + offs_dv[None, :],
                   offs_n, seq_k, offs_dv, HEAD_DIM, BLOCK_DV, not EVEN)
    scale_tile_n = head_kv * tl.cdiv(seq_k, SCALE_N) + start_n // SCALE_N
    k_scale = tl.load(KS + scale_tile_n)
    v_scale = tl.load(VS + scale_tile_n)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)  # in units of dk_unit (see the loop)
    dk_unit = tl.zeros([BLOCK_N], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)  # in units of dv_unit / 448
    dv_unit = tl.load(DV_UNIT + head_kv)
    inv_dv_unit = 1.0 / tl.where(dv_unit > 0.0, dv_unit, 1.0)  # 0: dO is all zeros, and so is dV

    causal_offset = seq_k - seq_q
    lo, mid, end = _dkdv_query_range(start_n, seq_q, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    if not EVEN:
        mid = end
    for g in range(GROUP):  # the query heads sharing this KV head: GQA sum in registers
        head_q = off_b.to(tl.int64) * heads_q + off_hk * GROUP + g
        args = (k, v, k_scale, v_scale, Q8 + head_q * seq_q * QK_DIM, QT8 + head_q * stride_qt_h,
                DO8 + head_q * seq_q * HEAD_DIM, DOT8 + head_q * stride_dot_h, QS + head_q * scale_tiles_q,
                DOS + head_q * scale_tiles_q, LSE + head_q * seq_q, DELTA + head_q * seq_q)
        # stage 1: query tiles crossing the diagonal (all of them when the shape is ragged), masked
        dk, dv, dk_unit = _attention_fp8_bwd_dkdv_inner(
            dk, dv, dk_unit, inv_dv_unit, *args, lo, mid, offs_m, offs_n, offs_dk, offs_dv, seq_q, seq_k,
            causal_offset, qk_scale, stride_qt_row, stride_dot_row, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_DV, BLOCK_M,
            SCALE_M, True, CAUSAL, SETTLE_DK)
        # stage 2: query tiles that see the whole key tile, no mask
        dk, dv, dk_unit = _attention_fp8_bwd_dkdv_inner(
            dk, dv, dk_unit, inv_dv_unit, *args, mid, end, offs_m, offs_n, offs_dk, offs_dv, seq_q, seq_k,
            causal_offset, qk_scale, stride_qt_row, stride_dot_row, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_DV, BLOCK_M,
            SCALE_M, False, CAUSAL, SETTLE_DK)

    rows_ok = offs_n[:, None] < seq_k
    dk = dk * (dk_unit * sm_scale)[:, None]
    if ROTATED:  # back from the rotated space, in registers: one pass over dK fewer than a separate transform
        dk = _inverse_rotation(dk, SIGNS, norm, norm_lo, BLOCK_N, BLOCK_DK, QK_DIM)
    dk_cols = offs_dk[None, :] < HEAD_DIM
    if KEY_SUMS:  # keys past seq_k have dK = 0: dS is masked there
        tl.store(DK_SUM + (head_kv * tl.num_programs(0) + pid_n) * HEAD_DIM + offs_dk, tl.sum(dk, 0),
                 mask=offs_dk < HEAD_DIM)
    tl.store(DK + (head_kv * seq_k + offs_n[:, None]) * HEAD_DIM + offs_dk[None, :], dk.to(DK.dtype.element_ty),
             mask=rows_ok & dk_cols)
    tl.store(DV + (head_kv * seq_k + offs_n[:, None]) * HEAD_DIM + offs_dv[None, :],
             (dv * (dv_unit * 0.002232142857142857)).to(DV.dtype.element_ty),  # 1/448
             mask=rows_ok & (offs_dv[None, :] < HEAD_DIM))


@triton.jit
def _attention_fp8_bwd_dq_inner(dq, q, do, q_scale, do_scale, lse2, delta, k_rows, kt_cols, v_rows, k_scales,
                                v_scales, lo, hi, rows, offs_n, offs_dk, offs_dv, seq_q, seq_k, causal_offset,
                                qk_scale, stride_kt_row,
                                QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
                                BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_N: tl.constexpr,
                                MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Accumulate key tiles [lo, hi) into dQ of the resident query tile; MASKED as in the dK/dV kernel."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(k_rows + cols[:, None] * QK_DIM + offs_dk[None, :], cols, seq_k, offs_dk, QK_DIM, BLOCK_DK,
                       MASKED)
        v = _load_rows(v_rows + cols[:, None] * HEAD_DIM + offs_dv[None, :], cols, seq_k, offs_dv, HEAD_DIM,
                       BLOCK_DV, MASKED)
        k_t = _load_cols(kt_cols + offs_dk[:, None] * stride_kt_row + cols[None, :], cols, seq_k, offs_dk, QK_DIM,
                         BLOCK_DK, MASKED)  # (BLOCK_DK, BLOCK_N)
        k_scale = tl.load(k_scales + start_n // SCALE_N)
        v_scale = tl.load(v_scales + start_n // SCALE_N)
        # stage A: P, recomputed from the FP8 scores, (BLOCK_M, BLOCK_N)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * (q_scale * k_scale * qk_scale) - lse2[:, None])
        if MASKED:  # keys past seq_k and right of the diagonal (rows past seq_q have lse +inf: p = 0)
            visible = cols[None, :] < seq_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + causal_offset)
            p = tl.where(visible, p, 0.0)
        # stage B: dS, quantised per query row, and dQ
        dp = tl.dot(do, tl.trans(v)) * (do_scale * v_scale)
        ds8, ds_scale = _quantize_rows(p * (dp - delta[:, None]))
        dq += tl.dot(ds8, tl.trans(k_t)) * (ds_scale * k_scale)[:, None]
    return dq


@triton.jit(do_not_specialize=["sections"])
def attention_fp8_bwd_dq_kernel(
    Q8, QS, K8, KT8, KS, V8, VS, DO8, DOS, LSE, DELTA, SIGNS, DQ,
    stride_kt_h, stride_kt_row,
    seq_q, seq_k, qk_scale, sm_scale, norm, norm_lo, sections,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_M: tl.constexpr, SCALE_N: tl.constexpr,
    ROTATED: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK_M), H_q, B).
    Tensors and ROTATED as in the dK/dV kernel; KT8: K8 transposed as QT8 is; DQ (B, H_q, seq_q, HEAD_DIM),
    contiguous, rotated back as dK is; sections as in the forward."""
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    heads_q = tl.num_programs(1)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)

    head_q = off_b.to(tl.int64) * heads_q + off_h
    head_kv = off_b.to(tl.int64) * (heads_q // GROUP) + off_h // GROUP
    q = _load_rows(Q8 + (head_q * seq_q + rows[:, None]) * QK_DIM + offs_dk[None, :],
                   rows, seq_q, offs_dk, QK_DIM, BLOCK_DK, not EVEN)
    do = _load_rows(DO8 + (head_q * seq_q + rows[:, None]) * HEAD_DIM + offs_dv[None, :],
                    rows, seq_q, offs_dv, HEAD_DIM, BLOCK_DV, not EVEN)
    scale_tile_m = head_q * tl.cdiv(seq_q, SCALE_M) + start_m // SCALE_M
    q_scale = tl.load(QS + scale_tile_m)
    do_scale = tl.load(DOS + scale_tile_m)
    if EVEN:
        lse2 = tl.load(LSE + head_q * seq_q + rows)
        delta = tl.load(DELTA + head_q * seq_q + rows)
    else:  # rows past seq_q: P = 0
        lse2 = tl.load(LSE + head_q * seq_q + rows, mask=rows < seq_q, other=float("inf"))
        delta = tl.load(DELTA + head_q * seq_q + rows, mask=rows < seq_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)

    causal_offset = seq_k - seq_q
    mid, hi = _query_block_key_range(start_m, seq_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N, EVEN)
    if not EVEN:
        mid = 0
    scale_tiles_k = tl.cdiv(seq_k, SCALE_N)
    args = (q, do, q_scale, do_scale, lse2, delta, K8 + head_kv * seq_k * QK_DIM, KT8 + head_kv * stride_kt_h,
            V8 + head_kv * seq_k * HEAD_DIM, KS + head_kv * scale_tiles_k, VS + head_kv * scale_tiles_k)
    # stage 1: key tiles every row sees, no mask
    dq = _attention_fp8_bwd_dq_inner(dq, *args, 0, mid, rows, offs_n, offs_dk, offs_dv, seq_q, seq_k, causal_offset,
                                     qk_scale, stride_kt_row, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_DV, BLOCK_N, SCALE_N,
                                     False, CAUSAL)
    # stage 2: key tiles crossing the diagonal (all of them when the shape is ragged), masked
    dq = _attention_fp8_bwd_dq_inner(dq, *args, mid, hi, rows, offs_n, offs_dk, offs_dv, seq_q, seq_k, causal_offset,
                                     qk_scale, stride_kt_row, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_DV, BLOCK_N, SCALE_N,
                                     True, CAUSAL)

    dq = dq * sm_scale
    if ROTATED:
        dq = _inverse_rotation(dq, SIGNS, norm, norm_lo, BLOCK_M, BLOCK_DK, QK_DIM)
    tl.store(DQ + (head_q * seq_q + rows[:, None]) * HEAD_DIM + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & (offs_dk[None, :] < HEAD_DIM))


@triton.jit
def _quantize_do_rows(DO, do_offset, o_base, q_base, t_base, DLSE, DELTA, head, rows, scale, seq, stride_don,
                      stride_dod, stride_on, stride_od, stride_qn, stride_qd, stride_tn, stride_td,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, HAS_DLSE: tl.constexpr,
                      SECOND_COPY: tl.constexpr):
    """dO's rows ``rows`` in e4m3 with the tile's ``scale`` (stored in both layouts if SECOND_COPY), and their delta:
    the dequantised rows (the dO8 of dP = dO8 V8^T) dotted with O's, in fp32, minus dlse if HAS_DLSE."""
    offs_d = tl.arange(0, BLOCK_D)
    # read as the tile's amax read them (``_chunked_amax``): the compiler then loads a tile of one chunk once
    x = _prepared_rows(DO, DO, do_offset, 0, rows, seq, stride_don, stride_dod, HEAD_DIM, BLOCK_D, False).to(tl.float32)
    q = _quantize_with_pow2_scale(x, scale)
    _store_copies(q_base, t_base, q, rows, seq, stride_qn, stride_qd, stride_tn, stride_td, CHUNK, BLOCK_D, HEAD_DIM,
                  False, SECOND_COPY)
    o = _load_rows(o_base + rows[:, None] * stride_on + offs_d[None, :] * stride_od, rows, seq, offs_d, HEAD_DIM,
                   BLOCK_D, True).to(tl.float32)
    delta = tl.sum(q.to(tl.float32) * scale * o, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + head * seq + rows, mask=rows < seq, other=0.0).to(tl.float32)
    tl.store(DELTA + head * seq + rows, delta, mask=rows < seq)


@triton.jit
def fp8_bwd_quantize_do_kernel(
    DO, O, DLSE, Q, QT, S, DELTA,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_tb, stride_th, stride_tn, stride_td,
    seq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    HAS_DLSE: tl.constexpr, SECOND_COPY: tl.constexpr,
):
    """One program: one tile of BLOCK_N rows of one (batch, head) of dO. Grid (cdiv(seq, BLOCK_N), H, B).

    dO's quantisation as ``fp8_quantize(do, BLOCK_N, empty_tile_scale=0.0, with_transposed=SECOND_COPY)`` writes it
    (Q, QT, S: the same bytes and scales), and the backward's delta from the same pass: DELTA (B, H, seq) fp32 =
    rowsum(dequantised dO8 * O) - DLSE (HAS_DLSE; DLSE (B, H, seq) contiguous). With the dO8 that dP = dO8 V8^T
    sees, the rows of dS = P (dP - delta) sum closer to zero than with dO's own values, and the separate delta pass
    over O and dO goes. DO, O: any strides. A tile of more than
    CHUNK rows is read twice, chunk by chunk, for its amax and then to quantise."""
    tile, off_h, off_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    head = off_b.to(tl.int64) * tl.num_programs(1) + off_h
    do_offset = off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    t_base = QT + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
    # dO's rows as fp8_quantize reads them without centring or rotation (those operands unused: placeholders)
    amax = _chunked_amax(DO, DO, 0.0, 0.0, 0.0, do_offset, 0, tile, seq, stride_don, stride_dod, 0.0, 0.0, HEAD_DIM,
                         BLOCK_D, BLOCK_N, CHUNK, False, False, "", "")
    scale = _tile_scale(amax, True)
    for c in tl.static_range(0, BLOCK_N, CHUNK):
        rows = tile * BLOCK_N + c + tl.arange(0, CHUNK)
        _quantize_do_rows(DO, do_offset, o_base, q_base, t_base, DLSE, DELTA, head, rows, scale, seq, stride_don,
                          stride_dod, stride_on, stride_od, stride_qn, stride_qd, stride_tn, stride_td, HEAD_DIM,
                          BLOCK_D, CHUNK, HAS_DLSE, SECOND_COPY)
    tl.store(S + head * tl.num_programs(0) + tile, tl.where(amax > 0.0, scale, 0.0))  # an all-zero tile: 0


def quantize_do_and_delta(do: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, block_n: int):
    """(do8, do_scales, do8_t, delta): dO quantised as ``fp8_quantize(do, block_n, empty_tile_scale=0.0,
    with_transposed=True)`` returns it, and delta = rowsum(dO8 * O) - dlse (B, H, N) fp32 with dO8 dequantised, from
    one pass (``fp8_bwd_quantize_do_kernel``; float32 dO takes its transposed copy from a second launch, as
    ``fp8_quantize`` does)."""
    batch, heads, seq, head_dim = do.shape
    sixteen_bit = do.dtype in (torch.float16, torch.bfloat16)
    do8 = torch.empty((batch, heads, seq, head_dim), device=do.device, dtype=torch.float8_e4m3fn)
    do8_t = transposed_e4m3(batch, heads, seq, head_dim, do.device) if sixteen_bit else do8
    scales = torch.empty((batch, heads, cdiv(seq, block_n)), device=do.device, dtype=torch.float32)
    delta = torch.empty((batch, heads, seq), device=do.device, dtype=torch.float32)
    block_d = common.block_d(head_dim)
    dlse_arg = delta if dlse is None else dlse.contiguous()  # without dlse any pointer: HAS_DLSE leaves it unread
    launch_kernel(
        fp8_bwd_quantize_do_kernel, (cdiv(seq, block_n), heads, batch),
        do, out, dlse_arg, do8, do8_t, scales, delta,
        *do.stride(), *out.stride(), *do8.stride(), *do8_t.stride(), seq,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, CHUNK=quant_chunk(block_n, block_d),
        HAS_DLSE=dlse is not None, SECOND_COPY=sixteen_bit)
    if not sixteen_bit:
        do8_t = fp8_quantize(do, block_n, transposed=True)[0]
    return do8, scales, do8_t.transpose(2, 3) if sixteen_bit else do8_t, delta


@on_input_device
def attention_fp8_bwd(do, q, k, v, out, lse, dlse, causal: bool, scale: float, signs=None, k_mean=None,
                      dk_dtype=None, key_sums: bool = False, quantized=None):
    """Launch the FP8 backward. Returns (dq, dk, dv, dk_sums): dq in the inputs' dtype, dk in ``dk_dtype`` (default
    the inputs'), dv in v's, contiguous, each rounded once from the kernels' fp32. With ``signs`` (the forward's rotation) the
    scores' Q and K are rotated, and dq and dk are rotated back inside the kernels. ``key_sums``: dk_sums
    (B, H_kv, cdiv(N_k, BLOCK_N), D) fp32, each dK/dV program's sum of dk over its keys (its fp32 values), so
    that dk's mean over the sequence needs no pass over dk; else None.

    q, do, out: (B, H_q, N_q, D); k, v: (B, H_kv, N_k, D); lse: (B, H_q, N_q) log2-domain fp32 from the FP8
    forward; dlse: the gradient of the natural-log LSE or None. ``signs`` and ``k_mean``: the forward's
    rotation and K smoothing, applied to Q and K as there (``quantize_scores_operands``). ``quantized``: Q and K
    already quantised in this backward's tiles, ``quantize_scores_operands(..., both_layouts=True)``'s (q8,
    q_scales, k8, k_scales, q8_t, k8_t) (the forward's, rotated and smoothed there), or None to quantise q and k
    here; with it q and k are not read (their shapes are do's and v's).
    """
    batch, heads_q, seq_q, head_dim = do.shape
    heads_kv, seq_k = v.shape[1], v.shape[2]
    qk_dim = head_dim if signs is None else signs.numel()
    dq = torch.empty(do.shape, device=do.device, dtype=v.dtype)
    dk = torch.empty(v.shape, device=do.device, dtype=dk_dtype or v.dtype)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    tiles = fp8_bwd_tiles(max(seq_q, seq_k), qk_dim)
    dkdv = tiles["dkdv"]
    dkdv_grid = (cdiv(seq_k, dkdv["BLOCK_N"]), heads_kv, batch)
    dk_sums = dk.new_empty((batch, heads_kv, dkdv_grid[0], head_dim), dtype=torch.float32) if key_sums else None
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None if dk_sums is None else dk_sums.zero_()
    scale_m, scale_n = tiles["SCALE_M"], tiles["SCALE_N"]
    lse = lse.contiguous()
    # Q's and dO's scales set the units of dK and dV: an all-zero tile reports 0, not 1. Q, K and dO are needed
    # in both layouts: one launch each writes both for 16-bit inputs (one read, one rotation; two for float32).
    # Q and K come from the forward where it quantised them in these tiles (``quantized``)
    if quantized is None:
        quantized = quantize_scores_operands(q, k, scale_m, scale_n, signs, k_mean, both_layouts=True)
    else:
        expected = (batch, heads_q, cdiv(seq_q, scale_m)), (batch, heads_kv, cdiv(seq_k, scale_n))
        q8, q_scales, k8, k_scales = quantized[:4]
        if (tuple(q_scales.shape), tuple(k_scales.shape)) != expected or q8.shape[-1] != qk_dim:
            raise ValueError(f"attention_fp8_bwd: quantized Q and K must be in tiles of {scale_m} and {scale_n} rows, "
                             f"{qk_dim} wide: scales of shapes {expected[0]} and {expected[1]}; got "
                             f"{tuple(q_scales.shape)} and {tuple(k_scales.shape)}, q8 {tuple(q8.shape)}")
    q8, q_scales, k8, k_scales, q8_t, k8_t = quantized
    v8, v_scales = fp8_quantize(v, scale_n)
    do8, do_scales, do8_t, delta = quantize_do_and_delta(do, out, dlse, scale_m)  # delta from the dO8 that dP sees
    dv_unit = do_scales.view(batch * heads_kv, -1).amax(dim=1)  # (B * H_kv,): each group's dO scales, contiguous
    group = heads_q // heads_kv
    shared = dict(GROUP=group, QK_DIM=qk_dim, HEAD_DIM=head_dim, BLOCK_DK=fp8_block_d(qk_dim),
                  BLOCK_DV=fp8_block_d(head_dim), CAUSAL=causal,
                  SCALE_M=scale_m, SCALE_N=scale_n, ROTATED=signs is not None)
    signs = lse if signs is None else signs  # a placeholder pointer when not ROTATED
    scalars = (seq_q, seq_k, scale * LOG2E, scale, *split_scale(1.0 / math.sqrt(qk_dim)))
    dq_cfg = tiles["dq"]
    dq_grid = (cdiv(seq_q, dq_cfg["BLOCK_M"]), heads_q, batch)
    # causal launch sections (``masking.causal_sections``): dK/dV streams its group's Q8 and dO8 in both layouts
    # (with LSE and delta), dQ K8 in both layouts and V8
    dkdv_sections = causal_sections(causal, batch * heads_kv, dkdv_grid[0], 1, seq_q,
                                    group * (2 * (qk_dim + head_dim) + 8), do.device)
    dq_sections = causal_sections(causal, batch * heads_q, dq_grid[0], group, seq_k, 2 * qk_dim + head_dim, do.device)
    launch_kernel(
        attention_fp8_bwd_dkdv_kernel, dkdv_grid,
        q8, q8_t, q_scales, k8, k_scales, v8, v_scales, do8, do8_t, do_scales, dv_unit, lse, delta, signs, dk,
        dk if dk_sums is None else dk_sums, dv, q8_t.stride(1), q8_t.stride(2), do8_t.stride(1), do8_t.stride(2),
        *scalars, dkdv_sections, EVEN=seq_q % dkdv["BLOCK_M"] == 0 and seq_k % dkdv["BLOCK_N"] == 0,
        KEY_SUMS=key_sums, **shared, **dkdv)
    launch_kernel(
        attention_fp8_bwd_dq_kernel, dq_grid,
        q8, q_scales, k8, k8_t, k_scales, v8, v_scales, do8, do_scales, lse, delta, signs, dq,
        k8_t.stride(1), k8_t.stride(2), *scalars, dq_sections,
        EVEN=seq_q % dq_cfg["BLOCK_M"] == 0 and seq_k % dq_cfg["BLOCK_N"] == 0, **shared, **dq_cfg)
    return dq, dk, dv, dk_sums
