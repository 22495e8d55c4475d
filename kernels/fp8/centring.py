"""Subtract a mean per (batch, head): K smoothing's centring where it is not fused into another kernel (dK in
the FP8 backwards: the centring's Jacobian is the centring itself); and the mean K smoothing subtracts, of a
sample of the keys (``seq_mean``).

y = (x - mean[b, h]).to(out dtype), computed in fp32 (fp64 for float64 x) and rounded once: the bits of the torch
expression it replaces (``flashtrain.ops.reference.centre_ref``), in one pass. torch's broadcast subtraction into a
16-bit output took ~160 us at (4, 16, 4096, 128) on the H200 against ~40 us for a copy of those bytes
(docs/performance-notes.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_power_of_2
from ..launch import FixedLaunch, kept, launch_kernel, on_input_device
from .hadamard import check_mean
from .tiles import row_pass_rows


@triton.jit
def centre_kernel(X, MEAN, Y, stride_xb, stride_xh, stride_xn, seq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  ROWS: tl.constexpr):
    """One program: ROWS rows of one (batch, head). Grid (cdiv(seq, ROWS), H, B).

    X (B, H, seq, HEAD_DIM) with unit stride on its last dim; MEAN (B, H, HEAD_DIM) fp32 contiguous; Y like X,
    contiguous."""
    pid_n, off_h, off_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq) & (cols[None, :] < HEAD_DIM)
    x = tl.load(X + off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh
                + rows[:, None].to(tl.int64) * stride_xn + cols[None, :], mask=mask)
    head = off_b.to(tl.int64) * tl.num_programs(1) + off_h
    mean = tl.load(MEAN + head * HEAD_DIM + cols, mask=cols < HEAD_DIM)
    acc_dtype = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    y = x.to(acc_dtype) - mean.to(acc_dtype)[None, :]
    tl.store(Y + (head * seq + rows[:, None]) * HEAD_DIM + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@on_input_device
def centre(x: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (B, H, N, D) minus mean (B, H, D) float32 on every row, as a contiguous tensor of ``dtype`` (default x's),
    rounded once from fp32 (fp64 for float64 x)."""
    batch, heads, seq, head_dim = x.shape
    check_mean("centre", mean, (batch, heads, head_dim))
    out = torch.empty(x.shape, device=x.device, dtype=dtype or x.dtype)
    if out.numel():
        if x.stride(-1) != 1:
            x = x.contiguous()
        block_d = next_power_of_2(head_dim)
        rows = row_pass_rows(seq, block_d)
        launch_kernel(
            centre_kernel, (cdiv(seq, rows), heads, batch),
            x, mean.contiguous(), out, *x.stride()[:3], seq, HEAD_DIM=head_dim, BLOCK_D=block_d, ROWS=rows)
    return out


@triton.jit
def seq_mean_kernel(X, MEAN, stride_xb, stride_xh, stride_xn, stride_xd, n_rows, step,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_D columns of one (batch, head). Grid (cdiv(HEAD_DIM, BLOCK_D), H, B).

    X (B, H, seq, HEAD_DIM), any strides; MEAN (B, H, HEAD_DIM) fp32 contiguous: the mean of X's rows 0, step,
    2 * step, ... (n_rows of them), summed in fp32 (BLOCK_N partial sums a column, added at the end), then divided
    by n_rows."""
    pid_d, off_h, off_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    base = X + off_b.to(tl.int64) * stride_xb + off_h.to(tl.int64) * stride_xh + cols[None, :] * stride_xd
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        x = tl.load(base + (rows.to(tl.int64) * step * stride_xn)[:, None],
                    mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        acc += x.to(tl.float32)
    mean = tl.sum(acc, axis=0) / n_rows
    head = off_b.to(tl.int64) * tl.num_programs(1) + off_h
    tl.store(MEAN + head * HEAD_DIM + cols, mean, mask=cols < HEAD_DIM)


# Columns and rows a program of ``seq_mean_kernel`` holds: 64 columns keep (4, 8, N, 256) at 128 programs, and
# a (32, 64) tile of partial sums is 16 registers a thread at 4 warps.
SEQ_MEAN_BLOCK_D, SEQ_MEAN_BLOCK_N = 64, 32


@on_input_device
def seq_mean(x: torch.Tensor, step: int = 1) -> torch.Tensor:
    """The mean of every ``step``-th row of x (B, H, N, D) over the sequence (rows 0, step, 2 * step, ...), (B, H, D)
    float32, in one launch: K smoothing's vector. The value of ``x[:, :, ::step].mean(dim=2, dtype=torch.float32)``
    up to the order of its fp32 sums. On the H200 (docs/performance-notes.md; GPU time by CUDA-graph
    replay, bf16, every 16th of 4,096 keys): 3.6-4.0 us against torch's 5.7-6.0, the fp8="forward" op's forward
    5-10 us faster at 4k causal (head_dim 64, 128 and 256)."""
    if x.dim() != 4:
        raise ValueError(f"seq_mean: x must be 4-D (batch, heads, seq, head_dim); got shape {tuple(x.shape)}")
    if step < 1:
        raise ValueError(f"seq_mean: step={step}; expected a positive integer")
    batch, heads, seq, head_dim = x.shape
    out = torch.empty((batch, heads, head_dim), device=x.device, dtype=torch.float32)
    if out.numel():
        _seq_mean_launch(batch, heads, seq, head_dim, x.stride(), step)(x, out)
    return out


@kept
def _seq_mean_launch(batch: int, heads: int, seq: int, head_dim: int, strides: tuple, step: int) -> FixedLaunch:
    """``seq_mean``'s launch for one shape, kept (host time)."""
    block_d = min(SEQ_MEAN_BLOCK_D, next_power_of_2(head_dim))
    return FixedLaunch(seq_mean_kernel, (cdiv(head_dim, block_d), heads, batch),
                       (*strides, cdiv(seq, step), step),
                       dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=SEQ_MEAN_BLOCK_N))
