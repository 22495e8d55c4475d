"""Tiles of the FP8 kernels (fixed, not tuned: the quantisation tiles must be the tiles the kernels load, one scale
per tile) and the other sizes of the FP8 path. Each tuple is (BLOCK_M, BLOCK_N, num_warps, num_stages);
docs/tuning.md has the measurements.
"""

from __future__ import annotations

from ..attention.tiles import INTERPRET_LONG_SEQ, as_launch
from ..common import block_d, next_power_of_2
from ..launch import INTERPRET

# Forward, per padded head dim (up to 64, 128, 256): the fastest of a sweep on the H200
FP8_FWD = {64: (128, 64, 8, 2), 128: (128, 128, 8, 3), 256: (128, 128, 8, 2)}
# the interpreter's forward tiles are its backward's scale tiles, as on the GPU at head_dim 128 and 256, so that
# fp8="full"'s backward reads the forward's FP8 Q and K on the CPU too
INTERPRET_FP8_FWD = (32, 32, 4, 1)
INTERPRET_LONG_FP8_FWD = (128, 128, 4, 1)

# Backward: Q and dO are quantised in tiles of SCALE_M rows, K and V of SCALE_N; each kernel's tiles divide them
FP8_BWD_SCALE_TILES = (128, 128)
FP8_BWD_DKDV = {64: (64, 64, 4, 3), 128: (64, 128, 8, 3), 256: (64, 64, 8, 3)}
FP8_BWD_DQ = {64: (64, 64, 4, 2), 128: (64, 64, 4, 3), 256: (64, 64, 8, 2)}
# Per head_dim: whether the dK/dV kernel waits for dK's wgmma within each step (``fp8.bwd._settled``); at 128 its
# two warpgroups keep the tensor cores busy either way and waiting was 3-7% slower
FP8_BWD_SETTLE_DK = {64: True, 128: False, 256: True}
# The interpreter: tiles of 16 / 32 rows under scale tiles of 32, so the CPU tests cross several tiles per scale
# and several scales; from INTERPRET_LONG_SEQ tokens the GPU's tiles
INTERPRET_FP8_BWD = ((32, 32), (16, 32, 4, 1), (32, 16, 4, 1))
INTERPRET_LONG_FP8_BWD = ((128, 128), (64, 128, 4, 1), (128, 64, 4, 1))

# K smoothing subtracts the mean of every (N // SMOOTHING_KEYS)-th key: 256 to 511 keys give the mean to ~std / 16
SMOOTHING_KEYS = 256

# Elements of one program of the row-wise one-pass kernels (dequantisation, centring): fp32 in registers at 4 warps
ROW_PASS_ELEMENTS = 8192


def fp8_block_d(head_dim: int) -> int:
    """Head dim of the FP8 kernels' tiles: as ``block_d``, but at least 32, because Hopper's FP8 MMA reduces over
    32 elements at a time and Triton refuses a smaller FP8 ``tl.dot``."""
    return max(32, block_d(head_dim))


def fp8_config(seq_len: int, head_dim: int) -> dict:
    """Launch parameters of the FP8 forward for Q/K rows of ``head_dim``; ``seq_len`` (the longer of seq_q,
    seq_k) picks the interpreter's tiles as for the 16-bit kernels."""
    if INTERPRET:
        return as_launch(INTERPRET_LONG_FP8_FWD if seq_len >= INTERPRET_LONG_SEQ else INTERPRET_FP8_FWD)
    return as_launch(FP8_FWD[max(64, block_d(head_dim))])


def fp8_bwd_tiles(seq_len: int, qk_dim: int) -> dict:
    """The FP8 backward's tiling for Q/K rows of ``qk_dim`` (after the rotation's padding): SCALE_M, SCALE_N (rows
    per scale of Q and dO, of K and V) and the launch parameters of its two kernels, "dkdv" and "dq" (dicts of
    BLOCK_M, BLOCK_N, num_warps, num_stages; "dkdv" also SETTLE_DK); ``seq_len`` as in fp8_config."""
    settle = False  # the interpreter runs no inline asm
    if INTERPRET:
        scales, dkdv, dq = INTERPRET_LONG_FP8_BWD if seq_len >= INTERPRET_LONG_SEQ else INTERPRET_FP8_BWD
    else:
        width = max(64, block_d(qk_dim))
        scales, dkdv, dq = FP8_BWD_SCALE_TILES, FP8_BWD_DKDV[width], FP8_BWD_DQ[width]
        settle = FP8_BWD_SETTLE_DK[width]
    return dict(SCALE_M=scales[0], SCALE_N=scales[1], dkdv=dict(as_launch(dkdv), SETTLE_DK=settle), dq=as_launch(dq))


def smoothing_stride(seq: int) -> int:
    """The step between the keys whose mean K smoothing subtracts, for ``seq`` keys."""
    return max(1, seq // SMOOTHING_KEYS)


def row_pass_rows(seq: int, block_d: int) -> int:
    """Rows a program of a row-wise one-pass kernel takes: ROW_PASS_ELEMENTS of a (seq, block_d) tensor, at most
    seq rounded up to a power of two."""
    return min(next_power_of_2(seq), max(1, ROW_PASS_ELEMENTS // block_d))
