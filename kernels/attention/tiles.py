"""Tiles of the 16-bit Triton kernels: the autotuner's candidates on the GPU, fixed tiles in Triton's interpreter
and for float64. Each tuple is (BLOCK_M, BLOCK_N, num_warps, num_stages); docs/tuning.md has the measurements.
"""

from __future__ import annotations

import functools

import triton

from ..launch import INTERPRET


def _configs(candidates):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for (m, n, w, s) in candidates]


WIDE_HEAD_DIM = 128  # head_dim above this takes the _WIDE lists: the narrow lists' tiles spill registers there

# Forward: query tile x key tile.
FWD_CANDIDATES = _configs([
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (128, 128, 8, 3),  # 224 KB of shared memory at D=128 (sm_90 allows 227)
])
FWD_CANDIDATES_WIDE = _configs([
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 1),
])
# dK/dV: key tile (BLOCK_N) outer and large, query tile streamed; K, V and fp32 dK, dV of BLOCK_N rows stay resident.
DKDV_CANDIDATES = _configs([
    (32, 128, 4, 3),
    (32, 128, 8, 3),
    (64, 128, 8, 2),
    (32, 64, 4, 2),
    (64, 64, 4, 3),  # head_dim 64 at 16k
])
DKDV_CANDIDATES_WIDE = _configs([
    (32, 32, 4, 2),
    (32, 32, 8, 2),
    (64, 32, 8, 2),
    (16, 64, 8, 2),
])
# dK/dV in two launches, one accumulator each (head_dim > WIDE_HEAD_DIM; narrower heads reuse DKDV_CANDIDATES):
# key tiles of 64 rows a warpgroup, the height of one Hopper wgmma, which the fused list mostly does not reach
# (docs/tuning.md: what ptxas reports for each)
DKDV_SPLIT_CANDIDATES_WIDE = _configs([
    (32, 64, 4, 2),
    (32, 128, 8, 2),
    (16, 128, 8, 2),
])
# dQ: query tile outer and large, key tile streamed; Q, dO and dQ of BLOCK_M rows stay resident.
DQ_CANDIDATES = _configs([
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 2),
    (64, 32, 4, 2),
    (128, 64, 8, 3),  # head_dim 64 at 16k
])
DQ_CANDIDATES_WIDE = _configs([
    (64, 32, 8, 2),
    (32, 32, 4, 2),
    (32, 64, 4, 2),
    (64, 16, 4, 2),
])

# The dK/dV kernel drops its query-row masks when seq_q is a multiple of this (EVEN_M): every BLOCK_M it may
# launch with (candidates, interpreter and fp64 tiles) divides it (tests/kernels/test_tiles.py checks).
EVEN_M_MULTIPLE = 128

# Triton's interpreter: its cost is per program and loop iteration, so from INTERPRET_LONG_SEQ tokens large tiles;
# below, small unequal tiles, so the CPU tests cross several blocks on both axes (as the GPU does).
INTERPRET_FWD = (32, 16, 4, 1)
INTERPRET_DKDV = (16, 32, 4, 1)
INTERPRET_DQ = (32, 16, 4, 1)
INTERPRET_LONG_FWD = (128, 64, 4, 1)
INTERPRET_LONG_DKDV = (64, 128, 4, 1)
INTERPRET_LONG_DQ = (128, 64, 4, 1)
INTERPRET_LONG_SEQ = 256
# float64 on the GPU: one small tile (fp64 is for exactness checks, not speed)
FP64 = (32, 32, 4, 1)
FP64_WIDE = (16, 16, 4, 1)  # head_dim > 128: 32 x 32 fp64 tiles need ~320 KB of shared memory (sm_90: 227)


def as_launch(cfg: tuple) -> dict:
    """A (BLOCK_M, BLOCK_N, num_warps, num_stages) tuple as launch keyword arguments."""
    block_m, block_n, warps, stages = cfg
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def fixed_config(kernel: str, block_d: int, seq_len: int) -> dict:
    """The fixed launch parameters of ``kernel`` ('fwd', 'dkdv', 'dq') in the interpreter or for float64;
    ``seq_len`` is the longer of seq_q and seq_k."""
    if INTERPRET:
        if seq_len >= INTERPRET_LONG_SEQ:
            table = {"fwd": INTERPRET_LONG_FWD, "dkdv": INTERPRET_LONG_DKDV, "dq": INTERPRET_LONG_DQ}
        else:
            table = {"fwd": INTERPRET_FWD, "dkdv": INTERPRET_DKDV, "dq": INTERPRET_DQ}
        return as_launch(table[kernel])
    return as_launch(FP64 if block_d <= 128 else FP64_WIDE)


@functools.cache  # every launch asks (host time): the candidate lists are fixed
def largest_tile(kernel: str, head_dim: int) -> int:
    """The most rows a tile of the tuned ``kernel`` may hold at ``head_dim``, over the candidates the tuner picks
    from: query rows (BLOCK_M) for 'fwd' and 'dq', keys (BLOCK_N) for 'dkdv' and 'dkdv_split'. The launchers
    count their causal sections in tiles of this size, since the tuned tile is not known before the launch."""
    key, narrow, wide = {"fwd": ("BLOCK_M", FWD_CANDIDATES, FWD_CANDIDATES_WIDE),
                         "dkdv": ("BLOCK_N", DKDV_CANDIDATES, DKDV_CANDIDATES_WIDE),
                         "dkdv_split": ("BLOCK_N", DKDV_CANDIDATES, DKDV_SPLIT_CANDIDATES_WIDE),
                         "dq": ("BLOCK_M", DQ_CANDIDATES, DQ_CANDIDATES_WIDE)}[kernel]
    return max(c.kwargs[key] for c in (wide if head_dim > WIDE_HEAD_DIM else narrow))
