"""Pieces every kernel family shares: host-side integer math, the ``@triton.jit`` helpers for loading rows and
scaling scores, and the forward's output allocation.

Scores live in the log2 domain: the softmax scale times log2(e) is folded into one multiply, so every exponential
is one ``exp2``. fp64 kernels take each float scale as an fp32 (hi, lo) pair (``split_scale``), because Triton
passes Python floats to kernels as fp32.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import INTERPRET

LOG2E = 1.4426950408889634  # 1/ln(2): e^x = 2^(x * log2(e))


# Host-side integer helpers: triton.cdiv and triton.next_power_of_2 cost ~5 us a call on the host (constexpr
# function wrappers in triton 3.6), these 0.1 us.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest ``tl.dot`` operand)."""
    return max(16, next_power_of_2(head_dim))


@functools.lru_cache(maxsize=256)
def split_scale(scale: float) -> tuple[float, float]:
    """(hi, lo) float32 pair with hi + lo = scale to ~2^-48: fp64 kernels rebuild an fp64 scale from the pair
    (``_scale``). Cached: it is on every launch's host path, and a few scales recur."""
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


def precision_for(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 follows torch's TF32 switch, everything else is exact IEEE."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not INTERPRET:
        return "tf32"
    return "ieee"


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the saved LSE: float32, or float64 when the inputs are float64 (keeps fp64 exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def allocate_outputs(q: torch.Tensor, k: torch.Tensor):
    """(out, lse, done) for a forward: out ``empty_like(q)``, lse (B, H_q, N_q) in ``lse_dtype``; done when
    there is nothing to launch (no query, or no key: zeros and LSE -inf, what the kernel would give)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=lse_dtype(q.dtype))
    if out.numel() == 0:
        return out, lse, True
    if k.shape[2] == 0:
        return out.zero_(), lse.fill_(float("-inf")), True
    return out, lse, False


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; zero-fill rows >= n_rows (if MASK_ROWS) and columns >= HEAD_DIM."""
    if MASK_ROWS:
        if HEAD_DIM == BLOCK_D:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _scale(x, scale, scale_lo):
    """x * scale, where (scale, scale_lo) is ``split_scale``'s pair: fp64 uses both halves."""
    if x.dtype == tl.float64:
        return x * scale + x * scale_lo
    return x * scale


@triton.jit
def _key_bias(kb_base, cols, seq_k):
    """Log2-domain bias of keys ``cols`` (0 past seq_k, which the caller masks). kb_base: this batch row."""
    return tl.load(kb_base + cols, mask=cols < seq_k, other=0.0)


@triton.jit
def _dropout_keep(seed, rng_base, rows, cols, seq_k, dropout_p):
    """Keep mask of attention dropout for the tile (rows x cols), which may come in either orientation
    (rows[:, None], cols[None, :] or transposed). rng_base = (b * H_q + h) * seq_q, int64: the Philox
    counter of element (i, j) is (rng_base + i) * seq_k + j, the same in every kernel."""
    return tl.rand(seed, (rng_base + rows) * seq_k + cols) >= dropout_p
