"""Randomised Hadamard transform for incoherent processing (FP8 attention), in O(d log d) per row.

y = (x * signs) @ H / sqrt(d'), with H the d' x d' Sylvester Hadamard matrix (d' = head_dim padded with zeros
to a power of two) and ``signs`` a fixed random +-1 vector. The map is orthogonal, so applying it to both Q
and K leaves Q K^T unchanged, while it spreads an outlier channel over all channels before quantisation.
Its inverse (and its gradient) is x = (y @ H / sqrt(d')) * signs, cut back to head_dim.

The kernel holds BLOCK_R rows in registers and runs the log2(d') butterfly stages of the fast Walsh-Hadamard
transform on them: additions and subtractions only, then one scale. The FP8 backward's kernels run the same
inverse (``_inverse_rotation``) on their dQ and dK tiles before storing them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..common import _scale, cdiv, next_power_of_2, split_scale
from ..launch import FixedLaunch, kept, on_input_device


@triton.jit
def _butterfly(x, R: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """One FWHT stage on (R, D): pairs (i, i + H) within blocks of 2H become (a + b, a - b)."""
    x4 = tl.permute(tl.reshape(x, (R, D // (2 * H), 2, H)), (0, 1, 3, 2))  # (R, blocks, H, pair)
    a, b = tl.split(x4)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))


@triton.jit
def _fwht(x, R: tl.constexpr, D: tl.constexpr):
    """The unnormalised fast Walsh-Hadamard transform of each row of x (R, D): x @ H_D."""
    return _fwht_blocks(x, R, D, D)


@triton.jit
def _fwht_blocks(x, R: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """x (R, W) with each block of D columns (D divides W) times H_D: the stages of ``_fwht`` that pair columns
    less than D apart. W > D where a kernel's tile is wider than the transform (zero columns past it)."""
    # stage s pairs columns 2^s apart; stages from D on are compiled out. Written out rather than a
    # tl.static_range loop: in Triton's interpreter the loop variable is a tensor, which reshape rejects.
    x = _butterfly(x, R, W, 1)
    if D > 2:
        x = _butterfly(x, R, W, 2)
    if D > 4:
        x = _butterfly(x, R, W, 4)
    if D > 8:
        x = _butterfly(x, R, W, 8)
    if D > 16:
        x = _butterfly(x, R, W, 16)
    if D > 32:
        x = _butterfly(x, R, W, 32)
    if D > 64:
        x = _butterfly(x, R, W, 64)
    if D > 128:
        x = _butterfly(x, R, W, 128)
    return x


