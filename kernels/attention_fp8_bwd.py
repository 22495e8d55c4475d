"""FP8 (e4m3) attention backward: the four gradient matmuls on FP8 operands with per-tile scales.

With the forward's notation (S in the log2 domain, lse from the FP8 forward), per tile pair:
    P   = exp2(S - lse),         S recomputed from the FP8 Q and K tiles as in the forward
    dV += (P8^T dO8)  * (do_scale / 448)          P8 = round_e4m3(448 P), fixed scale as in the forward
    dP  = (dO8 V8^T)  * (do_scale * v_scale)
    dS  = P * (dP - delta)                        fp32; delta = rowsum(dO * O) - dlse (16-bit preprocess)
    dS8 = round_e4m3(dS / ds_scale)               ds_scale = amax(|dS tile|) / 448, per (query, key) tile
    dQ += (dS8 K8)    * (ds_scale * k_scale)      times the softmax scale at the end
    dK += (dS8^T Q8)  * (ds_scale * q_scale)
Q, K, V and dO are quantised once, all in tiles of the same BLOCK rows, so both kernels read the same
scales; a dS tile is quantised the same way in both (its amax does not depend on the orientation). dQ and
dK come out in the rotated space when the forward rotated Q and K; the caller maps them back.

The products that reduce over the sequence (dV, dK, dQ) read Q, K and dO from transposed copies, so every
FP8 tensor-core operand has its reduced dim contiguous and every tile in the loops is a pipelined async copy.

Two kernels as in the 16-bit backward, no atomics: ``attention_fp8_bwd_dkdv_kernel`` (key tile resident,
GQA group summed in registers) and ``attention_fp8_bwd_dq_kernel`` (query tile resident). Causal tiles
above the diagonal are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .attention_bwd import backward_delta
from .attention_fwd import LOG2E, _load_rows
from .fp8_quant import _quantize_tile, _to_e4m3, fp8_quantize, quantize_scores_operands


@triton.jit
def _load_cols(base, cols, seq, offs_d, DIM: tl.constexpr):
    """(BLOCK_D, BLOCK) tile of a transposed (DIM, seq) matrix at ``base``: columns ``cols``, zero-padded."""
    return tl.load(base + offs_d[:, None] * seq + cols[None, :], mask=(offs_d[:, None] < DIM) & (cols[None, :] < seq),
                   other=0.0)


@triton.jit
def attention_fp8_bwd_dkdv_kernel(
    Q8, QT8, QS, K8, KT8, KS, V8, VS, DO8, DOT8, DOS, LSE, DELTA, DK, DV,
    seq_q, seq_k, qk_scale, sm_scale,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: BLOCK keys of one (batch, KV head). Grid (cdiv(seq_k, BLOCK), H_kv, B).

    Q8 (B, H_q, seq_q, QK_DIM), K8 (B, H_kv, seq_k, QK_DIM), V8 (B, H_kv, seq_k, HEAD_DIM), DO8 (B, H_q,
    seq_q, HEAD_DIM): e4m3, contiguous, with fp32 scales QS, KS, VS, DOS per (batch, head, tile of BLOCK
    rows). QT8, KT8, DOT8: the same Q8, K8, DO8 transposed, (B, H, dim, seq), for the products that reduce over
    the sequence (FP8 tensor cores read both operands with the reduced dim contiguous; from Q8 itself Triton
    stages the tile through registers into a second shared-memory layout, unpipelined). LSE (log2 domain),
    DELTA: (B, H_q, seq_q) fp32. DK (B, H_kv, seq_k, QK_DIM) and DV (B, H_kv, seq_k, HEAD_DIM): fp32, contiguous.
    """
    pid_n = tl.program_id(0)
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    heads_kv = tl.num_programs(1)
    heads_q = heads_kv * GROUP
    tiles_q = tl.cdiv(seq_q, BLOCK)
    tiles_k = tl.cdiv(seq_k, BLOCK)
    start_n = pid_n * BLOCK
    offs_n = start_n + tl.arange(0, BLOCK)
    offs_m = tl.arange(0, BLOCK)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)

    head_kv = off_b.to(tl.int64) * heads_kv + off_hk
    k = _load_rows(K8 + (head_kv * seq_k + offs_n[:, None]) * QK_DIM + offs_dk[None, :],
                   offs_n, seq_k, offs_dk, QK_DIM, BLOCK_DK, True)
    v = _load_rows(V8 + (head_kv * seq_k + offs_n[:, None]) * HEAD_DIM + offs_dv[None, :],
                   offs_n, seq_k, offs_dv, HEAD_DIM, BLOCK_DV, True)
    k_scale = tl.load(KS + head_kv * tiles_k + pid_n)
    v_scale = tl.load(VS + head_kv * tiles_k + pid_n)
    dk = tl.zeros([BLOCK, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)

    causal_offset = seq_k - seq_q
    lo = 0
    if CAUSAL:  # first query tile with a row that sees key start_n
        lo = (tl.maximum(start_n - causal_offset, 0) // BLOCK) * BLOCK
    for g in range(GROUP):
        head_q = off_b.to(tl.int64) * heads_q + off_hk * GROUP + g
        for start_m in range(lo, seq_q, BLOCK):
            rows = start_m + offs_m
            tile_m = start_m // BLOCK
            q = _load_rows(Q8 + (head_q * seq_q + rows[:, None]) * QK_DIM + offs_dk[None, :],
                           rows, seq_q, offs_dk, QK_DIM, BLOCK_DK, True)
            do = _load_rows(DO8 + (head_q * seq_q + rows[:, None]) * HEAD_DIM + offs_dv[None, :],
                            rows, seq_q, offs_dv, HEAD_DIM, BLOCK_DV, True)
            qt = _load_cols(QT8 + head_q * QK_DIM * seq_q, rows, seq_q, offs_dk, QK_DIM)  # (BLOCK_DK, BLOCK)
            do_t = _load_cols(DOT8 + head_q * HEAD_DIM * seq_q, rows, seq_q, offs_dv, HEAD_DIM)  # (BLOCK_DV, BLOCK)
            q_scale = tl.load(QS + head_q * tiles_q + tile_m)
            do_scale = tl.load(DOS + head_q * tiles_q + tile_m)
            lse2 = tl.load(LSE + head_q * seq_q + rows, mask=rows < seq_q, other=float("inf"))
            lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows that see no key: P = 0
            delta = tl.load(DELTA + head_q * seq_q + rows, mask=rows < seq_q, other=0.0)
            # P^T, (BLOCK keys, BLOCK queries)
            s_t = tl.dot(k, tl.trans(q)) * (k_scale * q_scale * qk_scale)
            p_t = tl.exp2(s_t - lse2[None, :])
            visible = (offs_n[:, None] < seq_k) & (rows[None, :] < seq_q)
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + causal_offset)
            p_t = tl.where(visible, p_t, 0.0)
            p8_t = _to_e4m3(p_t * 448.0)
            dv += tl.dot(p8_t, tl.trans(do_t)) * (do_scale / 448.0)
            dp_t = tl.dot(v, tl.trans(do)) * (v_scale * do_scale)
            ds8_t, ds_scale = _quantize_tile(p_t * (dp_t - delta[None, :]), False)
            dk += tl.dot(ds8_t, tl.trans(qt)) * (ds_scale * q_scale)

    rows_ok = offs_n[:, None] < seq_k
    tl.store(DK + (head_kv * seq_k + offs_n[:, None]) * QK_DIM + offs_dk[None, :], dk * sm_scale,
             mask=rows_ok & (offs_dk[None, :] < QK_DIM))
    tl.store(DV + (head_kv * seq_k + offs_n[:, None]) * HEAD_DIM + offs_dv[None, :], dv,
             mask=rows_ok & (offs_dv[None, :] < HEAD_DIM))


@triton.jit
def attention_fp8_bwd_dq_kernel(
    Q8, QT8, QS, K8, KT8, KS, V8, VS, DO8, DOT8, DOS, LSE, DELTA, DQ,
    seq_q, seq_k, qk_scale, sm_scale,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: BLOCK query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK), H_q, B).
    Tensors as in the dK/dV kernel; DQ (B, H_q, seq_q, QK_DIM) fp32, contiguous."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    heads_q = tl.num_programs(1)
    tiles_q = tl.cdiv(seq_q, BLOCK)
    tiles_k = tl.cdiv(seq_k, BLOCK)
    start_m = pid_m * BLOCK
    rows = start_m + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)

    head_q = off_b.to(tl.int64) * heads_q + off_h
    head_kv = off_b.to(tl.int64) * (heads_q // GROUP) + off_h // GROUP
    q = _load_rows(Q8 + (head_q * seq_q + rows[:, None]) * QK_DIM + offs_dk[None, :],
                   rows, seq_q, offs_dk, QK_DIM, BLOCK_DK, True)
    do = _load_rows(DO8 + (head_q * seq_q + rows[:, None]) * HEAD_DIM + offs_dv[None, :],
                    rows, seq_q, offs_dv, HEAD_DIM, BLOCK_DV, True)
    q_scale = tl.load(QS + head_q * tiles_q + pid_m)
    do_scale = tl.load(DOS + head_q * tiles_q + pid_m)
    lse2 = tl.load(LSE + head_q * seq_q + rows, mask=rows < seq_q, other=float("inf"))
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(DELTA + head_q * seq_q + rows, mask=rows < seq_q, other=0.0)
    dq = tl.zeros([BLOCK, BLOCK_DK], dtype=tl.float32)

    causal_offset = seq_k - seq_q
    hi = seq_k
    if CAUSAL:  # keys seen by the tile's last row
        hi = tl.maximum(tl.minimum(seq_k, start_m + BLOCK + causal_offset), 0)
    for start_n in range(0, hi, BLOCK):
        cols = start_n + offs_n
        tile_n = start_n // BLOCK
        k = _load_rows(K8 + (head_kv * seq_k + cols[:, None]) * QK_DIM + offs_dk[None, :],
                       cols, seq_k, offs_dk, QK_DIM, BLOCK_DK, True)
        v = _load_rows(V8 + (head_kv * seq_k + cols[:, None]) * HEAD_DIM + offs_dv[None, :],
                       cols, seq_k, offs_dv, HEAD_DIM, BLOCK_DV, True)
        kt = _load_cols(KT8 + head_kv * QK_DIM * seq_k, cols, seq_k, offs_dk, QK_DIM)  # (BLOCK_DK, BLOCK)
        k_scale = tl.load(KS + head_kv * tiles_k + tile_n)
        v_scale = tl.load(VS + head_kv * tiles_k + tile_n)
        s = tl.dot(q, tl.trans(k)) * (q_scale * k_scale * qk_scale)
        p = tl.exp2(s - lse2[:, None])
        visible = (cols[None, :] < seq_k) & (rows[:, None] < seq_q)
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + causal_offset)
        p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v)) * (do_scale * v_scale)
        ds8, ds_scale = _quantize_tile(p * (dp - delta[:, None]), False)
        dq += tl.dot(ds8, tl.trans(kt)) * (ds_scale * k_scale)

    tl.store(DQ + (head_q * seq_q + rows[:, None]) * QK_DIM + offs_dk[None, :], dq * sm_scale,
             mask=(rows[:, None] < seq_q) & (offs_dk[None, :] < QK_DIM))


