"""Where masks cut the work: causal key ranges per query block (and query ranges per key block), which scores a
tile keeps, and the launch order of causal programs.

Masks are aligned bottom-right like flash-attn. With ``window_size = (left, right)`` query i sees key j iff
i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right (-1: unbounded on that side); causal is right = 0. The
kernels take the two diagonals as offsets, ``right_offset = seq_k - seq_q + right`` and
``left_offset = seq_k - seq_q - left``, and two constexpr flags: CAUSAL (the right side is bounded: causal or
right >= 0) and LOCAL (the left side is bounded). A program's key range splits into blocks every row sees in full
(no mask), blocks that cross a diagonal or hold the ragged tail of seq_k (elementwise mask), and blocks no row sees
(never visited). Packed sequences (varlen) reuse all of it per sequence: ``_sequence`` gives a program its
sequence's offsets and lengths.

Causal programs do unequal work (query block i sees i + 1 key blocks), so ``_query_block_coords`` launches the
heaviest first within sections of (batch, head) pairs that ``causal_sections`` sizes: each section fills the SMs,
and its pairs' K and V fit in L2 together. docs/design.md has the scheme; docs/tuning.md the measurements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import cdiv
from .launch import sm_count

# Rows a section's pairs may stream and still share L2 (50 MB on an H100, 60 on an H200): docs/tuning.md
CAUSAL_SECTION_KV_BYTES = 8 << 20
# The number of sections instead of the rule, or None (tests set it to exercise uneven sections)
CAUSAL_SECTIONS: int | None = None


class Varlen(NamedTuple):
    """Packed sequences for a launch on a batch of one: int32 (n + 1,) offsets into the rows of q and of k, and
    the longest sequence of each (the grid's size)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class Window(NamedTuple):
    """A launch's mask as the kernels take it: the CAUSAL and LOCAL flags and the (left, right) window sizes."""
    causal: bool  # the right side is bounded
    local: bool  # the left side is bounded
    left: int
    right: int


def window_mask(causal: bool, window_size: tuple[int, int] = (-1, -1)) -> Window:
    """The kernels' mask for ``causal`` and flash-attn's ``window_size`` (-1: unbounded; causal caps the right
    side at 0)."""
    left, right = window_size
    if causal:
        right = 0
    return Window(right >= 0, left >= 0, max(left, 0), max(right, 0))


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
def _visible(rows, cols, seq_k, causal_offset, CAUSAL: tl.constexpr, left_offset=0, LOCAL: tl.constexpr = False):
    """Which scores of query rows ``rows`` and keys ``cols`` (broadcastable index tiles, either orientation)
    exist: keys inside seq_k; if CAUSAL, on or below the right diagonal, j <= i + causal_offset (causal:
    causal_offset = seq_k - seq_q); if LOCAL, on or above the left one, j >= i + left_offset."""
    visible = cols < seq_k
    if CAUSAL:
        visible = visible & (cols <= rows + causal_offset)
    if LOCAL:
        visible = visible & (cols >= rows + left_offset)
    return visible


@triton.jit
def _window_key_range(start_m, seq_q, seq_k, right_offset, left_offset, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """(lo, full_lo, full_hi, hi): the keys a program with queries [start_m, start_m + BLOCK_M) visits under a
    window. [lo, full_lo) crosses the left diagonal (masked), [full_lo, full_hi) is seen by every row (no mask),
    [full_hi, hi) crosses the right diagonal or holds the ragged tail of seq_k (masked). Without LOCAL,
    lo = full_lo = 0 and this is ``_query_block_key_range``. VARLEN: a block past its sequence's seq_q visits
    nothing (the grid is sized for the longest sequence)."""
    mid, hi = _query_block_key_range(start_m, seq_k, right_offset, CAUSAL, BLOCK_M, BLOCK_N)
    lo = 0
    full_lo = 0
    if LOCAL:
        hi = tl.maximum(hi, 0)  # seq_q - seq_k beyond a block: no key at all, and no negative block to visit
        # keys seen by the block's first row: j >= start_m + left_offset
        lo = (tl.maximum(start_m + left_offset, 0) // BLOCK_N) * BLOCK_N
        # keys seen by its last row (so by every row): j >= start_m + BLOCK_M - 1 + left_offset
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + left_offset, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        mid = tl.maximum(mid, full_lo)
    if VARLEN:
        hi = tl.where(start_m < seq_q, hi, 0)
        lo = tl.minimum(lo, hi)
        full_lo = tl.minimum(full_lo, hi)
        mid = tl.minimum(mid, hi)
    return lo, full_lo, mid, hi


@triton.jit
def _window_query_range(start_n, seq_q, seq_k, right_offset, left_offset, CAUSAL: tl.constexpr,
                        LOCAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """(lo, mid, full_hi, hi): the query blocks a dK/dV program with keys [start_n, start_n + BLOCK_N) visits,
    in multiples of BLOCK_M. [lo, mid) crosses the right diagonal (masked), [mid, full_hi) sees every key of the
    block (no mask), [full_hi, hi) crosses the left diagonal or holds the ragged end of a packed sequence (masked).
    Without LOCAL or VARLEN, full_hi = hi and this is ``_dkdv_query_range``. VARLEN: a block past its sequence's
    seq_k visits nothing, and [mid, full_hi) holds whole query blocks only."""
    lo, mid, hi = _dkdv_query_range(start_n, seq_q, right_offset, CAUSAL, BLOCK_M, BLOCK_N)
    full_hi = hi
    if LOCAL:
        # rows that see the block's last key: i <= start_n + BLOCK_N - 1 - left_offset
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(start_n + BLOCK_N - left_offset, 0), BLOCK_M) * BLOCK_M)
        # rows that see its first key (so every key): i <= start_n - left_offset
        full_hi = (tl.maximum(start_n - left_offset + 1, 0) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(mid, hi)
        full_hi = tl.minimum(tl.maximum(full_hi, mid), hi)
    if VARLEN:
        hi = tl.where(start_n < seq_k, hi, 0)
        lo = tl.minimum(lo, hi)
        mid = tl.minimum(mid, hi)
        # only whole query blocks in the unmasked stage, which then loads without row masks: the sequence's ragged
        # end goes to the last, masked one
        full_hi = tl.minimum(tl.maximum(tl.minimum(full_hi, (seq_q // BLOCK_M) * BLOCK_M), mid), hi)
    return lo, mid, full_hi, hi


@triton.jit
def _sequence(CU_Q, CU_K, off_b, seq_q, seq_k, VARLEN: tl.constexpr):
    """(b, q_start, k_start, len_q, len_k): where this program's sequence lives. Dense: batch ``off_b`` of
    (seq_q, seq_k). VARLEN: sequence ``off_b`` of the packed rows, [CU_Q[b], CU_Q[b + 1]) and [CU_K[b], CU_K[b + 1])
    of a batch of one (b = 0; seq_q, seq_k: the packed totals); the grid's last index holds the rows past the last
    offsets, which see no key (``_tail_rows`` writes them)."""
    if VARLEN:
        last = tl.num_programs(2) - 1
        b = off_b * 0  # a batch of one; a tensor like off_b, so the caller's int64 casts work
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        in_tail = off_b == last
        len_q = tl.where(in_tail, q_start, tl.load(CU_Q + off_b + 1, mask=off_b < last, other=0)) - q_start
        len_k = tl.where(in_tail, k_start, tl.load(CU_K + off_b + 1, mask=off_b < last, other=0)) - k_start
    else:
        b = off_b
        q_start = 0
        k_start = 0
        len_q = seq_q
        len_k = seq_k
    return b, q_start, k_start, len_q, len_k


@triton.jit
def _tail_rows(CU, off_b, pid, seq, BLOCK: tl.constexpr):
    """(first, stop, step): the rows [CU[last], seq) past the last packed sequence that the program at ``pid`` of
    the grid's last batch index writes (zeros, or an LSE of -inf), BLOCK rows at a time; an empty range for every
    other program. Rows are strided over the grid's axis 0 so any tail length is covered."""
    last = tl.num_programs(2) - 1
    first = tl.load(CU + last) + pid * BLOCK
    stop = tl.where(off_b == last, seq, 0)
    return first, stop, BLOCK * tl.num_programs(0)


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
