"""FP8 attention building blocks: per-tile e4m3 quantisation and randomised Hadamard incoherent processing.

Numerics (the parts built so far; the FP8 attention kernels that use them come next):

* Format: e4m3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, largest finite value 448,
  relative rounding error at most 2^-4 for normal values, absolute spacing 2^-9 below 2^-6 (subnormals).
* Scales: one float32 scale per (batch, head, tile of rows), the tile the attention kernel loads:
  scale = amax(|tile|) / 448, so every tile uses the whole e4m3 range and nothing overflows. An all-zero
  tile gets scale 1 and quantises to zeros (no NaN). Dequantisation is q * scale.
* Rounding: round to nearest, ties to even, done explicitly on the e4m3 grid before the cast
  (``flashtrain.kernels.fp8_quant``); bit-identical to torch's own conversion.
* Incoherent processing: Q and K are multiplied by the same orthogonal matrix M = diag(signs) H / sqrt(d')
  (Sylvester Hadamard H, random +-1 signs, head_dim zero-padded to d' = next power of two). Q M (K M)^T
  = Q K^T in exact arithmetic; in FP8 it spreads outlier channels over all channels, so per-tile scales are
  set by typical values rather than by the outlier. Applied in O(d log d) by a fast Walsh-Hadamard
  transform kernel (``flashtrain.kernels.hadamard``); its gradient is the inverse transform.
* P (the softmax numerator exp(S - rowmax), in [0, 1]) is planned to go to e4m3 with the fixed scale 1/448
  before P V, with the row sum taken from the unrounded P. ``flashtrain.reference.fp8_attention_ref``
  simulates the whole scheme in float64; benchmarks/NOTES.md has its error on FlashAttention-3's outlier
  benchmark, which the kernels are to match.
"""

from __future__ import annotations

import torch

from .kernels.fp8_quant import fp8_quantize
from .kernels.hadamard import hadamard, padded_dim

__all__ = ["fp8_quantize", "hadamard_transform", "random_signs", "padded_dim"]


def random_signs(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """A fixed random +-1 vector of length padded_dim(head_dim), float32, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (padded_dim(head_dim),), generator=gen).float() * 2 - 1
    return signs.to(device) if device is not None else signs


class _HadamardTransform(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, signs):
        ctx.save_for_backward(signs)
        ctx.head_dim = x.shape[-1]
        return hadamard(x, signs)

    @staticmethod
    def backward(ctx, grad_y):
        (signs,) = ctx.saved_tensors
        # the transform is orthogonal: its gradient is its inverse, cut back to head_dim
        return hadamard(grad_y, signs, inverse=True, out_dim=ctx.head_dim), None


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) -> (..., padded_dim(head_dim)): (x * signs) @ H / sqrt(d'), differentiable in x."""
    return _HadamardTransform.apply(x, signs)
