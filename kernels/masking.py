"""Where masks cut the work: causal key ranges per query block (and query ranges per key block), which scores a
tile keeps, and the launch order of causal programs.

Causal masks are aligned bottom-right like flash-attn: query i sees key j iff j <= i + (seq_k - seq_q). A program's
key range splits into blocks every row sees in full (no mask), blocks that cross the diagonal or hold the ragged
tail of seq_k (elementwise mask), and blocks no row sees (never visited). New masking modes (windows, documents)
belong here: a kernel asks this module for its ranges and its tile masks.

Causal programs do unequal work (query block i sees i + 1 key blocks), so ``_query_block_coords`` launches the
heaviest first within sections of (batch, head) pairs that ``causal_sections`` sizes: each section fills the SMs,
and its pairs' K and V fit in L2 together. docs/design.md has the scheme; docs/tuning.md the measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv
from .launch import sm_count

# Rows a section's pairs may stream and still share L2 (50 MB on an H100, 60 on an H200): docs/tuning.md
CAUSAL_SECTION_KV_BYTES = 8 << 20
# The number of sections instead of the rule, or None (tests set it to exercise uneven sections)
CAUSAL_SECTIONS: int | None = None


def causal_sections(causal: bool, pairs: int, blocks: int, group: int, seq: int, bytes_per_row: int,
                    device: torch.device) -> int:
    """Launch sections of a causal kernel with ``pairs`` (batch, head) pairs of ``blocks`` programs each, whose
    programs stream ``seq`` rows of ``bytes_per_row`` bytes that ``group`` pairs share: sections of at least one
    program per SM, more pairs while the rows they stream fit CAUSAL_SECTION_KV_BYTES, a power of two; from 1 to
    pairs. The forward and dQ stream K and V (``seq`` = seq_k) of a KV head that its ``group`` query heads share;
    dK/dV streams Q, dO, LSE and delta (``seq`` = seq_q) of a KV head's whole group of query heads, one pair
    alone. Without a mask 1 (the kernels do not read it)."""
    if not causal:
        return 1
    if CAUSAL_SECTIONS is not None:
        return max(1, min(CAUSAL_SECTIONS, pairs))
    sms = sm_count(device) if device.type == "cuda" else 1
    balance = cdiv(sms, max(1, blocks))
    footprint = CAUSAL_SECTION_KV_BYTES * group // max(1, seq * bytes_per_row)
    per_section = 1 << (max(balance, footprint, 1) - 1).bit_length()
    return max(1, pairs // per_section)


@triton.jit
def _query_block_coords(sections, CAUSAL: tl.constexpr):
    """(query block, head, batch) of this program in a grid (cdiv(seq_q, BLOCK_M), H_q, B).

    Without a mask the grid's own order: the query blocks of one head are launched together and share its K and
    V in L2. Causal, where block i sees i + 1 key blocks, the launch order is remapped: the (batch, head) pairs are
    split into ``sections`` runs of consecutive pairs as even as can be (``causal_sections``: the first
    pairs % sections one pair larger), and within a section the heaviest blocks go first across its pairs (the
    last query block of each, then the one before, ...). SMs take programs in launch order as they free up, so
    the grid ends on light blocks; head by head (sections = pairs) it ended on the last heads' heaviest. The Gluon
    kernels call it too (their PTX is the same as with a Gluon copy of it)."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    if CAUSAL:
        n_m = tl.num_programs(0)
        heads = tl.num_programs(1)
        pairs = heads * tl.num_programs(2)
        launched = pid_m + n_m * (off_h + heads * off_b)  # x fastest: the order programs are launched in
        size = pairs // sections  # the last sections' pairs; the first `larger` have one more
        larger = pairs - size * sections
        in_larger = launched < larger * (size + 1) * n_m
        rel = tl.where(in_larger, launched, launched - larger * (size + 1) * n_m)
        first = tl.where(in_larger, 0, larger * (size + 1))  # the first pair of the run rel counts from
        size = tl.where(in_larger, size + 1, size)
        section = rel // (size * n_m)
        within = rel - section * (size * n_m)
        pair = first + section * size + within % size
        off_h = pair % heads
        off_b = pair // heads
        pid_m = n_m - 1 - within // size
    return pid_m, off_h, off_b


@triton.jit
def _key_block_coords(sections, CAUSAL: tl.constexpr):
    """(key block, head, batch) of this program in a grid (cdiv(seq_k, BLOCK_N), H, B): ``_query_block_coords``
    with the blocks' weights reversed. Causal, key block j is seen by the query rows from j's first key on, so
    the first key blocks are the heaviest: within each section they go first across its pairs."""
    pid_n, off_h, off_b = _query_block_coords(sections, CAUSAL)
    if CAUSAL:
        pid_n = tl.num_programs(0) - 1 - pid_n
    return pid_n, off_h, off_b


@triton.jit
def _query_block_key_range(start_m, seq_k, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr = False):
    """(mid, hi): the keys a program with queries [start_m, start_m + BLOCK_M) visits. [0, mid) are whole key
    blocks every row sees (no mask); [mid, hi) the blocks crossing the diagonal and the ragged tail of seq_k
    (masked); keys from hi on are seen by no row. causal_offset = seq_k - seq_q. EVEN_N: the caller knows
    seq_k % BLOCK_N == 0, so without a causal mask [mid, hi) is empty at compile time."""
    if CAUSAL:
        # keys seen by the block's last row: j < start_m + BLOCK_M + causal_offset
        hi = tl.minimum(seq_k, start_m + BLOCK_M + causal_offset)
        # keys seen by its first row (so by every row): j <= start_m + causal_offset
        n_full = tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N
        mid = tl.minimum(n_full, seq_k // BLOCK_N) * BLOCK_N
    else:
        hi = seq_k
        mid = seq_k if EVEN_N else (seq_k // BLOCK_N) * BLOCK_N
    return mid, hi


@triton.jit
def _visible(rows, cols, seq_k, causal_offset, CAUSAL: tl.constexpr):
    """Which scores of query rows ``rows`` and keys ``cols`` (broadcastable index tiles, either orientation)
    exist: keys inside seq_k and, if CAUSAL, on or below the bottom-right aligned diagonal, j <= i + causal_offset
    with causal_offset = seq_k - seq_q."""
    visible = cols < seq_k
    if CAUSAL:
        visible = visible & (cols <= rows + causal_offset)
    return visible


@triton.jit
def _dkdv_query_range(start_n, seq_q, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """(lo, mid, end): the query blocks a dK/dV program with keys [start_n, start_n + BLOCK_N) visits, in
    multiples of BLOCK_M. Causal: [lo, mid) cross the diagonal (masked), [mid, end) see every key of the block,
    and blocks before lo see none; otherwise lo = mid = 0. causal_offset = seq_k - seq_q."""
    end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # first query row that sees key start_n: i >= start_n - causal_offset
        lo = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        # first row that sees every key of the block: i >= start_n + BLOCK_N - 1 - causal_offset
        first_full = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
        mid = tl.minimum(tl.maximum(tl.cdiv(first_full, BLOCK_M) * BLOCK_M, lo), end)
    else:
        lo = 0
        mid = 0
    return lo, mid, end