@configs.on_input_device
def attention_fp8_bwd(do, q, k, v, out, lse, dlse, causal: bool, scale: float, signs=None, k_mean=None):
    """Launch the FP8 backward. Returns (dq, dk, dv) in fp32: dq, dk with respect to the scores' Q and K
    (rotated, (B, H, N, D'), when ``signs`` is given, as in the forward), dv like v.

    q, do, out: (B, H_q, N_q, D); k, v: (B, H_kv, N_k, D); lse: (B, H_q, N_q) log2-domain fp32 from the FP8
    forward; dlse: the gradient of the natural-log LSE or None. ``signs`` and ``k_mean``: the forward's
    rotation and K smoothing, applied to Q and K as there (``quantize_scores_operands``).
    """
    batch, heads_q, seq_q, head_dim = do.shape
    heads_kv, seq_k = v.shape[1], v.shape[2]
    qk_dim = head_dim if signs is None else signs.numel()
    dq = torch.zeros((batch, heads_q, seq_q, qk_dim), device=do.device, dtype=torch.float32)
    dk = torch.zeros((batch, heads_kv, seq_k, qk_dim), device=do.device, dtype=torch.float32)
    dv = torch.zeros((batch, heads_kv, seq_k, head_dim), device=do.device, dtype=torch.float32)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    cfg = configs.fp8_bwd_config(max(seq_q, seq_k))
    block = cfg["BLOCK"]
    lse = lse.contiguous()
    delta = backward_delta(out, do, dlse, lse)
    q8, q_scales, k8, k_scales = quantize_scores_operands(q, k, block, block, signs, k_mean)
    v8, v_scales = fp8_quantize(v, block)
    do8, do_scales = fp8_quantize(do, block)
    meta = dict(GROUP=heads_q // heads_kv, QK_DIM=qk_dim, HEAD_DIM=head_dim, BLOCK_DK=configs.fp8_block_d(qk_dim),
                BLOCK_DV=configs.fp8_block_d(head_dim), CAUSAL=causal, **cfg)
    q8_t, k8_t, do8_t = (x.transpose(2, 3).contiguous() for x in (q8, k8, do8))  # (B, H, dim, seq)
    tensors = (q8, q8_t, q_scales, k8, k8_t, k_scales, v8, v_scales, do8, do8_t, do_scales, lse, delta)
    scalars = (seq_q, seq_k, scale * LOG2E, scale)
    attention_fp8_bwd_dkdv_kernel[(configs.cdiv(seq_k, block), heads_kv, batch)](*tensors, dk, dv, *scalars, **meta)
    attention_fp8_bwd_dq_kernel[(configs.cdiv(seq_q, block), heads_q, batch)](*tensors, dq, *scalars, **meta)
    return dq, dk, dv
