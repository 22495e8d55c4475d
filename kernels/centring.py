"""Subtract a mean per (batch, head): K smoothing's centring where it is not fused into another kernel (dK in
the FP8 backwards: the centring's Jacobian is the centring itself).

y = (x - mean[b, h]).to(out dtype), computed in fp32 (fp64 for float64 x) and rounded once: the bits of the torch
expression it replaces (``flashtrain.reference.centre_ref``), in one pass. torch's broadcast subtraction into a
16-bit output took ~160 us at (4, 16, 4096, 128) on the H200 against ~40 us for a copy of those bytes
(benchmarks/NOTES.md, nineteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .hadamard import check_mean
from .launch import launch_kernel


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


@configs.on_input_device
def centre(x: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (B, H, N, D) minus mean (B, H, D) float32 on every row, as a contiguous tensor of ``dtype`` (default x's),
    rounded once from fp32 (fp64 for float64 x)."""
    batch, heads, seq, head_dim = x.shape
    check_mean("centre", mean, (batch, heads, head_dim))
    out = torch.empty(x.shape, device=x.device, dtype=dtype or x.dtype)
    if out.numel():
        if x.stride(-1) != 1:
            x = x.contiguous()
        block_d = configs.next_power_of_2(head_dim)
        rows = configs.row_pass_rows(seq, block_d)
        launch_kernel(
            centre_kernel, (configs.cdiv(seq, rows), heads, batch),
            x, mean.contiguous(), out, *x.stride()[:3], seq, HEAD_DIM=head_dim, BLOCK_D=block_d, ROWS=rows)
    return out
