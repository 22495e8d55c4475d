"""FP8 (e4m3) attention forward: Q K^T and P V on FP8 operands with per-tile scales, fp32 softmax.

Inputs arrive quantised (``quant.py``): Q in tiles of BLOCK_M rows, K and V in tiles of BLOCK_N rows, one
fp32 scale per (batch, head, tile), so a program's Q tile and each K/V tile it loads have exactly one scale.
V is stored transposed, (B, H_kv, D, seq_k) with seq_k contiguous: the K-major layout Hopper's FP8 tensor
cores take for the right operand of P V.

Per key block, in the log2 domain (log2(e) folded into the softmax scale, as in ``attention_fwd``):
    S = (Q8 K8^T) * c,  c = q_scale * k_scale * softmax_scale * log2(e)   fp32 accumulate
    m = running row max;  P448 = exp2(S - m + log2(448)) = 448 P in [0, 448]
    P8 = round_e4m3(P448)                                             fixed scale: 1 maps to e4m3's 448
    acc = acc * alpha + (P8 V8) * v_scale                             in units of 1/448, as l
    l = l * alpha + rowsum(P448)                                      the row sum of the unrounded P
and out = acc / l (the 448 cancels), LSE = m + log2(l / 448) (saved for a backward). c is applied inside
the exponent's FMA (the row max is taken on the unscaled product, times c). Causal key blocks above the
diagonal are skipped, and only blocks that cross it are masked, as in the 16-bit kernel.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .. import hopper as hopper_kernels
from ..common import LOG2E, _load_rows, allocate_outputs, cdiv
from ..hopper.tiles import FP8_SCORES_AMAX, fp8_scores_in_f16
from ..launch import launch_kernel, on_input_device
from ..masking import _query_block_coords, _query_block_key_range, _visible, causal_sections
from .quant import E4M3_MAX, MIN_SCALE, _to_e4m3, fp8_quantize, quantize_scores_operands
from .tiles import fp8_block_d, fp8_config

LOG2_448 = tl.constexpr(8.807354922057604)  # log2(448): P's fixed e4m3 scale, added in the exponent


@triton.jit
def _positive_score_scale(c):
    """c = q_scale * k_scale * qk_scale for qk_scale > 0, at least 2^-126 (``MIN_SCALE``). Tiles of Q and K both
    below ~1e-20 in magnitude make the product underflow to 0 in fp32, and a masked score (-inf) times 0 is NaN.
    Where c is that small every |Q8 K8^T| * c is below 448^2 * 256 * 2^-126 < 2^-100, as with the true c: the same
    probabilities in fp32."""
    return tl.maximum(c, MIN_SCALE)


@triton.jit
def _attention_fp8_fwd_inner(acc, l_i, m_i, q, q_scale, k_base, vt_base, ks_base, vs_base, stride_kn, stride_vtn,
                             lo, hi, offs_m, offs_n, offs_dk, offs_dv, seq_k, causal_offset, qk_scale,
                             QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
                             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                             SCALE_EARLY: tl.constexpr):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i). MASKED: blocks crossing the diagonal or the seq_k tail.
    P, l_i and acc are kept in units of 1/448 (P448 = 448 P), the scale P is cast to e4m3 with."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        tile = start_n // BLOCK_N
        k = _load_rows(k_base + cols[:, None] * stride_kn + offs_dk[None, :], cols, seq_k, offs_dk, QK_DIM, BLOCK_DK,
                       MASKED)
        if MASKED:  # V^T tile (BLOCK_DV, BLOCK_N): keys along columns
            vt = tl.load(vt_base + offs_dv[:, None] * stride_vtn + cols[None, :],
                         mask=(offs_dv[:, None] < HEAD_DIM) & (cols[None, :] < seq_k), other=0.0)
        else:
            vt = tl.load(vt_base + offs_dv[:, None] * stride_vtn + cols[None, :], mask=offs_dv[:, None] < HEAD_DIM,
                         other=0.0)
        # scores: the FP8 product (fp32) times c = both tiles' scales x softmax scale x log2(e). With c > 0 the
        # row max is taken on the raw product and c is applied inside the exponent's FMA below; a scale <= 0
        # (SCALE_EARLY) multiplies first.
        c = q_scale * tl.load(ks_base + tile) * qk_scale
        if not SCALE_EARLY:
            c = _positive_score_scale(c)
        s = tl.dot(q, tl.trans(k))
        if SCALE_EARLY:
            s = s * c
        if MASKED:
            s = tl.where(_visible(offs_m[:, None], cols[None, :], seq_k, causal_offset, CAUSAL), s, float("-inf"))
        if SCALE_EARLY:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
        if MASKED:  # a row with no visible key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        # P448 = exp2(S - m + log2(448)) = 448 P: the e4m3 cast's fixed scale rides in the exponent's offset
        offset = m_new_safe - LOG2_448
        if SCALE_EARLY:
            p = tl.exp2(s - offset[:, None])
        else:
            p = tl.exp2(s * c - offset[:, None])
        alpha = tl.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(_to_e4m3(p), tl.trans(vt))  # (BLOCK_M, BLOCK_DV), fp32
        acc = acc * alpha[:, None] + pv * tl.load(vs_base + tile)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["sections"])
def attention_fp8_fwd_kernel(
    Q8, QS, K8, KS, VT8, VS, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vtb, stride_vth, stride_vtn,
    stride_ob, stride_oh, stride_om, stride_od,
    seq_q, seq_k, qk_scale, sections,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, SCALE_EARLY: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK_M), H_q, B).

    Q8: (B, H_q, seq_q, QK_DIM) e4m3, unit stride on the last dim; QS: (B, H_q, cdiv(seq_q, BLOCK_M)) fp32.
    K8: (B, H_kv, seq_k, QK_DIM) e4m3; KS, VS: (B, H_kv, cdiv(seq_k, BLOCK_N)) fp32.
    VT8: (B, H_kv, HEAD_DIM, seq_k) e4m3 (V transposed, seq_k contiguous). QK_DIM may exceed HEAD_DIM (the
    Hadamard rotation pads Q and K to a power of two). O: (B, H_q, seq_q, HEAD_DIM), any strides.
    LSE: (B, H_q, seq_q) fp32, log2 domain. qk_scale = softmax scale * log2(e).
    """
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    heads_q = tl.num_programs(1)
    heads_kv = heads_q // GROUP

    q = _load_rows(Q8 + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                   + offs_m[:, None] * stride_qm + offs_dk[None, :], offs_m, seq_q, offs_dk, QK_DIM, BLOCK_DK, True)
    q_scale = tl.load(QS + (off_b.to(tl.int64) * heads_q + off_h) * tl.num_programs(0) + pid_m)
    k_base = K8 + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    vt_base = VT8 + off_b.to(tl.int64) * stride_vtb + off_hk.to(tl.int64) * stride_vth
    tiles_k = tl.cdiv(seq_k, BLOCK_N)
    ks_base = KS + (off_b.to(tl.int64) * heads_kv + off_hk) * tiles_k
    vs_base = VS + (off_b.to(tl.int64) * heads_kv + off_hk) * tiles_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    causal_offset = seq_k - seq_q
    mid, hi = _query_block_key_range(start_m, seq_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    # stage 1: off-band, no mask
    acc, l_i, m_i = _attention_fp8_fwd_inner(acc, l_i, m_i, q, q_scale, k_base, vt_base, ks_base, vs_base,
                                             stride_kn, stride_vtn, 0, mid, offs_m, offs_n, offs_dk, offs_dv,
                                             seq_k, causal_offset, qk_scale, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_N,
                                             False, CAUSAL, SCALE_EARLY)
    # stage 2: blocks crossing the diagonal, and the ragged tail of seq_k
    acc, l_i, m_i = _attention_fp8_fwd_inner(acc, l_i, m_i, q, q_scale, k_base, vt_base, ks_base, vs_base,
                                             stride_kn, stride_vtn, mid, hi, offs_m, offs_n, offs_dk, offs_dv,
                                             seq_k, causal_offset, qk_scale, QK_DIM, HEAD_DIM, BLOCK_DK, BLOCK_N,
                                             True, CAUSAL, SCALE_EARLY)

    # epilogue: acc / l (the 448 cancels); rows that saw no key have acc = 0, l = 0 -> output 0, LSE -inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe) - LOG2_448)
    row_ok = offs_m < seq_q
    tl.store(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
             + offs_dv[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM))
    tl.store(LSE + (off_b.to(tl.int64) * heads_q + off_h) * seq_q + offs_m, lse, mask=row_ok)


@on_input_device
def attention_fp8_fwd(q, k, v, causal: bool, scale: float, signs=None, k_mean=None, both_layouts: bool = False,
                      hopper: bool = False):
    """Quantise and launch. Returns (out, lse, (q8, q_scales, k8, k_scales, q8_t, k8_t)): out and lse as
    ``attention_fwd`` (out in q's dtype, LSE log2 fp32), then the quantised Q and K the scores came from
    (``fp8_quantize``'s outputs, in tiles of ``fp8_tiles``), for a backward that recomputes those scores; with
    ``both_layouts`` also their transposed copies and an all-zero Q tile's scale 0 (``quantize_scores_operands``:
    what the FP8 backward reads, where its tiles are these), else q8_t and k8_t None.

    q: (B, H_q, N_q, D), k/v: (B, H_kv, N_k, D), float16/bfloat16, validated by the caller. ``signs`` (D'):
    Q and K are rotated by the Hadamard transform before they are quantised (q8, k8 are (B, H, N, D')), or
    None; ``k_mean`` (B, H_kv, D) float32: subtracted from K first (K smoothing), or None
    (``quantize_scores_operands``). V is never rotated. ``hopper``: run the FP8 Hopper kernel
    (``hopper/fp8_fwd.py``), as ``flashtrain.ops.dispatch`` decided. Where it sums the scores in float16
    (``fp8_scores_in_f16``), Q and K are quantised to FP8_SCORES_AMAX and the kernel applies
    ``f16_softmax_scale(scale)``; the caller passes that scale, so that the result and its backward use one.
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    out, lse, done = allocate_outputs(q, k)
    cfg = fp8_launch_config(q, k)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    qk_dim = head_dim if signs is None else signs.numel()
    hopper = hopper and not done
    quantized = quantize_scores_operands(q, k, block_m, block_n, signs, k_mean, amax_to=scores_amax(hopper, head_dim),
                                         both_layouts=both_layouts)
    if done:
        return out, lse, quantized
    q8, q_scales, k8, k_scales = quantized[:4]
    if hopper:
        # V^T with its keys in the Hopper kernel's P order: (B, H_kv, D, cdiv(N_k, 32) * 32); an all-zero tile's
        # scale 0, so that it never raises the largest V scale that kernel keeps its units within 2^60 of
        # (V_SCALE_SPAN); its own units are then that bound's
        vt8, v_scales = fp8_quantize(v, block_n, transposed=True, mma_key_order=True, empty_tile_scale=0.0)
        hopper_kernels.kernel_module("fp8_fwd").attention_fp8_fwd_hopper(
            q8, q_scales, k8, k_scales, vt8, v_scales, out, lse, causal, scale, block_n)
        return out, lse, quantized
    vt8, v_scales = fp8_quantize(v, block_n, transposed=True)  # (B, H_kv, D, N_k): keys contiguous (K-major)
    grid = (cdiv(seq_q, block_m), heads_q, batch)
    launch_kernel(
        attention_fp8_fwd_kernel, grid,
        q8, q_scales, k8, k_scales, vt8, v_scales, out, lse,
        q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
        vt8.stride(0), vt8.stride(1), vt8.stride(2), *out.stride(),
        seq_q, seq_k, scale * LOG2E,
        causal_sections(causal, batch * heads_q, grid[0], heads_q // heads_kv, seq_k, qk_dim + head_dim, q.device),
        GROUP=heads_q // heads_kv, QK_DIM=qk_dim, HEAD_DIM=head_dim, BLOCK_DK=fp8_block_d(qk_dim),
        BLOCK_DV=fp8_block_d(head_dim), CAUSAL=causal, SCALE_EARLY=scale <= 0, **cfg)
    return out, lse, quantized


def scores_amax(hopper: bool, head_dim: int) -> float:
    """The magnitude Q's and K's tiles are quantised to (``fp8_quantize``'s amax_to): FP8_SCORES_AMAX where the FP8
    Hopper kernel (``hopper``) sums the scores in float16, else 448. fp8="full"'s backward reads those tiles where
    they are its own."""
    return FP8_SCORES_AMAX if hopper and fp8_scores_in_f16(head_dim) else E4M3_MAX


@functools.lru_cache(maxsize=256)
def f16_softmax_scale(scale: float) -> float:
    """The softmax scale the float16 scores apply: scale * log2(e), as the kernel receives it (float32), rounded
    to float16, divided by log2(e) again. Passing it in returns it (the kernel then rounds nothing), so the
    backward can recompute the forward's probabilities with it. Relative change at most 2^-11."""
    # numpy's float32 -> float16 conversion rounds to nearest even, as torch's does (a torch tensor here costs
    # ~10 us of host time a call; cached, as a launch's scale)
    qk16 = float(np.float16(np.float32(scale * LOG2E)))
    return qk16 / LOG2E


def fp8_launch_config(q: torch.Tensor, k: torch.Tensor) -> dict:
    """The FP8 forward's launch parameters for these inputs (its tiles are also the quantisation tiles)."""
    return fp8_config(max(q.shape[2], k.shape[2]), q.shape[3])


def fp8_tiles(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """(rows per Q tile, rows per K/V tile) of the FP8 forward for these inputs: one scale per tile."""
    cfg = fp8_launch_config(q, k)
    return cfg["BLOCK_M"], cfg["BLOCK_N"]
