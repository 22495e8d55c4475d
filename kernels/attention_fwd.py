"""FlashAttention forward: tiled online softmax, never materialising the (seq_q, seq_k) score matrix.

Loop order is FlashAttention-2's: one program owns a block of BLOCK_M query rows of one (batch, head)
and streams the K/V blocks of that head's KV group past it, keeping a running row max ``m_i``, a running
row sum ``l_i`` and an unnormalised output ``acc`` in fp32 (fp64 for fp64 inputs). Scores are kept in
the log2 domain (log2(e) folded into the softmax scale) so each exponential is one ``exp2``.

Causal masks are aligned bottom-right like flash-attn: query i sees key j iff j <= i + (seq_k - seq_q).
Per query block the key range splits into
  stage 1 (off-band): keys every row of the block sees: no mask at all;
  stage 2 (on-band):  blocks crossing the diagonal and the ragged tail of seq_k: elementwise mask;
and key blocks entirely above the diagonal are never visited.

On an sm_90 GPU, fp16/bf16 inputs of a head_dim in ``configs.HOPPER_FWD_CONFIGS`` and long enough sequences
run the warp-specialised kernel of attention_fwd_hopper.py instead: same results up to fp32 summation order,
faster there (``hopper_forward_applies`` says when).

Two optional features, compiled in only when used (constexpr flags, so the plain kernel is unchanged):
  * a per-key additive bias (HAS_KEY_BIAS), (B, seq_k): key padding masks, -inf at padded keys (or any
    float key_padding_mask as nn.MultiheadAttention adds it to the scores); the key block's slice is loaded
    beside K and added to its scores, in both stages. Nothing (seq_q, seq_k)-sized is built.
  * attention dropout (DROPOUT): each probability P[b, h, i, j] is kept iff its Philox uniform under
    ``seed`` (a fixed function of (b, h, i, j): see ``_dropout_keep``) is >= p, and kept ones are scaled by
    1 / (1 - p) (applied once, to the output). The row sums and the LSE are of the undropped P, so the
    backward regenerates the same mask from (seed, counter) and needs no stored bits.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import torch
import triton
import triton.language as tl

from . import configs

LOG2E = 1.4426950408889634  # 1/ln(2): e^x = 2^(x * log2(e))


@functools.lru_cache(maxsize=256)
def split_scale(scale: float) -> tuple[float, float]:
    """(hi, lo) float32 pair with hi + lo = scale to ~2^-48: Triton passes every Python float to a kernel
    as float32, so fp64 kernels rebuild an fp64 scale from the pair (see ``_scale``). Cached: a launch's host
    time, and a few scales recur."""
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


@triton.jit
def _query_block_coords(sections, CAUSAL: tl.constexpr):
    """(query block, head, batch) of this program in a grid (cdiv(seq_q, BLOCK_M), H_q, B).

    Without a mask the grid's own order: the query blocks of one head are launched together and share its K and
    V in L2. Causal, where block i sees i + 1 key blocks, the launch order is remapped: the (batch, head) pairs are
    split into ``sections`` runs of consecutive pairs as even as can be (``configs.causal_sections``: the first
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
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; zero-fill rows >= n_rows (if MASK_ROWS) and columns >= HEAD_DIM."""
    if MASK_ROWS:
        if HEAD_DIM == BLOCK_D:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


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
def _scale(x, scale, scale_lo):
    """x * scale, where (scale, scale_lo) is ``split_scale``'s pair: fp64 uses both halves."""
    if x.dtype == tl.float64:
        return x * scale + x * scale_lo
    return x * scale


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
def _key_bias(kb_base, cols, seq_k):
    """Log2-domain bias of keys ``cols`` (0 past seq_k, which the caller masks). kb_base: this batch row."""
    return tl.load(kb_base + cols, mask=cols < seq_k, other=0.0)


@triton.jit
def _dropout_keep(seed, rng_base, rows, cols, seq_k, dropout_p):
    """Keep mask of attention dropout for the tile (rows x cols), which may come in either orientation
    (rows[:, None], cols[None, :] or transposed). rng_base = (b * H_q + h) * seq_q, int64: the Philox
    counter of element (i, j) is (rng_base + i) * seq_k + j, the same in every kernel."""
    return tl.rand(seed, (rng_base + rows) * seq_k + cols) >= dropout_p


@triton.jit
def _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                         lo, hi, offs_m, offs_n, offs_d, seq_k, causal_offset, qk_scale, qk_scale_lo,
                         seed, rng_base, dropout_p,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                         PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                         SCALE_EARLY: tl.constexpr):
    """Fold the key blocks [lo, hi) into the running (acc, l_i, m_i). MASKED selects stage 2.

    SCALE_EARLY scales the scores right after QK^T (fp64, whose scale has two parts; a key bias, which adds to
    scaled scores; a scale <= 0, which does not commute with max); otherwise the scale is folded into the
    exponent's FMA.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(k_base + cols[:, None] * stride_kn, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        # scores: (BLOCK_M, BLOCK_N); log2 domain once scaled
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=acc.dtype)
        if SCALE_EARLY:
            qk = _scale(qk, qk_scale, qk_scale_lo)
            if HAS_KEY_BIAS:
                qk += _key_bias(kb_base, cols, seq_k)[None, :]
        if MASKED:
            qk = tl.where(_visible(offs_m[:, None], cols[None, :], seq_k, causal_offset, CAUSAL), qk, float("-inf"))
        if SCALE_EARLY:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        else:  # scale > 0 commutes with max: BLOCK_M multiplies here instead of BLOCK_M * BLOCK_N
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if MASKED:
            # a row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        elif HAS_KEY_BIAS:
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        if SCALE_EARLY:
            p = tl.exp2(qk - m_new_safe[:, None])
        else:
            p = tl.exp2(qk * qk_scale - m_new_safe[:, None])  # scale and shift in one FMA per score
        alpha = tl.exp2(m_i - m_new_safe)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)  # the undropped row sum: dropout does not renormalise
        if DROPOUT:
            p = tl.where(_dropout_keep(seed, rng_base, offs_m[:, None], cols[None, :], seq_k, dropout_p), p, 0.0)
        v = _load_rows(v_base + cols[:, None] * stride_vn, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION,
                     out_dtype=acc.dtype)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed", "sections", "WAVE_BUCKET"])
def attention_fwd_kernel(
    Q, K, V, O, LSE, KB,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kbb,
    seq_q, seq_k, qk_scale, qk_scale_lo,
    seed, dropout_p, keep_scale, keep_scale_lo, sections,
    SEQ_BUCKET, WAVE_BUCKET,  # autotune keys only
    GROUP: tl.constexpr,  # query heads per KV head (GQA); 1 for plain multi-head attention
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    SCALE_EARLY: tl.constexpr,  # fp64, HAS_KEY_BIAS or scale <= 0: see _attention_fwd_inner
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(seq_q, BLOCK_M), H_q, B).

    Q, O: (B, H_q, seq_q, HEAD_DIM); K, V: (B, H_q // GROUP, seq_k, HEAD_DIM); any strides.
    LSE: (B, H_q, seq_q) contiguous, log2-domain logsumexp of the scaled scores (-inf: row sees no key).
    KB: (B, seq_k) log2-domain key bias (-inf = padding), unit stride along keys, the accumulator's dtype
    (read only if HAS_KEY_BIAS).
    (qk_scale, qk_scale_lo) = split_scale(softmax scale * log2(e)); with DROPOUT, (keep_scale,
    keep_scale_lo) = split_scale(1 / (1 - dropout_p)) and ``seed`` keys the Philox stream.
    """
    pid_m, off_h, off_b = _query_block_coords(sections, CAUSAL)  # causal: heaviest first
    off_hk = off_h // GROUP
    acc_dtype = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # int64 base offsets: B * H * seq * D overflows int32 at long context
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    q = _load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)

    kb_base = KB + off_b.to(tl.int64) * stride_kbb
    rng_base = (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q

    causal_offset = seq_k - seq_q
    mid, hi = _query_block_key_range(start_m, seq_k, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)

    # stage 1: off-band, no causal mask
    acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                                         0, mid, offs_m, offs_n, offs_d, seq_k, causal_offset,
                                         qk_scale, qk_scale_lo, seed, rng_base, dropout_p,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, PRECISION,
                                         HAS_KEY_BIAS, DROPOUT, SCALE_EARLY)
    # stage 2: blocks crossing the diagonal, and the ragged tail of seq_k
    acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, kb_base, stride_kn, stride_vn,
                                         mid, hi, offs_m, offs_n, offs_d, seq_k, causal_offset,
                                         qk_scale, qk_scale_lo, seed, rng_base, dropout_p,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, PRECISION,
                                         HAS_KEY_BIAS, DROPOUT, SCALE_EARLY)

    # epilogue: one division by the row sum; rows that saw no key have acc = 0, l = 0 -> output 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = _scale(out, keep_scale, keep_scale_lo)  # 1 / (1 - p) for the kept probabilities
    # kept in the log2 domain: the backward needs it there, and a float literal (ln 2) would be fp32
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    row_ok = offs_m < seq_q
    o_ptrs = (O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    lse_ptrs = LSE + (off_b.to(tl.int64) * tl.num_programs(1) + off_h) * seq_q + offs_m
    tl.store(lse_ptrs, lse.to(LSE.dtype.element_ty), mask=row_ok)


_attention_fwd_tuned = configs.autotuned(attention_fwd_kernel, configs.FWD_CANDIDATES, configs.FWD_CANDIDATES_WIDE)


def precision_for(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 follows torch's TF32 switch, everything else is exact IEEE."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not configs.INTERPRET:
        return "tf32"
    return "ieee"


@configs.on_input_device
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0):
    """Launch the forward kernel. Returns (out, lse).

    q: (B, H_q, N_q, D), k/v: (B, H_kv, N_k, D), any strides, validated by the caller.
    key_padding_mask: None, bool (B, N_k) with True = padding, or float (B, N_k) added to the scaled scores
    (``flash_attention``'s semantics). dropout_p in [0, 1), with the Philox ``seed``
    (an int in [0, 2**31): one argument type, so one compiled kernel).
    out: like q (same dtype, ``empty_like`` layout); lse: (B, H_q, N_q), the log2-domain LSE
    (log2 of the row sum of exp(scores)), float32 (float64 for fp64 inputs).
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    out, lse, done = allocate_outputs(q, k)
    if done:
        return out, lse
    if hopper_forward_applies(q, k, v, causal, scale, key_padding_mask, dropout_p):
        hopper_module("attention_fwd_hopper").attention_fwd_hopper(q, k, v, out, lse, causal, scale)
        return out, lse

    def grid(meta):
        return (configs.cdiv(seq_q, meta["BLOCK_M"]), heads_q, batch)

    kb, stride_kbb = key_bias_arg(key_padding_mask, q, unused=lse)
    args = (q, k, v, out, lse, kb, *q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_kbb,
            seq_q, seq_k, *split_scale(scale * LOG2E), *dropout_args(dropout_p, seed),
            configs.causal_sections(causal, batch * heads_q,
                                    configs.cdiv(seq_q, configs.largest_tile("fwd", head_dim)),
                                    heads_q // heads_kv, seq_k, 2 * head_dim * k.element_size(), q.device),
            configs.seq_bucket(seq_k), configs.wave_bucket(batch * heads_q, seq_q, q.device))
    configs.launch("fwd", _attention_fwd_tuned, attention_fwd_kernel, grid, args, q.dtype, max(seq_q, seq_k),
                   GROUP=heads_q // heads_kv, HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim),
                   CAUSAL=causal, PRECISION=precision_for(q.dtype),
                   HAS_KEY_BIAS=key_padding_mask is not None, DROPOUT=dropout_p > 0,
                   SCALE_EARLY=q.dtype == torch.float64 or key_padding_mask is not None or scale <= 0)
    return out, lse


def hopper_forward_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                           key_padding_mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether ``attention_fwd`` runs the warp-specialised Hopper kernel (attention_fwd_hopper.py) for these
    inputs: the rules of ``hopper_inputs_qualify`` and ``hopper_device_ready``, a head_dim it has a config for,
    every row seeing a key (causal needs seq_q <= seq_k), a scale > 0 (the kernel takes the row max before
    scaling), and (in the default "auto" mode of ``configs.hopper_forward``) a sequence long enough for it to
    be the faster kernel."""
    mode = configs.hopper_forward_mode()
    if not hopper_inputs_qualify(mode, q, key_padding_mask, dropout_p, ("fwd", )):
        return False
    head_dim, seq_q, seq_k = q.shape[3], q.shape[2], k.shape[2]
    if head_dim not in configs.HOPPER_FWD_CONFIGS or (causal and seq_q > seq_k) or not scale > 0:
        return False
    if mode == "auto" and max(seq_q, seq_k) < configs.HOPPER_FWD_MIN_SEQ[(head_dim, causal)]:
        return False
    return hopper_device_ready((q, k, v), "attention_fwd_hopper")


def hopper_mode_allows(mode: str, q: torch.Tensor) -> bool:
    """The first rule of every Hopper kernel (the 16-bit and FP8 ones): its ``configs.hopper_*`` mode is not
    "never", and ``q`` is on a CUDA device outside the interpreter."""
    return mode != "never" and not configs.INTERPRET and q.is_cuda


def hopper_inputs_qualify(mode: str, q: torch.Tensor, key_padding_mask: torch.Tensor | None, dropout_p: float,
                          kernels: tuple[str, ...]) -> bool:
    """The cheap rules every 16-bit Hopper kernel (forward and backward) shares: ``hopper_mode_allows``, the
    Triton ``kernels`` it replaces are not forced (``configs.forced_configs``), fp16/bf16 inputs, no key padding
    mask or dropout."""
    if not hopper_mode_allows(mode, q) or any(configs.is_forced(n) for n in kernels):
        return False
    return q.dtype in (torch.float16, torch.bfloat16) and key_padding_mask is None and not dropout_p > 0


def hopper_device_ready(tensors: tuple[torch.Tensor, ...], module: str, device: torch.device | None = None) -> bool:
    """The rest of those shared rules: tiles of every tensor TMA can address, an sm_90 GPU (``device``, or the
    first tensor's), and a triton with Gluon's Hopper API to build the kernel module ``module``
    (``hopper_module``)."""
    if not all(_tma_addressable(t) for t in tensors):
        return False
    device = tensors[0].device if device is None else device
    return configs.device_capability(device) == (9, 0) and hopper_module(module) is not None


def _tma_addressable(t: torch.Tensor) -> bool:
    """TMA's rules for the per-(batch, head) (seq, head_dim) tiles: unit stride along head_dim, a 16-byte
    aligned start for every (batch, head), a row stride of a multiple of 16 bytes."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0 and t.stride(2) * size % 16 == 0
            and all(t.stride(d) * size % 16 == 0 for d in (0, 1) if t.shape[d] > 1))


@functools.cache
def hopper_module(name: str):
    """This package's Gluon kernel module ``name`` (attention_fwd_hopper, attention_bwd_hopper,
    attention_fp8_fwd_hopper), imported on first use, or None where this triton lacks Gluon's Hopper API: the
    Triton kernels run there instead."""
    try:
        return importlib.import_module(f".{name}", __package__)
    except ImportError:
        return None


def allocate_outputs(q: torch.Tensor, k: torch.Tensor):
    """(out, lse, done) for a forward: out ``empty_like(q)``, lse (B, H_q, N_q) in ``lse_dtype``; done when
    there is nothing to launch (no query, or no key: zeros and LSE -inf, what the kernel would give)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=lse_dtype(q.dtype))
    if out.numel() == 0:
        return out, lse, True
    if k.shape[2] == 0:
        return out.zero_(), lse.fill_(float("-inf")), True
    return out, lse, False


