"""FlashAttention forward for Hopper (sm_90): warp-specialised, written in Triton's Gluon dialect.

The same computation as ``attention/fwd.py`` (online softmax in the log2 domain, fp32 accumulators, the same
bottom-right causal alignment, the same log2-domain LSE), scheduled by hand the way FlashAttention-3 does it,
which plain Triton 3.6 cannot express for this loop:

* **Warp specialisation.** A 1-warp loader partition streams K and V blocks of BLOCK_N keys into a
  STAGES-deep ring of shared-memory buffers with TMA (``ready`` / ``empty`` mbarriers); CONSUMERS softmax
  warpgroups (4 warps each) own 64 query rows apiece, so one CTA covers 64 * CONSUMERS rows. The loader has
  few registers; the warpgroups take the rest (``setmaxnreg``; ``tiles.HOPPER_FWD_CONFIGS`` holds the counts).
* **Intra-warpgroup overlap.** In step j a warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together
  and runs the softmax of S_j while P_{j-1} V_{j-1} is still on the tensor cores.
* **Ping-pong** (PINGPONG): the warpgroups take turns to issue their MMAs (named barriers), so one
  warpgroup's softmax runs under another's matmuls instead of all of them waiting on the tensor cores at once.

Per key block a warpgroup's work splits like the Triton forward's:
  stage 1 (off-band): blocks every one of its rows sees in full: no mask;
  stage 2 (on-band):  blocks crossing its diagonal, and the ragged tail of seq_k: elementwise mask.
Blocks past the CTA's last diagonal are never loaded. All warpgroups of a CTA step through the same blocks
(a block a warpgroup's rows cannot see comes out as p = 0), which keeps the ping-pong turns paired.

Tiles come in through per-(batch, head) TMA descriptors built on the device (so any strides TMA accepts
work, and rows past seq_q / seq_k read as zeros); that needs Triton's global scratch allocator, which the
launcher provides. Measured on an H200 against the Triton forward (docs/performance-notes.md): faster on long
sequences and at head_dim 128, slower on short ones, so ``flashtrain.ops.dispatch`` sends calls here only where
the measurements say so (``HOPPER_FWD_MIN_SEQ``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ..common import LOG2E, allocate_outputs, cdiv
from ..launch import launch_kernel, on_input_device
from ..masking import _query_block_coords, causal_sections
from .common import (WG_ROWS, _finish_q_load, _kv_loader, _masked_scores, _pass_turn, _start_q_load, _unmasked_blocks,
                     _wait_turn, ensure_scratch_allocator)
from .tiles import hopper_fwd_meta

@gluon.jit
def _softmax_step(s, m_i, l_i, rows, start_n, seq_k, causal_offset, qk_scale, MASK: gl.constexpr,
                  CAUSAL: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """One key block of the online softmax on the scores s (64, BLOCK_N): returns (P as the A operand of the
    P V product, new row max, new row sum, the factor alpha that rescales the running output)."""
    if MASK:
        s = _masked_scores(s, rows, start_n, seq_k, causal_offset, CAUSAL, s_layout, BLOCK_N)
    # log2 domain: qk_scale = scale / ln(2) > 0, so max(s) * qk_scale = max(s * qk_scale), and each exponent
    # is one FFMA (s * qk_scale - m) instead of a multiply and a subtract
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _attend_blocks(lo, hi, p, m_i, l_i, acc, q_smem, k_smem, v_smem, ready, empty, rows, n_blocks, seq_k,
                   causal_offset, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                   CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr, dtype: gl.constexpr):
    """Key blocks [lo, hi) of one softmax warpgroup. Step j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight
    together, the softmax of S_j under the latter, then slot j - 1 handed back to the loader. Returns the
    state after block hi - 1 (p: its P, not yet multiplied by V)."""
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    for j in range(lo, hi):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        _wait_turn(j, WG, PINGPONG)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        _pass_turn(j, n_blocks, WG, CONSUMERS, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # groups complete in order: S_j first
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, j * BLOCK_N, seq_k, causal_offset, qk_scale, MASK,
                                           CAUSAL, s_layout, p_layout, dtype, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(prev), count=1)  # slot prev's K and V are no longer read
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return p, m_i, l_i, acc


@gluon.jit
def _output_bases(O, LSE, stride_ob, stride_oh, seq_q, sections, CAUSAL: gl.constexpr):
    """This program's output rows and LSE row, from its block coordinates computed again where they are stored:
    taken before the main loop, as the causal launch sections made them (computed, no longer the program ids
    that ptxas can read again at the end), the two 64-bit bases stayed live through it and spilled (head_dim 64:
    204 bytes of spill stores; its causal 16k forward 2.33 -> 2.57 ms)."""
    _, off_h, off_b = _query_block_coords(sections, CAUSAL)
    o_base = O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
    lse_base = LSE + (off_b.to(gl.int64) * gl.num_programs(1) + off_h) * seq_q
    return o_base, lse_base


@gluon.jit
def _softmax_warpgroup(q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om, stride_od,
                       seq_q, seq_k, cta_start_m, n_blocks, causal_offset, qk_scale, sections,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Softmax warpgroup WG of the CTA whose rows start at cta_start_m: query rows [start_m, start_m + 64),
    start_m = cta_start_m + 64 * WG, against key blocks [0, n_blocks). O, LSE: the kernel's; its (batch, head)
    rows are found again after the main loop (``_output_bases``)."""
    start_m = cta_start_m + WG * WG_ROWS
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem, q_bar = _start_q_load(q_desc, start_m, HEAD_DIM)
    n_free = _unmasked_blocks(start_m, seq_k, causal_offset, BLOCK_N, CAUSAL)
    rows = start_m + gl.arange(0, WG_ROWS, layout=row_s)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_s)
    _finish_q_load(q_bar)

    # block 0: scores and softmax only; its P V product is issued with block 1's scores
    mbarrier.wait(ready.index(0), 0)
    _wait_turn(0, WG, PINGPONG)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(0, n_blocks, WG, CONSUMERS, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    if n_free > 0:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, seq_k, causal_offset, qk_scale, False, CAUSAL,
                                           s_layout, p_layout, dtype, BLOCK_N)
    else:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, seq_k, causal_offset, qk_scale, True, CAUSAL,
                                           s_layout, p_layout, dtype, BLOCK_N)
    # stage 1: off-band, no mask; stage 2: on-band (the diagonal, the ragged tail of seq_k), masked
    p, m_i, l_i, acc = _attend_blocks(1, n_free, p, m_i, l_i, acc, q_smem, k_smem, v_smem, ready, empty, rows,
                                      n_blocks, seq_k, causal_offset, qk_scale, False, CAUSAL, WG, CONSUMERS,
                                      PINGPONG, STAGES, BLOCK_N, s_layout, p_layout, row_o, dtype)
    p, m_i, l_i, acc = _attend_blocks(gl.maximum(n_free, 1), n_blocks, p, m_i, l_i, acc, q_smem, k_smem, v_smem,
                                      ready, empty, rows, n_blocks, seq_k, causal_offset, qk_scale, True, CAUSAL,
                                      WG, CONSUMERS, PINGPONG, STAGES, BLOCK_N, s_layout, p_layout, row_o, dtype)
    last = (n_blocks - 1) % STAGES
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(last), count=1)

    # every row sees at least one key (the launcher routes causal seq_q > seq_k elsewhere), so l_i > 0
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    rows_o = start_m + gl.arange(0, WG_ROWS, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_base, lse_base = _output_bases(O, LSE, stride_ob, stride_oh, seq_q, sections, CAUSAL)
    gl.store(o_base + rows_o[:, None].to(gl.int64) * stride_om + cols_o[None, :] * stride_od, out.to(dtype),
             mask=rows_o[:, None] < seq_q)
    gl.store(lse_base + rows, m_i + gl.log2(l_i), mask=rows < seq_q)


@gluon.jit(do_not_specialize=["sections"])
def attention_fwd_hopper_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_od,
    seq_q, seq_k, qk_scale, sections,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """One program: 64 * CONSUMERS query rows of one (batch, head). Grid (cdiv(seq_q, 64 * CONSUMERS), H_q, B).

    Q: (B, H_q, seq_q, D), K, V: (B, H_q / GROUP, seq_k, D), O like Q: last dims contiguous (stride 1 for
    Q, K, V), other strides as given; LSE (B, H_q, seq_q) contiguous float32, log2 domain.
    qk_scale = softmax scale * log2(e).
    """
    BLOCK_M: gl.constexpr = WG_ROWS * CONSUMERS
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = Q.dtype.element_ty

    # per-(batch, head) descriptors: TMA zero-fills rows past seq_q / seq_k
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh,
                                        [seq_q, HEAD_DIM], [stride_qm, 1], [WG_ROWS, HEAD_DIM], q_layout)
    k_desc = tma.make_tensor_descriptor(K + off_b.to(gl.int64) * stride_kb + off_hk.to(gl.int64) * stride_kh,
                                        [seq_k, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM], kv_layout)
    v_desc = tma.make_tensor_descriptor(V + off_b.to(gl.int64) * stride_vb + off_hk.to(gl.int64) * stride_vh,
                                        [seq_k, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM], kv_layout)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # a slot is free once every warpgroup is done with it

    # key blocks this CTA visits: up to the last row's diagonal when causal
    causal_offset = seq_k - seq_q
    n_blocks = gl.cdiv(seq_k, BLOCK_N)
    if CAUSAL:
        n_blocks = gl.minimum(gl.cdiv(start_m + BLOCK_M + causal_offset, BLOCK_N), n_blocks)
    # the warpgroup entries differ only in WG, their last argument (Triton 3.6 keeps constexprs only in
    # literal argument tuples, so the lists are written out)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_softmax_warpgroup, (q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om,
                                  stride_od, seq_q, seq_k, start_m, n_blocks, causal_offset, qk_scale, sections,
                                  HEAD_DIM, BLOCK_N, STAGES, CAUSAL, CONSUMERS, PINGPONG, 0)),
            (_softmax_warpgroup, (q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om,
                                  stride_od, seq_q, seq_k, start_m, n_blocks, causal_offset, qk_scale, sections,
                                  HEAD_DIM, BLOCK_N, STAGES, CAUSAL, CONSUMERS, PINGPONG, 1)),
            (_kv_loader, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_blocks, BLOCK_N, STAGES, False)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.static_assert(CONSUMERS == 3, "CONSUMERS is 2 or 3")
        gl.warp_specialize([
            (_softmax_warpgroup, (q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om,
                                  stride_od, seq_q, seq_k, start_m, n_blocks, causal_offset, qk_scale, sections,
                                  HEAD_DIM, BLOCK_N, STAGES, CAUSAL, CONSUMERS, PINGPONG, 0)),
            (_softmax_warpgroup, (q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om,
                                  stride_od, seq_q, seq_k, start_m, n_blocks, causal_offset, qk_scale, sections,
                                  HEAD_DIM, BLOCK_N, STAGES, CAUSAL, CONSUMERS, PINGPONG, 1)),
            (_softmax_warpgroup, (q_desc, k_smem, v_smem, ready, empty, O, LSE, stride_ob, stride_oh, stride_om,
                                  stride_od, seq_q, seq_k, start_m, n_blocks, causal_offset, qk_scale, sections,
                                  HEAD_DIM, BLOCK_N, STAGES, CAUSAL, CONSUMERS, PINGPONG, 2)),
            (_kv_loader, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_blocks, BLOCK_N, STAGES, False)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


@on_input_device
def attention_fwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Launch the Hopper forward. Returns (out, lse) with ``attention.fwd.attention_fwd``'s meaning.

    q: (B, H_q, N_q, D), k/v: (B, H_kv, N_k, D), inputs ``flashtrain.ops.dispatch`` sent here (fp16/bf16 on an
    sm_90 GPU, D in HOPPER_FWD_CONFIGS, TMA-aligned strides, N_q <= N_k when causal, scale > 0).
    """
    out, lse, done = allocate_outputs(q, k)
    if done:
        return out, lse
    batch, heads_q, seq_q, head_dim = q.shape
    meta = hopper_fwd_meta(head_dim, causal)
    ensure_scratch_allocator()
    grid = (cdiv(seq_q, WG_ROWS.value * meta["CONSUMERS"]), heads_q, batch)
    launch_kernel(
        attention_fwd_hopper_kernel, grid,
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride(),
        seq_q, k.shape[2], scale * LOG2E,
        causal_sections(causal, batch * heads_q, grid[0], heads_q // k.shape[1], k.shape[2],
                        2 * head_dim * k.element_size(), q.device),
        GROUP=heads_q // k.shape[1], HEAD_DIM=head_dim, CAUSAL=causal, **meta, num_warps=4)
    return out, lse
