"""Per-tile FP8 (e4m3) quantisation for the FP8 attention path.

One scale per (batch, head, tile of BLOCK_N rows): scale = amax(|x_tile|) / 448 (448: e4m3's largest finite
value) rounded up to a power of two, q = round_e4m3(x / scale), so x ~= q * scale and the tile's largest
value lands in (224, 448]. e4m3 is a floating-point format, so the power of two costs no relative precision
(only the subnormal floor moves, by at most one binade); in exchange q * scale is exact in bfloat16 (and in
float16 above its subnormal range), which lets the backward of ``fp8="forward"`` recompute exactly the
forward's scores from 16-bit operands. An all-zero tile gets scale 1 (no 0/0) and quantises to zeros. No scale
is below 2^-126 (``MIN_SCALE``), so 1 / scale is finite. Tails (seq not a multiple of BLOCK_N) take the amax of
their valid rows only.

Rounding is to nearest even on the e4m3 grid (3 mantissa bits; spacing 2^-9 below 2^-6, e4m3's subnormals),
the same as torch's ``.to(torch.float8_e4m3fn)``. On the GPU the cast does it (``cvt.rn.satfinite``). Triton's
CPU interpreter's own fp32->e4m3 conversion drops the rounding carry (1.98 -> 1.0), so there ``_to_e4m3``
first rounds onto the e4m3 grid in software and the cast then only meets representable values.

The same kernel can first centre the rows (K smoothing), rotate them (the Hadamard rotation of incoherent
processing, by matmuls with the +-1 matrix: ``_rotated_rows``; whole tiles of width 256 as two column halves,
``_quantize_tile_halves``), and write its output in any layout, such as V transposed for the FP8 forward: one read
of x and one write of its e4m3 bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import common
from ..common import _scale, cdiv, split_scale
from ..launch import INTERPRET, FixedLaunch, kept, launch_kernel, on_input_device, sm_count
from .hadamard import _fwht, check_mean, hadamard, hadamard_matrix, padded_dim
from .tiles import row_pass_rows

E4M3_MAX = 448.0
# What fp8_quantize's amax_to may be: e4m3's largest, or a power of two from 1 to 256
AMAX_TO_CHOICES = frozenset([E4M3_MAX, *(2.0 ** e for e in range(9))])


@triton.jit
def _round_to_e4m3_grid(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even; returned as fp32."""
    # normal range: keep the top 3 of fp32's 23 mantissa bits (round to nearest even on bit 20)
    bits = x.to(tl.int32, bitcast=True)
    negative = bits < 0  # the sign bit: true for -0.0 as well, unlike x < 0
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # -0x100000: clears the low 20 bits
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range (|x| < 2^-6): multiples of 2^-9, rounded on |x| so the sign (of zero too) is kept
    t = tl.abs(x) * 512.0
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)  # halfway: to even
    # times +-1, not negation: Triton's interpreter evaluates -v as 0 - v, which turns -0.0 into +0.0
    sub = r * 0.001953125 * tl.where(negative, -1.0, 1.0)  # 2^-9
    return tl.where(tl.abs(x) < 0.015625, sub, normal)  # 2^-6


# Round in software before the cast only in the interpreter: the GPU's conversion already rounds to nearest
# even, and the software rounding is ~15 integer ops per element in the FP8 kernels' inner loops.
SOFTWARE_ROUNDING = tl.constexpr(INTERPRET)


@triton.jit
def _to_e4m3(x):
    """fp32 x with |x| <= 448 (or NaN) -> float8e4nv, rounded to nearest even, NaN kept NaN (on the GPU and in the
    interpreter, whose own conversion turns NaN into 384 or -384)."""
    if SOFTWARE_ROUNDING:
        q = _round_to_e4m3_grid(x).to(tl.float8e4nv)
        e4m3_nan = tl.full(x.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)  # 0x7F: e4m3fn's NaN
        return tl.where(x != x, e4m3_nan, q)
    return x.to(tl.float8e4nv)