@triton.jit
def _inverse_rotation(x, SIGNS, norm, norm_lo, R: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """x (R, W) fp32/fp64, its first D columns rotated (D a power of two, W >= D its tile width): those columns
    times M^T = H_D / sqrt(D) diag(signs), in the order and precision of ``hadamard_kernel``'s inverse (the
    same bits; ``hadamard_kernel``'s inverse is this function). Columns from D on come out times a zero sign."""
    cols = tl.arange(0, W)
    signs = tl.load(SIGNS + cols, mask=cols < D, other=0.0).to(x.dtype)
    return _scale(_fwht_blocks(x, R, W, D), norm, norm_lo) * signs[None, :]


@triton.jit
def hadamard_kernel(X, SIGNS, Y, MEAN, n_rows, d_in, d_out, rows_per_mean, norm, norm_lo,
                    D: tl.constexpr, BLOCK_R: tl.constexpr, SIGNS_FIRST: tl.constexpr, CENTRE: tl.constexpr):
    """One program: BLOCK_R rows. X (n_rows, d_in), Y (n_rows, d_out), both contiguous; D = next pow2 >= d_in.

    SIGNS_FIRST: forward (signs, then H); else inverse (H, then signs). (norm, norm_lo): split 1/sqrt(D).
    CENTRE: subtract MEAN (n_rows / rows_per_mean, d_in) fp32, row r its row r // rows_per_mean: the inverse first,
    in fp32; the forward after the rotation, the rotated mean from the rotated rows (K smoothing's bits, as the
    quantisation kernel centres them: ``quant._rotated_rows``), in fp32 (fp64 for fp64 X), one rounding.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    acc_dtype = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    mask = (rows[:, None] < n_rows) & (cols[None, :] < d_in)
    x = tl.load(X + rows[:, None].to(tl.int64) * d_in + cols[None, :], mask=mask, other=0.0).to(acc_dtype)
    if CENTRE:
        mean = tl.load(MEAN + (rows // rows_per_mean)[:, None].to(tl.int64) * d_in + cols[None, :], mask=mask,
                       other=0.0).to(acc_dtype)
        if not SIGNS_FIRST:
            x = tl.where(mask, x - mean, 0.0)
    if SIGNS_FIRST:
        signs = tl.load(SIGNS + cols).to(acc_dtype)[None, :]
        x = _scale(_fwht(x * signs, BLOCK_R, D), norm, norm_lo)
        if CENTRE:  # K smoothing: minus the rotated mean, before the one rounding
            x = tl.where(rows[:, None] < n_rows, x - _scale(_fwht(mean * signs, BLOCK_R, D), norm, norm_lo), 0.0)
    else:
        x = _inverse_rotation(x, SIGNS, norm, norm_lo, BLOCK_R, D, D)
    tl.store(Y + rows[:, None].to(tl.int64) * d_out + cols[None, :], x.to(Y.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < d_out))


@functools.lru_cache(maxsize=None)
def hadamard_matrix(dim: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The (dim, dim) Sylvester Hadamard matrix (dim a power of two) of +-1, exact in every float dtype,
    contiguous; cached per (dim, dtype, device): do not modify it."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.contiguous()


def padded_dim(head_dim: int) -> int:
    """Width of the transform: head_dim rounded up to a power of two (at least 2)."""
    return max(2, next_power_of_2(head_dim))


HADAMARD_BLOCK_R = 16  # rows a program


@on_input_device
def hadamard(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False, out_dim: int | None = None,
             mean: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """Forward: (..., d) -> (..., d'), y = (x * signs) @ H / sqrt(d'). Inverse: (..., d') -> (..., out_dim),
    x = (y @ H / sqrt(d') * signs)[..., :out_dim]. ``signs``: (d',) of +-1; d' = padded_dim(d) <= 256.
    ``mean`` (x (B, H, N, d_in), mean (B, H, d_in) float32): x - mean, in fp32 and one rounding at the end (the
    mean over the sequence commutes with the rotation). Forward: the rotated x minus the rotated mean (K smoothing;
    the bits of ``fp8_quantize(x, mean=mean, signs=signs)``'s rotated rows). Inverse: centred first (dK's centring
    in ``fp8="forward"``'s backward).
    ``out_dtype``: the output's dtype (default x's), rounded once from the fp32 (fp64) sums: the bits of the
    transform in x's dtype followed by ``.to(out_dtype)`` when x is float32."""
    d_in = x.shape[-1]
    d = signs.numel()
    expected = d_in if inverse else padded_dim(d_in)
    if d != expected:
        raise ValueError(f"hadamard: signs has {d} entries; expected {expected} for input width {d_in}")
    if d > 256:
        raise ValueError(f"hadamard: transform width {d} > 256")
    if mean is not None:
        if x.dim() != 4:
            raise ValueError(f"hadamard: mean needs a (B, H, N, D) x; got x of shape {tuple(x.shape)}")
        check_mean("hadamard", mean, (x.shape[0], x.shape[1], d_in))
    d_out = d if not inverse else (out_dim or d)
    rows = x.reshape(-1, d_in).contiguous()
    y = torch.empty((rows.shape[0], d_out), device=x.device, dtype=out_dtype or x.dtype)
    if rows.shape[0]:
        launch = _hadamard_launch(rows.shape[0], d_in, d, d_out, x.shape[2] if mean is not None else 1, inverse,
                                  mean is not None)
        launch(rows, signs.to(device=x.device).contiguous(), y, rows if mean is None else mean.contiguous())
    return y.view(*x.shape[:-1], d_out)


@kept
def _hadamard_launch(n_rows: int, d_in: int, d: int, d_out: int, rows_per_mean: int, inverse: bool,
                     centre: bool) -> FixedLaunch:
    """``hadamard``'s launch for one shape, kept (host time)."""
    return FixedLaunch(hadamard_kernel, (cdiv(n_rows, HADAMARD_BLOCK_R),),
                       (n_rows, d_in, d_out, rows_per_mean, *split_scale(1.0 / math.sqrt(d))),
                       dict(D=d, BLOCK_R=HADAMARD_BLOCK_R, SIGNS_FIRST=not inverse, CENTRE=centre))


def check_mean(fn: str, mean: torch.Tensor | None, shape: tuple) -> None:
    """A centring mean must be float32 (B, H, D): one row per (batch, head) of the tensor it centres."""
    if mean is not None and (tuple(mean.shape) != shape or mean.dtype != torch.float32):
        raise ValueError(f"{fn}: mean must be float32 of shape {shape}; got {mean.dtype} {tuple(mean.shape)}")