def key_bias_arg(key_padding_mask: torch.Tensor | None, like: torch.Tensor,
                 unused: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The (KB, stride_kbb) kernel arguments: the key padding mask as a contiguous log2-domain bias (B, N_k)
    in the accumulator's dtype (-inf at True entries of a bool mask; a float mask times log2(e)) and its
    batch stride. Without a mask: ``unused``, any tensor of that dtype the launch already has (the kernel
    never reads it, so the common call allocates nothing), and stride 0 (one specialisation for all shapes).
    O(B * N_k) work on the host side of the launch when there is a mask."""
    dtype = lse_dtype(like.dtype)
    if key_padding_mask is None:
        return unused, 0
    if key_padding_mask.dtype == torch.bool:
        bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=like.device)
        bias.masked_fill_(key_padding_mask, float("-inf"))
    else:
        bias = (key_padding_mask.to(dtype) * LOG2E).contiguous()
    return bias, bias.stride(0)


def dropout_args(dropout_p: float, seed: int) -> tuple:
    """(seed, p, keep_scale, keep_scale_lo) kernel arguments; 1 / (1 - p) as a ``split_scale`` pair."""
    return (seed, dropout_p, *split_scale(1.0 / (1.0 - dropout_p)))


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the saved LSE: float32, or float64 when the inputs are float64 (keeps fp64 exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