@triton.jit
def _pow2_at_least(x):
    """The smallest power of two >= x, for fp32 x > 0: round the exponent up unless the mantissa is zero."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)  # 0x7F800000: the exponent field


# The smallest scale: fp32's smallest normal value, 2^-126, so that 1 / scale (2^126 at most) and the products of
# scales stay finite. A tile whose amax / 448 falls below it (amax < ~5e-36) is quantised as if its amax were
# larger: its values go to e4m3's subnormals or to zero, where a subnormal scale made 1 / scale infinite and the
# FP8 backward's dK NaN (gradients of ~1e-7 times probabilities of ~2^-100).
MIN_SCALE = tl.constexpr(2.0 ** -126)


@triton.jit
def _tile_scale(amax, POW2_SCALE: tl.constexpr, AMAX_TO: tl.constexpr = 448.0):
    """A tile's scale from its largest magnitude: amax / AMAX_TO (default 448, e4m3's largest finite value),
    at least MIN_SCALE, rounded up to a power of two if POW2_SCALE; 1 for an all-zero tile."""
    if POW2_SCALE:
        return tl.where(amax > 0.0, _pow2_at_least(tl.maximum(amax / AMAX_TO, MIN_SCALE)), 1.0)
    return tl.where(amax > 0.0, tl.maximum(amax / AMAX_TO, MIN_SCALE), 1.0)


@triton.jit
def _quantize_with_pow2_scale(x, scale):
    """fp32 x / scale in e4m3, clamped to e4m3's finite range, for a power-of-two scale: as x times 1 / scale, which
    is exact and equals the quotient (one multiply an element instead of a division's ~3 instructions). A NaN stays
    NaN (and an infinite x, whose tile's scale is infinite, becomes NaN), so non-finite inputs reach the output as
    in the 16-bit path; a clamp that drops NaNs turned them into finite values."""
    return _to_e4m3(tl.clamp(x * (1.0 / scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _in_mma_key_order(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows x (ROWS, BLOCK_D) (ROWS a multiple of 32, rows 32-aligned keys) in the key order of
    ``fp8_quantize(..., mma_key_order=True)``: within each group of 32, key 16h + 8a + 2t + b moves to row
    16h + 4t + 2a + b. An FP8 wgmma's accumulator gives thread t of a quad the score columns 8c + 2t + {0, 1}
    (c = 0..3, per 32 columns), while its A operand takes from that thread the k indices 16h + 4t + {0..3};
    with V's keys in this order the P tile in the accumulator's registers is already the A operand of P V
    (``hopper/fp8_fwd.py``). Moved in registers, so the stores stay contiguous."""
    x = tl.reshape(x, (ROWS // 32, 2, 2, 4, 2, BLOCK_D))  # key = 32g + 16h + 8a + 2t + b: (g, h, a, t, b, d)
    x = tl.permute(x, (0, 1, 3, 2, 4, 5))  # (g, h, t, a, b, d)
    return tl.reshape(x, (ROWS, BLOCK_D))


@triton.jit
def _prepared_rows(X, MEAN, x_base, mean_base, rows, seq, stride_xn, stride_xd,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CENTRE: tl.constexpr):
    """(rows, BLOCK_D) in X's dtype: rows of X, centred if CENTRE with the rounding of ``flashtrain.ops.fp8._centred``
    (the difference in fp32, fp64 for fp64 X, rounded to X's dtype); rows >= seq and columns >= HEAD_DIM are
    zero."""
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows[:, None] < seq
    x = tl.load(X + x_base + rows[:, None] * stride_xn + offs_d[None, :] * stride_xd,
                mask=row_ok & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if CENTRE:
        acc_dtype = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
        mean = tl.load(MEAN + mean_base + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(acc_dtype)
        x = tl.where(row_ok, x.to(acc_dtype) - mean[None, :], 0.0).to(X.dtype.element_ty)
    return x


@triton.jit
def _rotated_rows(x, signs, h_lo, h_hi, norm, norm_lo, mean_rot, row0, seq, R: tl.constexpr, BLOCK_D: tl.constexpr,
                  METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr, CENTRE: tl.constexpr):
    """The rotated rows (x * signs) @ H_d' / sqrt(d') of x (R, BLOCK_D) in the input's dtype, fp32 holding values of
    that dtype (rounded to it as ``hadamard`` writes them). CENTRE (K smoothing): minus ``mean_rot`` (1, BLOCK_D), the
    rotated mean (``_rotated_mean``), before that one rounding, and the rows past ``seq`` (x's rows are those from
    ``row0``) zero: x enters the matmul as loaded, which lets the compiler copy its tiles to shared memory
    asynchronously (as for Q) where a centring before the rotation held them in registers. How the +-1 matrix is
    applied (METHOD, ``rotate_method``):
      "butterfly": ``hadamard``'s log2(d') add/subtract stages on x * signs (fp32);
      "matmul":    one matmul with h_lo = diag(signs) H_d' (``_rotation_operands``; 16 <= d' <= 128);
      "halves":    H_d' = [[H, H], [H, -H]] with H = H_{d'/2}: the row's halves x1, x2 times h_lo = diag(signs_1) H
                   and h_hi = diag(signs_2) H (two matmuls, the products exact in x's dtype), then their sum and
                   difference in fp32 (d' = 256, where H_d' takes 128 KB in bf16 and H_{d'/2} 32 KB).
    The signs live in the matrices, so x enters the tensor core as loaded (no conversions an element). The products
    are exact (values times +-1) and the sums fp32 (fp64 for fp64 x), so every method gives the butterfly's bits
    wherever fp32 holds the sums exactly (16-bit inputs: nearly always)."""
    OUT_DTYPE: tl.constexpr = x.dtype
    acc_dtype: tl.constexpr = tl.float64 if OUT_DTYPE == tl.float64 else tl.float32
    if METHOD == "butterfly":
        y = _fwht(x.to(tl.float32) * signs[None, :], R, BLOCK_D)
    elif METHOD == "halves":
        # [x1, x2] H_d' = [x1 H + x2 H, x1 H - x2 H] (signs in the H's): the sums after the matmuls, whose inputs
        # then stay exact in x's dtype
        x1, x2 = tl.split(tl.permute(tl.reshape(x, (R, 2, BLOCK_D // 2)), (0, 2, 1)))
        y1 = tl.dot(x1, h_lo, input_precision=DOT_PRECISION, out_dtype=acc_dtype)
        y2 = tl.dot(x2, h_hi, input_precision=DOT_PRECISION, out_dtype=acc_dtype)
        y = tl.reshape(tl.permute(tl.join(y1 + y2, y1 - y2), (0, 2, 1)), (R, BLOCK_D))
    else:
        y = tl.dot(x, h_lo, input_precision=DOT_PRECISION, out_dtype=acc_dtype)
    y = _scale(y, norm, norm_lo)
    if CENTRE:
        y = y - mean_rot
        if row0 + R > seq:  # the rows past seq (a last tile's) zero again, at one select an element
            y = tl.where((row0 + tl.arange(0, R) < seq)[:, None], y, 0.0)
    return y.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _rotated_halves(X, mean_lo, mean_hi, h_lo, h_hi, x_base, tile, seq, stride_xn, stride_xd, norm, norm_lo,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    CENTRE: tl.constexpr):
    """``_rotated_rows``'s "halves" for tile ``tile`` (R rows) of X, loaded and returned as two halves: (a, b), the
    first and the second BLOCK_D // 2 columns of the rotated rows, each (R, BLOCK_D // 2) fp32 holding values of X's
    dtype, with the same bits. Each half of x is its own load and enters its matmul from shared memory as loaded, as
    the whole tile does at width 128; loaded as one (R, BLOCK_D) tile, x went through registers to be split, and the
    joined result through a (R, BLOCK_D) layout conversion. ``mean_lo``, ``mean_hi`` (CENTRE): the rotated mean's
    halves (1, BLOCK_D // 2)."""
    HALF: tl.constexpr = BLOCK_D // 2
    OUT_DTYPE: tl.constexpr = X.dtype.element_ty
    rows = tile * R + tl.arange(0, R)
    row_ok = rows[:, None] < seq
    x1 = _prepared_rows(X, X, x_base, 0, rows, seq, stride_xn, stride_xd, HALF, HALF, False)
    # HEAD_DIM > HALF: "halves" rotates widths above 128 only (``rotate_method``)
    x2 = _prepared_rows(X + HALF * stride_xd, X, x_base, 0, rows, seq, stride_xn, stride_xd, HEAD_DIM - HALF, HALF,
                        False)
    # [x1, x2] H_d' = [x1 H + x2 H, x1 H - x2 H], the signs in the H's (``_rotation_operands``)
    y1 = tl.dot(x1, h_lo, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    y2 = tl.dot(x2, h_hi, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    a = _scale(y1 + y2, norm, norm_lo)
    b = _scale(y1 - y2, norm, norm_lo)
    if CENTRE:
        a = a - mean_lo
        b = b - mean_hi
        if (tile + 1) * R > seq:  # the rows past seq (the last tile's) zero again, at one select an element
            a = tl.where(row_ok, a, 0.0)
            b = tl.where(row_ok, b, 0.0)
    return a.to(OUT_DTYPE).to(tl.float32), b.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _quantize_tile_halves(X, MEAN, h_lo, h_hi, q_base, t_base, S, x_base, head, tile, n_tiles, stride_xn,
                          stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq, store_rows, norm, norm_lo,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CENTRE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, ZERO_SCALE_IF_EMPTY: tl.constexpr,
                          SECOND_COPY: tl.constexpr, AMAX_TO: tl.constexpr):
    """``_quantize_tile`` for a whole tile rotated by halves (``_rotated_halves``): the same bytes and scale, the
    tile held and stored as its two column halves. CENTRE: MEAN holds the rotated mean (``_mean_halves``)."""
    mean_lo, mean_hi = _mean_halves(MEAN, head * BLOCK_D, BLOCK_D, CENTRE)
    a, b = _rotated_halves(X, mean_lo, mean_hi, h_lo, h_hi, x_base, tile, seq, stride_xn, stride_xd, norm, norm_lo,
                           HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, CENTRE)
    _store_quantized_halves(a, b, q_base, t_base, S, head, tile, n_tiles, stride_qn, stride_qd, stride_tn, stride_td,
                            store_rows, BLOCK_D, BLOCK_N, ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)


@triton.jit
def _store_quantized_halves(a, b, q_base, t_base, S, head, tile, n_tiles, stride_qn, stride_qd, stride_tn, stride_td,
                            store_rows, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            ZERO_SCALE_IF_EMPTY: tl.constexpr, SECOND_COPY: tl.constexpr, AMAX_TO: tl.constexpr):
    """The second part of ``_quantize_tile_halves``: the rotated halves a, b (BLOCK_N, BLOCK_D // 2) of tile
    ``tile`` (values of the input's dtype, in fp32 or in that dtype) quantised with one scale, stored, and the
    scale stored."""
    HALF: tl.constexpr = BLOCK_D // 2
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(a), 1), 0), tl.max(tl.max(tl.abs(b), 1), 0))
    scale = _tile_scale(amax, True, AMAX_TO)
    qa = _quantize_with_pow2_scale(a, scale)
    qb = _quantize_with_pow2_scale(b, scale)
    _store_copies(q_base, t_base, qa, rows, store_rows, stride_qn, stride_qd, stride_tn, stride_td, BLOCK_N, HALF,
                  HALF, False, SECOND_COPY)
    _store_copies(q_base + HALF * stride_qd, t_base + HALF * stride_td, qb, rows, store_rows, stride_qn, stride_qd,
                  stride_tn, stride_td, BLOCK_N, HALF, HALF, False, SECOND_COPY)
    _store_scale(S, head, n_tiles, tile, scale, amax, ZERO_SCALE_IF_EMPTY)


@triton.jit
def _store_scale(S, head, n_tiles, tile, scale, amax, ZERO_SCALE_IF_EMPTY: tl.constexpr):
    """Store tile ``tile``'s scale; with ZERO_SCALE_IF_EMPTY an all-zero tile (amax 0, quantised with scale 1, to
    zeros) reports scale 0."""
    if ZERO_SCALE_IF_EMPTY:
        scale = tl.where(amax > 0.0, scale, 0.0)
    tl.store(S + head * n_tiles + tile, scale)


@triton.jit
def _quantize_tiles_halves_overlapped(X, MEAN, h_lo, h_hi, q_base, t_base, S, x_base, head, first, last,
                                      n_tiles, stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq,
                                      store_rows, norm, norm_lo, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_N: tl.constexpr, CENTRE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                      ZERO_SCALE_IF_EMPTY: tl.constexpr, SECOND_COPY: tl.constexpr,
                                      AMAX_TO: tl.constexpr):
    """``_quantize_tile_halves`` for tiles [first, last) (first < last), each tile's quantisation and stores one
    step late: a step quantises and stores the tile before, then waits for its own tile's load and rotates it. The
    compiler's pipeline (2 stages) issues the next tile's load at the end of a step, just before the next step
    waits for it; with the stores first in the step, that load is in flight while they run. Rotating and storing
    in the same step, the load and the rest of the step took turns (one program an SM at width 256: 208 KB of
    shared memory). The rotated halves carried between steps are rounded to the input's dtype already (the same
    bits). CENTRE: MEAN holds the rotated mean, whose halves are loaded again each step (``_mean_halves``: 1 KB,
    from L1 after the first step) rather than held: held, they took 64 registers a thread across the loop, and the
    centred kernel spilled 1,944 bytes (sm_90 compile, ptxas -v)."""
    OUT_DTYPE: tl.constexpr = X.dtype.element_ty
    mean_lo, mean_hi = _mean_halves(MEAN, head * BLOCK_D, BLOCK_D, CENTRE)
    a, b = _rotated_halves(X, mean_lo, mean_hi, h_lo, h_hi, x_base, first, seq, stride_xn, stride_xd, norm, norm_lo,
                           HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, CENTRE)
    a = a.to(OUT_DTYPE)
    b = b.to(OUT_DTYPE)
    for tile in tl.range(first + 1, last):
        _store_quantized_halves(a, b, q_base, t_base, S, head, tile - 1, n_tiles, stride_qn, stride_qd, stride_tn,
                                stride_td, store_rows, BLOCK_D, BLOCK_N, ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)
        mean_lo, mean_hi = _mean_halves(MEAN, head * BLOCK_D, BLOCK_D, CENTRE)
        a, b = _rotated_halves(X, mean_lo, mean_hi, h_lo, h_hi, x_base, tile, seq, stride_xn, stride_xd, norm,
                               norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, CENTRE)
        a = a.to(OUT_DTYPE)
        b = b.to(OUT_DTYPE)
    _store_quantized_halves(a, b, q_base, t_base, S, head, last - 1, n_tiles, stride_qn, stride_qd, stride_tn,
                            stride_td, store_rows, BLOCK_D, BLOCK_N, ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)


@triton.jit
def _mean_halves(MEAN, mean_base, BLOCK_D: tl.constexpr, CENTRE: tl.constexpr):
    """If CENTRE, the two halves (1, BLOCK_D // 2) each of the rotated mean MEAN[mean_base:][:BLOCK_D] (fp32, as
    ``fp8_quantize`` passes it to the rotation by halves: ``hadamard(mean, signs)``, the bits of ``_rotated_mean``),
    else placeholders."""
    mean_lo = 0.0
    mean_hi = 0.0
    if CENTRE:
        half = tl.arange(0, BLOCK_D // 2)
        mean_lo = tl.load(MEAN + mean_base + half)[None, :]
        mean_hi = tl.load(MEAN + mean_base + BLOCK_D // 2 + half)[None, :]
    return mean_lo, mean_hi


@triton.jit
def _rotated_mean(MEAN, mean_base, signs, norm, norm_lo, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(1, BLOCK_D) fp32: the mean MEAN[mean_base:][:HEAD_DIM] (fp32, zero-padded) rotated as ``hadamard`` rotates a
    row, by the butterfly in fp32: the bits of ``hadamard(mean, signs)``."""
    offs = tl.arange(0, BLOCK_D)
    mean = tl.load(MEAN + mean_base + offs, mask=offs < HEAD_DIM, other=0.0).to(tl.float32)
    return _scale(_fwht((mean * signs)[None, :], 1, BLOCK_D), norm, norm_lo)


@triton.jit
def _rotation_operands(SIGNS, H, ROTATE: tl.constexpr, METHOD: tl.constexpr, BLOCK_D: tl.constexpr):
    """(signs (BLOCK_D,) fp32, h_lo, h_hi) of the rotation, loaded once per program: for METHOD "matmul" h_lo =
    diag(signs) H_d' (BLOCK_D, BLOCK_D); for "halves" h_lo, h_hi = diag(first, second half of signs) H_{d'/2}
    (BLOCK_D / 2 square each); in H's dtype (the input's), +-1 and so exact. Placeholders where unused."""
    signs = 0.0
    h_lo = 0.0
    h_hi = 0.0
    if ROTATE:
        offs = tl.arange(0, BLOCK_D)
        signs = tl.load(SIGNS + offs).to(tl.float32)
        if METHOD == "matmul":
            h = tl.load(H + offs[:, None] * BLOCK_D + offs[None, :])
            h_lo = (h * signs[:, None]).to(h.dtype)
        elif METHOD == "halves":
            half = tl.arange(0, BLOCK_D // 2)
            h = tl.load(H + half[:, None] * (BLOCK_D // 2) + half[None, :])
            signs_lo = tl.load(SIGNS + half).to(tl.float32)
            signs_hi = tl.load(SIGNS + BLOCK_D // 2 + half).to(tl.float32)
            h_lo = (h * signs_lo[:, None]).to(h.dtype)
            h_hi = (h * signs_hi[:, None]).to(h.dtype)
    return signs, h_lo, h_hi


@triton.jit
def _quant_rows(X, centring, signs, h_lo, h_hi, x_base, mean_base, row0, seq, stride_xn, stride_xd, norm, norm_lo,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, CENTRE: tl.constexpr,
                ROTATE: tl.constexpr, METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(CHUNK, BLOCK_D) fp32: what gets quantised of the CHUNK rows from ``row0``: ``_prepared_rows``, or if ROTATE
    the rows rotated (``_rotated_rows``). ``centring`` (with CENTRE): the MEAN pointer without ROTATE, the rotated
    mean (1, BLOCK_D) with it."""
    rows = row0 + tl.arange(0, CHUNK)
    if ROTATE:
        x = _prepared_rows(X, X, x_base, mean_base, rows, seq, stride_xn, stride_xd, HEAD_DIM, BLOCK_D, False)
        y = _rotated_rows(x, signs, h_lo, h_hi, norm, norm_lo, centring, row0, seq, CHUNK, BLOCK_D, METHOD,
                          DOT_PRECISION, CENTRE)
    else:  # (an if/else: the compiler reads past a return in a constexpr branch)
        y = _prepared_rows(X, centring, x_base, mean_base, rows, seq, stride_xn, stride_xd, HEAD_DIM, BLOCK_D,
                           CENTRE).to(tl.float32)
    return y


@triton.jit
def _chunked_amax(X, centring, signs, h_lo, h_hi, x_base, mean_base, tile, seq, stride_xn, stride_xd, norm, norm_lo,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                  CENTRE: tl.constexpr, ROTATE: tl.constexpr, METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The largest magnitude of tile ``tile`` (rows [tile * BLOCK_N, + BLOCK_N)) as ``_quant_rows`` gives its rows,
    read CHUNK rows at a time: the first of the two reads of a tile too large for the registers."""
    amax = 0.0
    for c in tl.static_range(0, BLOCK_N, CHUNK):
        x = _quant_rows(X, centring, signs, h_lo, h_hi, x_base, mean_base, tile * BLOCK_N + c, seq, stride_xn,
                        stride_xd, norm, norm_lo, HEAD_DIM, BLOCK_D, CHUNK, CENTRE, ROTATE, METHOD, DOT_PRECISION)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), 1), 0))
    return amax


@triton.jit
def _store_rows(q_base, q, rows, store_rows, stride_qn, stride_qd, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
                OUT_DIM: tl.constexpr, MMA_KEY_ORDER: tl.constexpr):
    """Store the e4m3 rows q (CHUNK, BLOCK_D) of one tile at rows ``rows``: those < store_rows, columns < OUT_DIM;
    with MMA_KEY_ORDER permuted first (``_in_mma_key_order``)."""
    if MMA_KEY_ORDER:
        q = _in_mma_key_order(q, CHUNK, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(q_base + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd, q,
             mask=(rows[:, None] < store_rows) & (offs_d[None, :] < OUT_DIM))


@triton.jit
def _store_copies(q_base, t_base, q, rows, store_rows, stride_qn, stride_qd, stride_tn, stride_td,
                  CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, OUT_DIM: tl.constexpr, MMA_KEY_ORDER: tl.constexpr,
                  SECOND_COPY: tl.constexpr):
    """``_store_rows`` into Q (stride_q*), and if SECOND_COPY the same rows into QT (stride_t*, not permuted)."""
    _store_rows(q_base, q, rows, store_rows, stride_qn, stride_qd, CHUNK, BLOCK_D, OUT_DIM, MMA_KEY_ORDER)
    if SECOND_COPY:
        _store_rows(t_base, q, rows, store_rows, stride_tn, stride_td, CHUNK, BLOCK_D, OUT_DIM, False)


@triton.jit
def _quantize_tile(X, centring, signs, h_lo, h_hi, q_base, t_base, S, x_base, head, tile, n_tiles, stride_xn, stride_xd,
                   stride_qn, stride_qd, stride_tn, stride_td, seq, store_rows, norm, norm_lo,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                   CENTRE: tl.constexpr, ROTATE: tl.constexpr, METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   ZERO_SCALE_IF_EMPTY: tl.constexpr, MMA_KEY_ORDER: tl.constexpr, SECOND_COPY: tl.constexpr,
                   AMAX_TO: tl.constexpr):
    """Quantise tile ``tile`` (rows [tile * BLOCK_N, + BLOCK_N)) of one (batch, head) and store its scale;
    ``centring`` as ``_quant_rows``'."""
    OUT_DIM: tl.constexpr = BLOCK_D if ROTATE else HEAD_DIM
    if CHUNK == BLOCK_N:  # the whole tile in registers: one read
        x = _quant_rows(X, centring, signs, h_lo, h_hi, x_base, head * HEAD_DIM, tile * BLOCK_N, seq, stride_xn,
                        stride_xd, norm, norm_lo, HEAD_DIM, BLOCK_D, CHUNK, CENTRE, ROTATE, METHOD, DOT_PRECISION)
        _store_quantized_tile(x, q_base, t_base, S, head, tile, n_tiles, stride_qn, stride_qd, stride_tn, stride_td,
                              store_rows, BLOCK_D, BLOCK_N, OUT_DIM, ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER, SECOND_COPY,
                              AMAX_TO)
    else:
        amax = _chunked_amax(X, centring, signs, h_lo, h_hi, x_base, head * HEAD_DIM, tile, seq, stride_xn, stride_xd,
                             norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK, CENTRE, ROTATE, METHOD, DOT_PRECISION)
        scale = _tile_scale(amax, True, AMAX_TO)
        for c in tl.static_range(0, BLOCK_N, CHUNK):
            rows = tile * BLOCK_N + c + tl.arange(0, CHUNK)
            x = _quant_rows(X, centring, signs, h_lo, h_hi, x_base, head * HEAD_DIM, tile * BLOCK_N + c, seq,
                            stride_xn, stride_xd, norm, norm_lo, HEAD_DIM, BLOCK_D, CHUNK, CENTRE, ROTATE, METHOD,
                            DOT_PRECISION)
            q = _quantize_with_pow2_scale(x, scale)
            _store_copies(q_base, t_base, q, rows, store_rows, stride_qn, stride_qd, stride_tn, stride_td, CHUNK,
                          BLOCK_D, OUT_DIM, MMA_KEY_ORDER, SECOND_COPY)
        _store_scale(S, head, n_tiles, tile, scale, amax, ZERO_SCALE_IF_EMPTY)


@triton.jit
def _store_quantized_tile(x, q_base, t_base, S, head, tile, n_tiles, stride_qn, stride_qd, stride_tn, stride_td,
                          store_rows, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DIM: tl.constexpr,
                          ZERO_SCALE_IF_EMPTY: tl.constexpr, MMA_KEY_ORDER: tl.constexpr, SECOND_COPY: tl.constexpr,
                          AMAX_TO: tl.constexpr):
    """The rows x (BLOCK_N, BLOCK_D) of tile ``tile`` (what ``_quant_rows`` gives, in fp32 or in the input's dtype)
    quantised with one scale, stored, and the scale stored."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    x = x.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    scale = _tile_scale(amax, True, AMAX_TO)
    q = _quantize_with_pow2_scale(x, scale)
    _store_copies(q_base, t_base, q, rows, store_rows, stride_qn, stride_qd, stride_tn, stride_td, BLOCK_N, BLOCK_D,
                  OUT_DIM, MMA_KEY_ORDER, SECOND_COPY)
    _store_scale(S, head, n_tiles, tile, scale, amax, ZERO_SCALE_IF_EMPTY)


@triton.jit
def _quantize_tiles_overlapped(X, centring, signs, h_lo, h_hi, q_base, t_base, S, x_base, head, first, last, n_tiles,
                               stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq, store_rows, norm,
                               norm_lo, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                               CENTRE: tl.constexpr, METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               ZERO_SCALE_IF_EMPTY: tl.constexpr, MMA_KEY_ORDER: tl.constexpr,
                               SECOND_COPY: tl.constexpr, AMAX_TO: tl.constexpr):
    """``_quantize_tile`` for whole rotated tiles [first, last) (first < last), each tile quantised and stored one
    step late, as ``_quantize_tiles_halves_overlapped`` does for tiles rotated by halves."""
    OUT_DTYPE: tl.constexpr = X.dtype.element_ty
    x = _quant_rows(X, centring, signs, h_lo, h_hi, x_base, head * HEAD_DIM, first * BLOCK_N, seq, stride_xn,
                    stride_xd, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE, True, METHOD,
                    DOT_PRECISION).to(OUT_DTYPE)
    for tile in tl.range(first + 1, last):
        _store_quantized_tile(x, q_base, t_base, S, head, tile - 1, n_tiles, stride_qn, stride_qd, stride_tn,
                              stride_td, store_rows, BLOCK_D, BLOCK_N, BLOCK_D, ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER,
                              SECOND_COPY, AMAX_TO)
        x = _quant_rows(X, centring, signs, h_lo, h_hi, x_base, head * HEAD_DIM, tile * BLOCK_N, seq, stride_xn,
                        stride_xd, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE, True, METHOD,
                        DOT_PRECISION).to(OUT_DTYPE)
    _store_quantized_tile(x, q_base, t_base, S, head, last - 1, n_tiles, stride_qn, stride_qd, stride_tn, stride_td,
                          store_rows, BLOCK_D, BLOCK_N, BLOCK_D, ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER, SECOND_COPY,
                          AMAX_TO)


@triton.jit
def fp8_quantize_kernel(
    X, MEAN, SIGNS, H, Q, QT, S,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_tb, stride_th, stride_tn, stride_td,
    seq, store_rows, norm, norm_lo,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr,
    CENTRE: tl.constexpr, ROTATE: tl.constexpr, METHOD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ZERO_SCALE_IF_EMPTY: tl.constexpr, MMA_KEY_ORDER: tl.constexpr, SECOND_COPY: tl.constexpr,
    AMAX_TO: tl.constexpr, OVERLAP: tl.constexpr = False,
):
    """One program: TILES consecutive tiles of BLOCK_N rows of one (batch, head). Grid
    (cdiv(cdiv(seq, BLOCK_N), TILES), H, B).

    X: (B, H, seq, HEAD_DIM), any strides and float dtype. Q: (B, H, seq, D_out) float8_e4m3fn with the given
    strides (a transposed layout is a view with stride_qn 1), D_out = BLOCK_D if ROTATE else HEAD_DIM.
    S: (B, H, cdiv(seq, BLOCK_N)) float32, contiguous. CENTRE: subtract MEAN (B, H, HEAD_DIM) fp32 first (the
    rotation by halves: MEAN (B, H, BLOCK_D) is the rotated mean, subtracted after the rotation).
    ROTATE: then the Hadamard rotation (``hadamard``'s forward: SIGNS (BLOCK_D,), (norm, norm_lo)
    1/sqrt(BLOCK_D) split), applied by METHOD with the +-1 matrix at H (``_rotated_rows``), both loaded once
    per program. A tile of more than CHUNK rows is read twice, chunk by chunk, once for its amax and once to
    quantise (the second read mostly from L2), so that registers hold CHUNK rows and not the whole tile.
    ZERO_SCALE_IF_EMPTY: an all-zero tile's scale is stored as 0 instead of 1. Rows [0, store_rows) of Q are
    written (store_rows >= seq; rows past seq as zeros); MMA_KEY_ORDER: in the order of ``_in_mma_key_order``
    (CHUNK and store_rows multiples of 32). SECOND_COPY: the same e4m3 rows are also stored through QT's
    strides (stride_t*: another layout of Q's shape, such as the transposed one), without MMA_KEY_ORDER.
    AMAX_TO: each tile's largest magnitude lands in (AMAX_TO / 2, AMAX_TO] (``_tile_scale``). OVERLAP (TILES > 1,
    whole rotated tiles): each tile quantised and stored one step late, under the next tile's load; the same
    bytes.
    """
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    head = off_b.to(tl.int64) * tl.num_programs(1) + off_h
    x_base = off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    t_base = QT + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
    n_tiles = tl.cdiv(seq, BLOCK_N)
    signs, h_lo, h_hi = _rotation_operands(SIGNS, H, ROTATE, METHOD, BLOCK_D)
    # whole tiles rotated by halves go as two column halves (``_quantize_tile_halves``)
    HALVES: tl.constexpr = METHOD == "halves" and CHUNK == BLOCK_N
    centring = MEAN
    # K smoothing after the rotation: the rotated mean. The rotation by halves reads it from MEAN, rotated before
    # the launch (``fp8_quantize``); whole tiles load its halves tile by tile (``_mean_halves``). The other
    # methods rotate MEAN here, once a program.
    if ROTATE and CENTRE and not HALVES:
        if METHOD == "halves":
            centring = tl.load(MEAN + head * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
        else:
            centring = _rotated_mean(MEAN, head * HEAD_DIM, signs, norm, norm_lo, HEAD_DIM, BLOCK_D)
    if TILES == 1:
        if HALVES:
            _quantize_tile_halves(X, MEAN, h_lo, h_hi, q_base, t_base, S, x_base, head, tl.program_id(0), n_tiles,
                                  stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq,
                                  store_rows, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE, DOT_PRECISION,
                                  ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)
        else:
            _quantize_tile(X, centring, signs, h_lo, h_hi, q_base, t_base, S, x_base, head, tl.program_id(0), n_tiles,
                           stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq, store_rows, norm,
                           norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK, CENTRE, ROTATE, METHOD, DOT_PRECISION,
                           ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER, SECOND_COPY, AMAX_TO)
    elif OVERLAP:  # each tile's stores one step late, under the next tile's load
        first = tl.program_id(0) * TILES
        last = tl.minimum(first + TILES, n_tiles)
        if HALVES:
            _quantize_tiles_halves_overlapped(X, MEAN, h_lo, h_hi, q_base, t_base, S, x_base, head, first,
                                              last, n_tiles, stride_xn, stride_xd, stride_qn, stride_qd, stride_tn,
                                              stride_td, seq, store_rows, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N,
                                              CENTRE, DOT_PRECISION, ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)
        else:
            _quantize_tiles_overlapped(X, centring, signs, h_lo, h_hi, q_base, t_base, S, x_base, head, first, last,
                                       n_tiles, stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq,
                                       store_rows, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE, METHOD,
                                       DOT_PRECISION, ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER, SECOND_COPY, AMAX_TO)
    else:  # a loop, so that the compiler's pipelining loads the next tile while this one is rotated
        first = tl.program_id(0) * TILES
        for tile in tl.range(first, tl.minimum(first + TILES, n_tiles)):
            if HALVES:
                _quantize_tile_halves(X, MEAN, h_lo, h_hi, q_base, t_base, S, x_base, head, tile, n_tiles,
                                      stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq,
                                      store_rows, norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE, DOT_PRECISION,
                                      ZERO_SCALE_IF_EMPTY, SECOND_COPY, AMAX_TO)
            else:
                _quantize_tile(X, centring, signs, h_lo, h_hi, q_base, t_base, S, x_base, head, tile, n_tiles,
                               stride_xn, stride_xd, stride_qn, stride_qd, stride_tn, stride_td, seq, store_rows,
                               norm, norm_lo, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK, CENTRE, ROTATE, METHOD,
                               DOT_PRECISION, ZERO_SCALE_IF_EMPTY, MMA_KEY_ORDER, SECOND_COPY, AMAX_TO)


# docs/tuning.md has the measurements behind each of these.
QUANT_CHUNK_ELEMENTS = 16384  # fp32 elements of a chunk of rows held in registers at 4 warps: no spills on sm_90
WHOLE_TILE_WARPS = 8  # unrotated 16-bit tiles up to 2 chunks are read whole at 8 warps: one read instead of two
ROTATE_CHUNK_ELEMENTS = 16384  # rotated tiles: the elements of a chunk of rows
# Whole tiles rotated by a matmul: tiles a program (the +-1 matrix loaded once) and the pipeline's stages; eight
# a program where every SM gets at least seven tiles
ROTATE_TILES_PER_PROGRAM = 4
ROTATE_STAGES = 2
ROTATE_TILES_PER_PROGRAM_LARGE = 8
# The rotation by halves (width 256): rows a chunk, tiles a program, warps and stages (3 stages exceed an SM's
# shared memory)
HALVES_LAUNCH = dict(CHUNK=128, TILES=4, num_warps=8, num_stages=2)


def rotate_method(dim: int) -> str:
    """How ``fp8_quantize`` applies a fused rotation of width ``dim`` (``_rotated_rows``): a matmul up to 128,
    two matmuls with the half-width matrix at 256, the butterfly below 16 (Triton's matmuls reduce over at least
    16)."""
    if dim < 16:
        return "butterfly"
    return "matmul" if dim <= 128 else "halves"


def quant_chunk(block_n: int, block_d: int, rotate: bool = False) -> int:
    """Rows of a (block_n, block_d) tile the quantisation kernel reads at a time (its CHUNK); at least 16 when
    rotating (a matmul's rows; block_n >= 16)."""
    if rotate:
        return min(block_n, max(16, ROTATE_CHUNK_ELEMENTS // block_d))
    return max(1, min(block_n, QUANT_CHUNK_ELEMENTS // block_d))


def quant_launch(block_n: int, block_d: int, rotate: bool, element_size: int = 2, second_copy: bool = False) -> dict:
    """The quantisation kernel's METHOD, CHUNK and TILES and its num_warps and num_stages for tiles of (block_n,
    block_d) of ``element_size``-byte inputs: what ``fp8_quantize`` launches and scripts/dev/compile_kernels.py
    compiles. Several tiles a program only where whole tiles are rotated by a matmul, 16-bit ones stored one step
    late, under the next tile's load (OVERLAP: the carried tile would spill 32-bit ones); unrotated
    16-bit (128, 256) tiles whole at 8 warps unless ``second_copy`` (the transposed copy too; WHOLE_TILE_WARPS); 4
    warps and num_stages 3 (Triton's defaults) elsewhere. The butterfly rotates 32-bit inputs at width 256 and 64-bit
    ones at every width: there the matrices and pipelined tiles would take 270-526 KB of shared memory (sm_90
    compile, 128-row tiles), over the 227 KB of an SM (fp32 at width 128: 197 KB, centred)."""
    method = rotate_method(block_d) if rotate else "butterfly"
    if method != "butterfly" and (element_size > 4 or (element_size > 2 and method == "halves")):
        method = "butterfly"
    if method == "halves":
        chunk = min(block_n, HALVES_LAUNCH["CHUNK"])
        tiles = HALVES_LAUNCH["TILES"] if chunk == block_n else 1
        return dict(METHOD=method, CHUNK=chunk, TILES=tiles, num_warps=HALVES_LAUNCH["num_warps"],
                    num_stages=HALVES_LAUNCH["num_stages"], OVERLAP=tiles > 1)
    chunk = quant_chunk(block_n, block_d, rotate)
    if (not rotate and not second_copy and element_size <= 2 and chunk < block_n
            and block_n * block_d <= 2 * QUANT_CHUNK_ELEMENTS):
        # whole tiles at 8 warps (WHOLE_TILE_WARPS): one read of the tile instead of two
        return dict(METHOD=method, CHUNK=block_n, TILES=1, num_warps=WHOLE_TILE_WARPS, num_stages=3)
    tiles = ROTATE_TILES_PER_PROGRAM if rotate and method == "matmul" and chunk == block_n else 1
    return dict(METHOD=method, CHUNK=chunk, TILES=tiles, num_warps=4,
                num_stages=ROTATE_STAGES if tiles > 1 else 3,
                OVERLAP=tiles > 1 and element_size <= 2)


def transposed_e4m3(batch: int, heads: int, rows: int, dim: int, device) -> torch.Tensor:
    """An uninitialised e4m3 (B, H, rows, dim) tensor whose rows are contiguous: the view of a (B, H, dim, row
    stride) buffer, the row stride ``rows`` rounded up to a multiple of 16 (bytes: the layout TMA loads)."""
    padded = torch.empty((batch, heads, dim, cdiv(rows, 16) * 16), device=device, dtype=torch.float8_e4m3fn)
    return padded[..., :rows].transpose(2, 3)


@on_input_device
def fp8_quantize(x: torch.Tensor, block_n: int, *, mean: torch.Tensor | None = None,
                 signs: torch.Tensor | None = None, transposed: bool = False, empty_tile_scale: float = 1.0,
                 mma_key_order: bool = False, with_transposed: bool = False, amax_to: float = E4M3_MAX):
    """Quantise x (B, H, N, D) to e4m3 with one fp32 scale per tile of ``block_n`` rows.

    Returns (q, scales): q (B, H, N, D) float8_e4m3fn, contiguous; scales (B, H, cdiv(N, block_n)) float32,
    with x ~= q.float() * scales repeated over each tile's rows. ``mean`` (B, H, D) float32: subtracted
    first, the difference rounded to x's dtype (K smoothing; the bits of ``flashtrain.ops.fp8._centred``).
    ``signs`` (D',): the Hadamard rotation first, fused: q is (B, H, N, D') and holds
    ``fp8_quantize(hadamard(x, signs, mean=mean), block_n)`` (the rotation's sums in another order: the same
    bits wherever fp32 holds them exactly); with ``mean`` too, the rotated rows minus the rotated mean, in fp32,
    rounded once to x's dtype (the centring after the rotation: the same in exact arithmetic). ``transposed``: q is
    returned as (B, H, D, N), N contiguous, its row stride padded to a multiple of 16 bytes (the layout TMA loads; a
    view of the first N columns).
    ``empty_tile_scale``: the scale reported for an all-zero tile, 1.0 (default: dividing by it is safe) or 0.0
    (the FP8 backward's running units must not take an empty tile's scale as a magnitude).
    ``mma_key_order`` (with ``transposed``; ``block_n`` a multiple of 32): q is (B, H, D, cdiv(N, 32) * 32) with
    the N rows (keys) permuted within each group of 32 (``_in_mma_key_order``) and the padding keys zero: V as
    the FP8 Hopper forward reads it.
    ``with_transposed`` (not with ``transposed``): returns (q, scales, q_t), q_t the same bytes in the layout of
    ``transposed=True``, from the same launch for 16-bit x (one read of x and one rotation for both copies, as
    the FP8 backward needs them; two launches for float32 x).
    ``amax_to``: the magnitude a tile's largest value is scaled to, in (amax_to / 2, amax_to]: 448 (default, e4m3's
    largest) or a power of two from 1 to 256. A smaller one bounds the products of two quantised values (the FP8
    Hopper forward sums Q8 K8^T in float16 with Q and K at 16: ``hopper.tiles.FP8_SCORES_AMAX``); e4m3's subnormals
    then start at amax / (64 * amax_to) instead of amax / 28672.
    """
    rotate = signs is not None
    plan = _quantize_plan(tuple(x.shape), x.stride(), x.dtype, x.device, block_n, mean is not None,
                          tuple(signs.shape) if rotate else None, transposed, empty_tile_scale, mma_key_order,
                          with_transposed, amax_to)
    check_mean("fp8_quantize", mean, (*x.shape[:2], x.shape[3]))
    if plan is None:
        # two launches: one storing both layouts wrote wrong bytes into one of them for float32 x on the H200
        # (triton 3.6, 16-bit x right), and the interpreter's bytes were right throughout
        q, scales = fp8_quantize(x, block_n, mean=mean, signs=signs, empty_tile_scale=empty_tile_scale,
                                 amax_to=amax_to)
        return q, scales, fp8_quantize(x, block_n, mean=mean, signs=signs, transposed=True, amax_to=amax_to)[0]
    q, q_t, scales = plan.outputs(x.device)
    if plan.launch is not None:
        if plan.rotates_mean:
            # the rotation by halves subtracts the rotated mean as given: rotated here, once (the bits of the
            # kernel's ``_rotated_mean``), where the kernel would redo it for every tile (``_mean_halves``)
            mean = hadamard(mean, signs)
        plan.launch(x, x if mean is None else mean.contiguous(), signs.to(x.device) if rotate else x,
                    x if plan.matrix is None else plan.matrix, q, q_t, scales)
    if with_transposed:
        return q, scales, q_t.transpose(2, 3)
    return (q.transpose(2, 3) if transposed else q), scales


class _QuantizePlan(NamedTuple):
    """What ``fp8_quantize`` does for one signature of its arguments (``_quantize_plan``)."""
    shape: tuple  # q's (B, H, N, D_out)
    store_rows: int  # rows of the transposed layouts (N, or N rounded up to 32 in the MMA key order)
    n_tiles: int
    transposed: bool
    with_transposed: bool
    launch: FixedLaunch | None  # None: nothing to quantise
    rotates_mean: bool  # the mean is rotated before the launch (the rotation by halves)
    matrix: torch.Tensor | None  # the +-1 matrix the rotation reads (``rotation_matrix``)

    def outputs(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, q_t, scales), uninitialised: q (B, H, N, D_out) e4m3, row-major or, with ``transposed``, the view
        of ``transposed_e4m3``; q_t that second layout with ``with_transposed``, else q; scales (B, H, n_tiles)."""
        batch, heads, seq, out_dim = self.shape
        if self.transposed:
            q = transposed_e4m3(batch, heads, self.store_rows, out_dim, device)
        else:
            q = torch.empty(self.shape, device=device, dtype=torch.float8_e4m3fn)
        q_t = transposed_e4m3(batch, heads, self.store_rows, out_dim, device) if self.with_transposed else q
        return q, q_t, torch.empty((batch, heads, self.n_tiles), device=device, dtype=torch.float32)


@kept
def _quantize_plan(shape: tuple, strides: tuple, dtype: torch.dtype, device: torch.device, block_n: int, centre: bool,
                   signs_shape: tuple | None, transposed: bool, empty_tile_scale: float, mma_key_order: bool,
                   with_transposed: bool, amax_to: float) -> _QuantizePlan | None:
    """``fp8_quantize``'s checks of its arguments and its launch for one signature of them, once (its Python took
    28-55 us of host time a call on a 2-core x86 host, the launch's keying included). None: float32 or float64 x
    with ``with_transposed``, quantised by two calls."""
    if amax_to not in AMAX_TO_CHOICES:
        raise ValueError(f"fp8_quantize: amax_to={amax_to!r}; expected 448.0 or a power of two from 1 to 256")
    if with_transposed and (transposed or mma_key_order):
        raise ValueError(f"fp8_quantize: with_transposed=True returns the row-major q and a transposed copy; "
                         f"got transposed={transposed!r}, mma_key_order={mma_key_order!r} with it")
    if with_transposed and dtype not in (torch.float16, torch.bfloat16):
        return None
    if empty_tile_scale not in (0.0, 1.0):
        raise ValueError(f"fp8_quantize: empty_tile_scale={empty_tile_scale!r}; expected 1.0 or 0.0")
    if mma_key_order and not (transposed and block_n % 32 == 0):
        raise ValueError(f"fp8_quantize: mma_key_order=True needs transposed=True and block_n a multiple of 32; "
                         f"got transposed={transposed!r}, block_n={block_n}")
    if len(shape) != 4:
        raise ValueError(f"fp8_quantize: x must be 4-D (batch, heads, seq, head_dim); got shape {shape}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"fp8_quantize: block_n={block_n}; expected a power of two >= 16")
    batch, heads, seq, head_dim = shape
    rotate = signs_shape is not None
    out_dim = head_dim
    if rotate:
        out_dim = padded_dim(head_dim)
        if out_dim > 256:
            raise ValueError(f"fp8_quantize: the rotation of head_dim {head_dim} is {out_dim} wide; at most 256")
        if signs_shape != (out_dim, ):
            raise ValueError(f"fp8_quantize: signs has shape {signs_shape}; expected ({out_dim},) for "
                             f"head_dim {head_dim}")
    store_rows = cdiv(seq, 32) * 32 if mma_key_order else seq
    n_tiles = cdiv(seq, block_n)
    plan = _QuantizePlan((batch, heads, seq, out_dim), store_rows, n_tiles, transposed, with_transposed, None, False,
                         None)
    if not batch * heads * seq * out_dim:
        return plan
    block_d = out_dim if rotate else common.block_d(head_dim)
    launch = quant_launch(block_n, block_d, rotate, dtype.itemsize, with_transposed)
    if launch["TILES"] > 1 and device.type == "cuda" and batch * heads * n_tiles >= 7 * sm_count(device):
        launch["TILES"] = ROTATE_TILES_PER_PROGRAM_LARGE
    q, q_t, _ = plan.outputs("meta")  # the strides the outputs will have
    fixed = FixedLaunch(
        fp8_quantize_kernel, (cdiv(n_tiles, launch["TILES"]), heads, batch),
        (*strides, *q.stride(), *q_t.stride(), seq, store_rows, *split_scale(1.0 / math.sqrt(block_d))),
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, CENTRE=centre, ROTATE=rotate,
             DOT_PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32",
             ZERO_SCALE_IF_EMPTY=empty_tile_scale == 0.0, MMA_KEY_ORDER=mma_key_order, SECOND_COPY=with_transposed,
             AMAX_TO=float(amax_to), **launch))
    return plan._replace(launch=fixed, rotates_mean=centre and launch["METHOD"] == "halves",
                         matrix=rotation_matrix(launch["METHOD"], block_d, dtype, device))


def rotation_matrix(method: str, block_d: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The +-1 matrix the quantisation kernel's rotation METHOD reads (``_rotated_rows``), of ``dtype`` (the
    input's), or None where it reads none (the butterfly)."""
    if method == "matmul":
        return hadamard_matrix(block_d, dtype, device)
    if method == "halves":
        return hadamard_matrix(block_d // 2, dtype, device)
    return None


def quantize_scores_operands(q, k, block_q: int, block_k: int, signs=None, k_mean=None, amax_to: float = E4M3_MAX,
                             both_layouts: bool = False):
    """(q8, q_scales, k8, k_scales, q8_t, k8_t): Q and K as FP8 scores take them. With ``signs`` (D'), both go
    through the Hadamard rotation first (q8, k8 then (B, H, N, D')); with ``k_mean`` (B, H_kv, D) float32, K is
    centred before (K smoothing), inside the quantisation kernel. ``amax_to``: as ``fp8_quantize``'s, for both.
    ``both_layouts``: also the transposed copies q8_t, k8_t (``fp8_quantize``'s with_transposed: (B, H, D', N)
    views, N contiguous), and an all-zero Q tile's scale 0 (the FP8 backward's dK units must not take it for a
    magnitude): what the FP8 backward reads; else q8_t and k8_t are None."""
    if not both_layouts:
        return (*fp8_quantize(q, block_q, signs=signs, amax_to=amax_to),
                *fp8_quantize(k, block_k, mean=k_mean, signs=signs, amax_to=amax_to), None, None)
    q8, q_scales, q8_t = fp8_quantize(q, block_q, signs=signs, amax_to=amax_to, empty_tile_scale=0.0,
                                      with_transposed=True)
    k8, k_scales, k8_t = fp8_quantize(k, block_k, mean=k_mean, signs=signs, amax_to=amax_to, with_transposed=True)
    return q8, q_scales, k8, k_scales, q8_t, k8_t


@triton.jit
def fp8_dequantize_kernel(Q, S, OUT, stride_qb, stride_qh, stride_qn, stride_qd, seq,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """One program: ROWS rows of one (batch, head). Grid (cdiv(seq, ROWS), H, B).

    Q: (B, H, seq, HEAD_DIM) e4m3, any strides; S: (B, H, cdiv(seq, BLOCK_N)) fp32 contiguous, one scale per tile
    of BLOCK_N rows; OUT: (B, H, seq, HEAD_DIM) contiguous, q * scale computed in fp32 (exact: a 4-bit significand
    times a power of two) and rounded once to OUT's dtype."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    head = off_b.to(tl.int64) * tl.num_programs(1) + off_h
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq) & (offs_d[None, :] < HEAD_DIM)
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    q = tl.load(q_base + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
    scale = tl.load(S + head * tl.cdiv(seq, BLOCK_N) + rows // BLOCK_N, mask=rows < seq, other=0.0)
    x = q.to(tl.float32) * scale[:, None]
    tl.store(OUT + (head * seq + rows[:, None]) * HEAD_DIM + offs_d[None, :], x.to(OUT.dtype.element_ty), mask=mask)


@on_input_device
def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, block_n: int, dtype: torch.dtype) -> torch.Tensor:
    """q (B, H, N, D) e4m3 times its tiles' scales (``fp8_quantize``'s outputs: scales (B, H, cdiv(N, block_n))
    fp32), as a contiguous (B, H, N, D) tensor of ``dtype``: exact in bfloat16 (power-of-two scales) and in
    float16 down to its subnormal range; the bits of ``flashtrain.ops.reference.fp8_dequantize_ref`` rounded to
    ``dtype``, in one pass (read e4m3, write ``dtype``)."""
    batch, heads, seq, head_dim = q.shape
    if q.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (batch, heads, cdiv(seq, block_n)):
        raise ValueError(f"fp8_dequantize: expected q float8_e4m3fn (B, H, N, D) and scales of shape "
                         f"{(batch, heads, cdiv(seq, block_n))} for block_n={block_n}; got q {q.dtype} "
                         f"{tuple(q.shape)}, scales {tuple(scales.shape)}")
    out = torch.empty((batch, heads, seq, head_dim), device=q.device, dtype=dtype)
    if out.numel():
        block_d = common.block_d(head_dim)
        rows = row_pass_rows(seq, block_d)
        launch_kernel(
            fp8_dequantize_kernel, (cdiv(seq, rows), heads, batch),
            q, scales.float().contiguous(), out, *q.stride(), seq, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=block_n, ROWS=rows)
    return out
