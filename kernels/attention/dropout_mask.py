"""The attention kernels' dropout keep mask, materialised: for tests, references and debugging only.

The attention kernels never store their dropout mask; they regenerate it from (seed, Philox counter) with
``common._dropout_keep``. This kernel calls that same function over a full (seq_q, seq_k) grid, so
a reference can apply exactly the mask the kernels applied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import _dropout_keep, cdiv
from ..launch import launch_device, launch_kernel


@triton.jit(do_not_specialize=["seed"])
def dropout_keep_mask_kernel(KEEP, seq_q, seq_k, seed, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """KEEP: (B * H_q, seq_q, seq_k) contiguous bytes. Grid (cdiv(seq_q, BLOCK_M), cdiv(seq_k, BLOCK_N), B * H_q)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = tl.program_id(1) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    rng_base = tl.program_id(2).to(tl.int64) * seq_q
    keep = _dropout_keep(seed, rng_base, rows[:, None], cols[None, :], seq_k, dropout_p)
    ptrs = KEEP + (rng_base + rows[:, None]) * seq_k + cols[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(rows[:, None] < seq_q) & (cols[None, :] < seq_k))


def dropout_keep_mask(seed: int, batch: int, heads_q: int, seq_q: int, seq_k: int, dropout_p: float,
                      device) -> torch.Tensor:
    """Bool (batch, heads_q, seq_q, seq_k): True where the attention kernels keep a probability."""
    keep = torch.empty((batch, heads_q, seq_q, seq_k), dtype=torch.uint8, device=device)
    block = 32
    grid = (cdiv(seq_q, block), cdiv(seq_k, block), batch * heads_q)
    with launch_device(keep):
        launch_kernel(dropout_keep_mask_kernel, grid, keep, seq_q, seq_k, seed, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()
