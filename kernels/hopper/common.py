"""Gluon pieces the Hopper (sm_90) kernels share: the TMA loader partition of K and V, named barriers and the
ping-pong turns between softmax warpgroups, the Q tile's load, the masked scores of an on-band step, and the global
scratch allocator that device-side TMA descriptors need.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.runtime._allocation import NullAllocator, _allocator

WG_ROWS = gl.constexpr(64)  # query rows per softmax warpgroup: one m64 wgmma
FIRST_TURN_BARRIER = gl.constexpr(10)  # named barriers 10.. for the ping-pong; Gluon's partitions use the low ids


@gluon.jit
def _kv_loader(k_desc, v_desc, k_smem, v_smem, ready, empty, n_blocks,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_TRANSPOSED: gl.constexpr):
    """Loader partition: K and V block j into ring slot j % STAGES once every warpgroup has freed it.
    V_TRANSPOSED: v_desc addresses V^T (head_dim, seq_k), the FP8 forward's K-major V."""
    for j in range(n_blocks):
        slot = j % STAGES
        # the first pass over the ring waits on parity 1 of fresh barriers, which counts as complete
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], ready.index(slot), k_smem.index(slot))
        if V_TRANSPOSED:
            tma.async_copy_global_to_shared(v_desc, [0, j * BLOCK_N], ready.index(slot), v_smem.index(slot))
        else:
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _named_barrier(BAR_ID: gl.constexpr, ARRIVE: gl.constexpr):
    """``bar.sync`` (wait) or ``bar.arrive`` (signal) on named barrier BAR_ID, counted over 256 threads: one
    warpgroup waiting and the one signalling it (the forward's ping-pong turns, the backward's dS^T hand-over)."""
    one_per_thread: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    op: gl.constexpr = "bar.arrive" if ARRIVE else "bar.sync"
    gl.inline_asm_elementwise(f"mov.u32 $0, $1; {op} {BAR_ID}, 256;", "=r,r",
                              [gl.full([128], 0, gl.int32, layout=one_per_thread)], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _wait_turn(j, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Before warpgroup WG issues the MMAs of step j: wait until the previous warpgroup has issued its own."""
    if PINGPONG:
        if WG == 0:
            if j > 0:  # warpgroup 0 takes the very first turn unasked
                _named_barrier(FIRST_TURN_BARRIER, False)
        else:
            _named_barrier(FIRST_TURN_BARRIER + WG, False)


@gluon.jit
def _pass_turn(j, n_blocks, WG: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """After warpgroup WG has issued the MMAs of step j: hand the turn to the next warpgroup."""
    if PINGPONG:
        if WG == CONSUMERS - 1:
            if j < n_blocks - 1:  # after the last warpgroup's last step nobody waits
                _named_barrier(FIRST_TURN_BARRIER, True)
        else:
            _named_barrier(FIRST_TURN_BARRIER + WG + 1, True)


@gluon.jit
def _start_q_load(q_desc, start_m, WIDTH: gl.constexpr):
    """Issue the TMA load of a softmax warpgroup's Q tile, rows [start_m, start_m + WG_ROWS) of width WIDTH, into
    shared memory; returns (q_smem, q_bar) for ``_finish_q_load``."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WG_ROWS, WIDTH], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    return q_smem, q_bar


@gluon.jit
def _finish_q_load(q_bar):
    """Wait for ``_start_q_load``'s tile and retire its barrier."""
    mbarrier.wait(q_bar, 0)
    mbarrier.invalidate(q_bar)


@gluon.jit
def _unmasked_blocks(start_m, seq_k, causal_offset, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key blocks [0, n) need no mask for a warpgroup whose first row is start_m: the last key of block j,
    (j + 1) * BLOCK_N - 1, is < seq_k and (causal) <= start_m + causal_offset."""
    n_free = seq_k // BLOCK_N
    if CAUSAL:
        n_free = gl.minimum((start_m + causal_offset + 1) // BLOCK_N, n_free)
    return n_free


@gluon.jit
def _masked_scores(s, rows, start_n, seq_k, causal_offset, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """The scores s (64, BLOCK_N) of keys [start_n, start_n + BLOCK_N) for query rows ``rows``, -inf where a key
    is past seq_k or (CAUSAL) after the row's diagonal: what the on-band softmax steps see."""
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    visible = cols[None, :] < seq_k
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + causal_offset)
    return gl.where(visible, s, float("-inf"))


def _scratch(size: int, alignment: int, stream):
    """Triton's global scratch for the device-side TMA descriptors (128 bytes each, a few per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton a scratch allocator for device-side descriptors where none is set. Only Triton's
    NullAllocator (which would raise at launch) is replaced, never an allocator the user set; the allocator
    is per context (thread), so the Hopper launchers call this on every launch."""
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch)
