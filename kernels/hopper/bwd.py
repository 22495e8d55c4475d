"""FlashAttention backward for Hopper (sm_90): five matmuls per block pair, warp-specialised, in Triton's Gluon.

The same gradients as ``attention_bwd`` (scores recomputed from the saved log2-domain LSE, delta from its
preprocess kernel), with one kernel instead of two. ``attention_bwd``'s dK/dV and dQ kernels each recompute
P and dP, seven matmuls per (key block, query block) pair; this kernel does the five the FLOP count knows of
and sums each pair's dQ share across key blocks in an fp32 buffer, as FlashAttention-2 and -3 do:

* **Partitions.** One CTA holds 128 keys of one (batch, head): two warpgroups of 64 keys each (K and V in
  shared memory, dK and dV in fp32 registers) and a 1-warp loader that streams Q and dO tiles of 64 query
  rows through a STAGES-deep ring with TMA (``ready`` / ``empty`` mbarriers).
* **Step t** (query block j), each warpgroup, on transposed tiles (keys x queries) as in ``attention_bwd``:
  S^T = K Q^T and dP^T = V dO^T issued together; P^T = exp2(S^T * qk_scale - lse); dV += P^T dO;
  dS^T = P^T (dP^T - delta), stored (input dtype) into the warpgroup's half of a shared (128 x 64) buffer;
  dK += dS^T Q.
* **dQ.** The warpgroup that owns step t (t % 2) multiplies the whole buffer, dQ_j = scale * dS K over the
  CTA's 128 keys (one m64 n64 k128 wgmma), while the other goes on to step t + 1. The buffer is
  double-buffered by step parity; named barriers (DS_READY: both halves written; DS_FREE: the owner has read
  it) order the two warpgroups.
* **The dQ sum.** The owner keeps its share in registers and adds it to the fp32 buffer during its next step,
  under that step's first two wgmmas, with fire-and-forget vector reductions (``red.global.add.v4.f32``):
  the adds leave the step the other warpgroup waits on. The buffer holds each 64-row block in the wgmma
  accumulator's fragment order (``_fragment_offsets``), in which one warp's ``red.v4`` covers 512 contiguous
  bytes; ``attention_bwd_hopper_dq_kernel`` turns it into dQ (times the softmax scale, input dtype, any
  strides) afterwards. The delta kernel zeroes the buffer beforehand (``backward_delta``).

The fp32 adds land in whatever order the CTAs reach them, so dQ is not bitwise reproducible from run to run
(dK and dV are: they sum in registers, in the order of the two-kernel backward). ``attention_bwd``
runs only where ``flashtrain.ops.dispatch`` sends a call, never under
``torch.use_deterministic_algorithms(True)``. Measured on an H200: docs/performance-notes.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..attention.bwd import backward_delta
from ..common import LOG2E, cdiv
from ..launch import launch_kernel, on_input_device
from ..masking import _key_block_coords, causal_sections
from .common import _named_barrier, ensure_scratch_allocator
from .tiles import hopper_bwd_meta

WG_KEYS = gl.constexpr(64)  # keys per warpgroup: one m64 wgmma
BLOCK_M = gl.constexpr(64)  # query rows per step (Q / dO tile); also the dQ buffer's block
DS_READY = gl.constexpr(8)  # named barriers 8, 9 (by step parity): both halves of dS^T written
DS_FREE = gl.constexpr(13)  # 13, 14: the owner has read its dS^T buffer; Gluon's partitions use the low ids


@gluon.jit
def _red_add_v4(ptrs, vals):
    """Fire-and-forget fp32 adds of four consecutive elements per instruction (``red``: nothing comes back,
    so no register waits for the round trip to L2, unlike ``atom``). The four values the asm packs are
    consecutive registers of the accumulator, which ``_fragment_offsets`` puts at consecutive addresses."""
    gl.inline_asm_elementwise(
        "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; "
        "red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [ptrs.to(gl.int64, bitcast=True), vals.to(gl.int32, bitcast=True)],
        dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _fragment_offsets(HEAD_DIM: gl.constexpr, acc_layout: gl.constexpr):
    """Where each element (r, c) of a 64 x HEAD_DIM wgmma accumulator goes in its block of the dQ buffer:
    warp w = r // 16 owns 16 * HEAD_DIM values; within them register group g (4 consecutive registers of a
    thread) of all 32 lanes is 128 contiguous floats, lane-major: one red.v4 of a warp = 512 bytes."""
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))[:, None]
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))[None, :]
    lane = (r % 8) * 4 + (c % 8) // 2
    reg = (c // 8) * 4 + ((r % 16) // 8) * 2 + c % 2  # the accumulator's register index of (r, c)
    return (r // 16) * (16 * HEAD_DIM) + (reg // 4) * 128 + lane * 4 + reg % 4


@gluon.jit
def _qdo_loader(q_desc, do_desc, q_smem, do_smem, ready, empty, j_start, n_qblocks, STAGES: gl.constexpr):
    """Loader partition: Q and dO tiles of query block j into ring slot (j - j_start) % STAGES once both
    warpgroups have freed it."""
    for t in range(n_qblocks - j_start):
        slot = t % STAGES
        # the first pass over the ring waits on parity 1 of fresh barriers, which counts as complete
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        row = (j_start + t) * BLOCK_M
        tma.async_copy_global_to_shared(q_desc, [row, 0], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [row, 0], ready.index(slot), do_smem.index(slot))


@gluon.jit
def _bwd_steps(j_lo, j_hi, j_start, n_steps, dk, dv, dq_pend, pend_row, k_all, k_wg, v_wg, q_smem, do_smem,
               ds_smem, ready, empty, LSE, DELTA, DQ, lse_row0, dq_row0, keys, seq_q, seq_k, qk_scale, sm_scale,
               MASK: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr,
               HEAD_DIM: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
               acc_layout: gl.constexpr, dtype: gl.constexpr):
    """Query blocks [j_lo, j_hi) of warpgroup WG (step t = j - j_start). MASK: the blocks that need P masked
    (the causal diagonal, keys past seq_k). dq_pend / pend_row: the share this warpgroup computed last as
    owner and has not added yet (pend_row < 0: none). Returns (dk, dv, dq_pend, pend_row)."""
    s_zero = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    col: gl.constexpr = gl.SliceLayout(0, s_layout)
    for j in range(j_lo, j_hi):
        t = j - j_start
        slot = t % STAGES
        buf = t % 2  # the dS^T buffer of this step, and the warpgroup that owns it
        rows = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col)
        lse = gl.load(LSE + lse_row0 + rows, mask=rows < seq_q, other=float("inf"))  # rows past seq_q: P = 0
        delta = gl.load(DELTA + lse_row0 + rows, mask=rows < seq_q, other=0.0)
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        st = warpgroup_mma(k_wg, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_wg, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if pend_row >= 0:  # last owner step's dQ share, added while the two products run
            _red_add_v4(DQ + pend_row * HEAD_DIM + _fragment_offsets(HEAD_DIM, acc_layout), dq_pend)
            pend_row = pend_row * 0 - 1
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))  # groups complete in order: S^T first
        pt = gl.exp2(st * qk_scale - lse[None, :])
        if MASK:
            visible = keys[:, None] < seq_k
            if CAUSAL:
                visible = visible & (keys[:, None] <= rows[None, :])
            pt = gl.where(visible, pt, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_smem.index(slot), dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        dst = (pt * (dpt - delta[None, :])).to(dtype)
        if buf != WG:
            if t >= 2:  # the other warpgroup, owner of step t - 2, has read this buffer
                _named_barrier(DS_FREE + 1 - WG, False)
        ds_smem.index(buf).slice(WG * WG_KEYS, WG_KEYS).store(dst)
        fence_async_shared()
        dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_smem.index(slot), dk, is_async=True)
        if buf == WG:  # owner: dQ_j over the CTA's 128 keys
            _named_barrier(DS_READY + WG, False)  # both halves of dS^T written
            dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_all, dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))  # every group done: dV, dK, dQ
            mbarrier.arrive(empty.index(slot), count=1)
            if t + 2 < n_steps:  # someone will write this buffer again
                _named_barrier(DS_FREE + WG, True)
            dq_pend = dq  # unscaled: the conversion kernel multiplies by the scale, once per element
            pend_row = dq_row0 + j * BLOCK_M
        else:
            _named_barrier(DS_READY + 1 - WG, True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        if buf != WG:
            mbarrier.arrive(empty.index(slot), count=1)
    return dk, dv, dq_pend, pend_row


@gluon.jit
def _bwd_warpgroup(k_desc, v_desc, k_all, q_smem, do_smem, ds_smem, ready, empty, LSE, DELTA, DQ, dk_base, dv_base,
                   stride_dkn, stride_dkd, stride_dvn, stride_dvd, lse_row0, dq_row0, seq_q, seq_k, start_n,
                   j_start, n_qblocks, qk_scale, sm_scale, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WG: gl.constexpr):
    """Warpgroup WG of the CTA whose keys start at start_n: keys [kn0, kn0 + 64), kn0 = start_n + 64 * WG,
    against query blocks [j_start, n_qblocks); then dK, dV of those keys."""
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    kn0 = start_n + WG * WG_KEYS
    k_wg = k_all.slice(WG * WG_KEYS, WG_KEYS)
    v_wg = gl.allocate_shared_memory(dtype, [WG_KEYS, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kn0, 0], kv_bar, k_wg)
    tma.async_copy_global_to_shared(v_desc, [kn0, 0], kv_bar, v_wg)
    keys = kn0 + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dq_pend = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    pend_row = dq_row0 * 0 - 1  # no share pending (int64, like the rows it will hold)
    mbarrier.wait(kv_bar, 0)
    mbarrier.invalidate(kv_bar)

    # stage 1: blocks crossing the causal diagonal (or any block, if some of these keys are past seq_k):
    # masked; stage 2: query blocks whose first row is at or past the warpgroup's last key: no mask
    j_free = j_start
    if CAUSAL:
        j_free = gl.minimum(gl.cdiv(kn0 + WG_KEYS - 1, BLOCK_M), n_qblocks)
    if kn0 + WG_KEYS > seq_k:  # keys past seq_k read as zeros: P must be masked on every step
        j_free = n_qblocks
    n_steps = n_qblocks - j_start
    dk, dv, dq_pend, pend_row = _bwd_steps(
        j_start, j_free, j_start, n_steps, dk, dv, dq_pend, pend_row, k_all, k_wg, v_wg, q_smem, do_smem, ds_smem,
        ready, empty, LSE, DELTA, DQ, lse_row0, dq_row0, keys, seq_q, seq_k, qk_scale, sm_scale, True, CAUSAL, WG,
        STAGES, HEAD_DIM, s_layout, a_layout, acc_layout, dtype)
    dk, dv, dq_pend, pend_row = _bwd_steps(
        j_free, n_qblocks, j_start, n_steps, dk, dv, dq_pend, pend_row, k_all, k_wg, v_wg, q_smem, do_smem,
        ds_smem, ready, empty, LSE, DELTA, DQ, lse_row0, dq_row0, keys, seq_q, seq_k, qk_scale, sm_scale, False,
        CAUSAL, WG, STAGES, HEAD_DIM, s_layout, a_layout, acc_layout, dtype)
    if pend_row >= 0:
        _red_add_v4(DQ + pend_row * HEAD_DIM + _fragment_offsets(HEAD_DIM, acc_layout), dq_pend)

    rows_o = kn0 + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(dk_base + rows_o[:, None].to(gl.int64) * stride_dkn + cols_o[None, :] * stride_dkd,
             (dk * sm_scale).to(dtype), mask=rows_o[:, None] < seq_k)
    gl.store(dv_base + rows_o[:, None].to(gl.int64) * stride_dvn + cols_o[None, :] * stride_dvd, dv.to(dtype),
             mask=rows_o[:, None] < seq_k)


@gluon.jit(do_not_specialize=["sections"])
def attention_bwd_hopper_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    seq_q, seq_k, qk_scale, sm_scale, sections,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """One program: 128 keys of one (batch, head). Grid (cdiv(seq_k, 128), H, B).

    Q, DO: (B, H, seq_q, D), K, V: (B, H, seq_k, D), unit stride along D; DK, DV like K, V. LSE (log2 domain)
    and DELTA: (B, H, seq_q) contiguous fp32. DQ: fp32, zero on entry, (B, H, cdiv(seq_q, 64) * 64, D) in
    fragment order per 64-row block (``_fragment_offsets``), without the softmax scale. qk_scale = scale *
    log2(e). Causal needs seq_q == seq_k; sections: its launch sections of the (batch, head) pairs
    (``masking.causal_sections``).
    """
    pid_n, off_h, off_b = _key_block_coords(sections, CAUSAL)  # causal: heaviest (first) key blocks first
    start_n = pid_n * (2 * WG_KEYS)
    dtype: gl.constexpr = Q.dtype.element_ty
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, HEAD_DIM], dtype)
    k_all_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * WG_KEYS, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * WG_KEYS, BLOCK_M], dtype)

    # per-(batch, head) descriptors: TMA zero-fills rows past seq_q / seq_k
    bb = off_b.to(gl.int64)
    hh = off_h.to(gl.int64)
    q_desc = tma.make_tensor_descriptor(Q + bb * stride_qb + hh * stride_qh, [seq_q, HEAD_DIM], [stride_qm, 1],
                                        [BLOCK_M, HEAD_DIM], tile_layout)
    do_desc = tma.make_tensor_descriptor(DO + bb * stride_dob + hh * stride_doh, [seq_q, HEAD_DIM],
                                         [stride_dom, 1], [BLOCK_M, HEAD_DIM], tile_layout)
    k_desc = tma.make_tensor_descriptor(K + bb * stride_kb + hh * stride_kh, [seq_k, HEAD_DIM], [stride_kn, 1],
                                        [WG_KEYS, HEAD_DIM], kv_layout)
    v_desc = tma.make_tensor_descriptor(V + bb * stride_vb + hh * stride_vh, [seq_k, HEAD_DIM], [stride_vn, 1],
                                        [WG_KEYS, HEAD_DIM], kv_layout)
    dk_base = DK + bb * stride_dkb + hh * stride_dkh
    dv_base = DV + bb * stride_dvb + hh * stride_dvh
    n_qblocks = gl.cdiv(seq_q, BLOCK_M)
    lse_row0 = (bb * gl.num_programs(1) + off_h) * seq_q
    dq_row0 = (bb * gl.num_programs(1) + off_h) * (n_qblocks * BLOCK_M)  # padded rows: no mask on the adds

    k_all = gl.allocate_shared_memory(dtype, [2 * WG_KEYS, HEAD_DIM], k_all_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * WG_KEYS, BLOCK_M], ds_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], tile_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # a slot is free once both warpgroups are done with it

    j_start = 0
    if CAUSAL:  # seq_q == seq_k: query i sees key j iff j <= i, so blocks before the CTA's first key see none
        j_start = gl.minimum(start_n // BLOCK_M, n_qblocks)
    # the warpgroup entries differ only in WG, their last argument (Triton 3.6 keeps constexprs only in
    # literal argument tuples, so the list is written out)
    gl.warp_specialize([
        (_bwd_warpgroup, (k_desc, v_desc, k_all, q_smem, do_smem, ds_smem, ready, empty, LSE, DELTA, DQ, dk_base,
                          dv_base, stride_dkn, stride_dkd, stride_dvn, stride_dvd, lse_row0, dq_row0, seq_q, seq_k,
                          start_n, j_start, n_qblocks, qk_scale, sm_scale, HEAD_DIM, STAGES, CAUSAL, 0)),
        (_bwd_warpgroup, (k_desc, v_desc, k_all, q_smem, do_smem, ds_smem, ready, empty, LSE, DELTA, DQ, dk_base,
                          dv_base, stride_dkn, stride_dkd, stride_dvn, stride_dvd, lse_row0, dq_row0, seq_q, seq_k,
                          start_n, j_start, n_qblocks, qk_scale, sm_scale, HEAD_DIM, STAGES, CAUSAL, 1)),
        (_qdo_loader, (q_desc, do_desc, q_smem, do_smem, ready, empty, j_start, n_qblocks, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@triton.jit
def attention_bwd_hopper_dq_kernel(
    DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, seq_q, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dQ from the Hopper kernel's buffer: one 64-row block, fragment order -> (rows, head_dim), times the
    softmax scale, cast to DQ's dtype. Grid (cdiv(seq_q, 64), H, B). DQ_ACC: (B, H, cdiv(seq_q, 64) * 64, D)
    fp32 contiguous."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, HEAD_DIM)[None, :]
    # _fragment_offsets of the Gluon kernel, for the same (r, c)
    lane = (r % 8) * 4 + (c % 8) // 2
    reg = (c // 8) * 4 + ((r % 16) // 8) * 2 + c % 2
    frag = (r // 16) * (16 * HEAD_DIM) + (reg // 4) * 128 + lane * 4 + reg % 4
    block = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * tl.num_programs(0) + pid_m
    dq = tl.load(DQ_ACC + block * (BLOCK_M * HEAD_DIM) + frag) * sm_scale
    rows = pid_m * BLOCK_M + r
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh + rows * stride_dqm
             + c * stride_dqd, dq.to(DQ.dtype.element_ty), mask=rows < seq_q)


def dq_from_fragments(dq_acc: torch.Tensor, dq: torch.Tensor, scale: float) -> None:
    """Write ``scale`` times the fragment-ordered fp32 buffer ``dq_acc`` (B, H, cdiv(N, 64) * 64, D) into ``dq``
    (B, H, N, D, any strides, its own dtype)."""
    batch, heads, seq_q, head_dim = dq.shape
    launch_kernel(
        attention_bwd_hopper_dq_kernel, (cdiv(seq_q, BLOCK_M.value), heads, batch),
        dq_acc, dq, *dq.stride(), seq_q, scale, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M.value, num_warps=4)


def dq_buffer(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised fp32 dQ buffer for q (B, H, N_q, D): (B, H, cdiv(N_q, 64) * 64, D), contiguous.
    ``attention_bwd`` has the delta kernel zero it (``backward_delta``)."""
    batch, heads, seq_q, head_dim = q.shape
    return torch.empty(batch, heads, cdiv(seq_q, BLOCK_M.value) * BLOCK_M.value, head_dim, device=q.device,
                       dtype=torch.float32)


@on_input_device
def attention_bwd_hopper(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, scale: float):
    """Launch the Hopper backward. Returns (dq, dk, dv) with ``attention.bwd.attention_bwd``'s meaning.

    do, q, out: (B, H, N_q, D), k, v: (B, H, N_k, D), inputs ``flashtrain.ops.dispatch`` sent here (fp16/bf16 on an
    sm_90 GPU, D in HOPPER_BWD_CONFIGS, no GQA, TMA-aligned strides, N_q == N_k when causal); lse: the forward's
    log2-domain LSE (B, H, N_q); dlse: the natural-log LSE's gradient or None.
    """
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    lse = lse.contiguous()
    dq_acc = dq_buffer(q)
    delta = backward_delta(out, do, dlse, lse, dq_acc)  # zeroes dq_acc too
    ensure_scratch_allocator()
    grid = (cdiv(seq_k, 2 * WG_KEYS.value), heads, batch)
    # a program streams Q and dO (with LSE and delta) of its (batch, head)
    sections = causal_sections(causal, batch * heads, grid[0], 1, seq_q, 2 * head_dim * q.element_size() + 8,
                               q.device)
    launch_kernel(
        attention_bwd_hopper_kernel, grid,
        q, k, v, do, lse, delta, dq_acc, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *do.stride()[:3], *dk.stride(), *dv.stride(), seq_q, seq_k, scale * LOG2E, scale, sections,
        HEAD_DIM=head_dim, CAUSAL=causal, **hopper_bwd_meta(head_dim), num_warps=4)
    dq_from_fragments(dq_acc, dq, scale)
    return dq, dk, dv
