"""Plain PyTorch references for the kernels: the ground truth the tests compare against.

These materialise the full (seq_q, seq_k) score matrix: use them only on small inputs.
"""

from __future__ import annotations

import math

import torch

# The reference imports no kernel code: it restates the scheme's constants, and tests check the kernels agree.
MIN_SCALE = 2.0 ** -126  # the smallest tile scale: fp32's smallest normal, so 1 / scale stays finite
SMOOTHING_KEYS = 256  # K smoothing averages every (N // SMOOTHING_KEYS)-th key


def hadamard_matrix(dim: int, device=None) -> torch.Tensor:
    """The (dim, dim) Sylvester Hadamard matrix of +-1 in float64, dim a power of two."""
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def smoothing_stride(seq: int) -> int:
    """The step between the keys K smoothing averages, for ``seq`` keys."""
    return max(1, seq // SMOOTHING_KEYS)


def causal_mask(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """Bool (seq_q, seq_k), True where query i may see key j: j <= i + seq_k - seq_q (bottom-right)."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    return j <= i + (seq_k - seq_q)


def window_mask(seq_q: int, seq_k: int, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                device=None) -> torch.Tensor:
    """Bool (seq_q, seq_k), True where query i may see key j under flash-attn's ``window_size`` (left, right):
    i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right, -1 unbounded; causal caps right at 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
    j = torch.arange(seq_k, device=device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return visible


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                  dropout_keep: torch.Tensor | None = None, dropout_p: float = 0.0, upcast: bool = True,
                  window_size: tuple[int, int] = (-1, -1)):
    """Reference attention with the semantics of ``flashtrain.flash_attention``. Returns (out, lse).

    q: (B, H_q, N_q, D); k, v: (B, H_kv, N_k, D) with H_q a multiple of H_kv (GQA by repetition here).
    key_padding_mask: bool (B, N_k), True = padding, or float (B, N_k), added to the scores.
    dropout_keep: bool (B, H_q, N_q, N_k), the kept probabilities (``flashtrain.kernels.dropout_keep_mask`` gives
    the kernels' mask), scaled by 1/(1-p). window_size: flash-attn's (left, right) (``window_mask``).
    With ``upcast`` the math runs in float64 and the output is cast back to q's dtype; lse is returned
    in float64 (natural log, -inf for rows that see no key; their output rows are 0).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, N_q, N_k)
    if causal or window_size != (-1, -1):
        visible = window_mask(q.shape[2], k.shape[2], causal, window_size, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    elif key_padding_mask is not None:
        scores = scores + key_padding_mask[:, None, None, :].to(scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, N_q); -inf where a row sees no key
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # rows with no key: exp(-inf) = 0
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    out = torch.matmul(probs, v)
    return out.to(dtype), lse


def attention_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                         window_size: tuple[int, int] = (-1, -1), upcast: bool = True):
    """Reference of ``flash_attention_varlen``: each packed sequence attended on its own. Returns (out, lse).

    q: (total_q, H_q, D); k, v: (total_k, H_kv, D); cu_seqlens_*: (n + 1,) offsets. out: like q, zeros on rows
    past cu_seqlens_q[-1]; lse: float64 (H_q, total_q) natural log, -inf on rows that see no key.
    """
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(cu_seqlens_q.shape[0] - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:
            continue  # no key: zeros and -inf, as initialised
        o, s = attention_ref(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                             v[k0:k1].transpose(0, 1)[None], causal=causal, scale=scale, upcast=upcast,
                             window_size=window_size)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = s[0].to(torch.float64)
    return out, lse


def fp8_quantize_ref(x: torch.Tensor, block_n: int, amax_to: float = 448.0):
    """Per-tile e4m3 quantisation (see flashtrain.kernels.fp8.quant): returns (q, scales) like the kernel, each
    tile's largest magnitude scaled into (amax_to / 2, amax_to] (the scale at least ``MIN_SCALE``, 2^-126). A tile's
    amax leaves NaNs out, as the kernel's does; a NaN stays NaN and an infinite value, whose tile's scale is then
    infinite, becomes NaN."""
    batch, heads, seq, head_dim = x.shape
    tiles = -(-seq // block_n)
    padded = torch.zeros(batch, heads, tiles * block_n, head_dim, dtype=torch.float32, device=x.device)
    padded[:, :, :seq] = x.float()
    padded = padded.view(batch, heads, tiles, block_n, head_dim)
    amax = torch.where(padded.isnan(), 0.0, padded.abs()).amax(dim=(-1, -2))  # (B, H, tiles)
    scales = _pow2_scales(amax, amax_to, empty_tile_scale=1.0)
    q = (padded / scales[..., None, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(batch, heads, tiles * block_n, head_dim)[:, :, :seq], scales


def mma_key_order_ref(seq: int) -> torch.Tensor:
    """(seq,) int64: the column at which ``fp8_quantize(..., transposed=True, mma_key_order=True)`` stores key k.
    Within each group of 32 keys, key 16h + 8a + 2t + b goes to 16h + 4t + 2a + b (see
    ``flashtrain.kernels.fp8.quant._in_mma_key_order``)."""
    k = torch.arange(seq)
    group, h, a, t, b = k // 32, k // 16 % 2, k // 8 % 2, k // 2 % 4, k % 2
    return 32 * group + 16 * h + 4 * t + 2 * a + b


def pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0; inf and NaN kept), elementwise, in x's dtype: from x's exponent,
    exact (CUDA's float64 log2 put 2^-126 above -126, and a log2 and ceil gave 2^-125)."""
    mantissa, exponent = torch.frexp(x.double())  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # x itself a power of two
    power = torch.ldexp(torch.ones_like(mantissa), exponent)
    return torch.where(torch.isfinite(x), power.to(x.dtype), x)  # inf (an infinite tile's scale) stays inf


def fp8_dequantize_ref(q: torch.Tensor, scales: torch.Tensor, block_n: int) -> torch.Tensor:
    """q.float() * the scale of each row's tile."""
    return q.float() * scales.repeat_interleave(block_n, dim=-1)[..., : q.shape[2], None]


def centre_ref(x: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (B, H, N, D) minus mean (B, H, D) float32 on every row, computed in the promoted dtype and rounded once
    to ``dtype`` (default x's)."""
    return torch.sub(x, mean[:, :, None], out=torch.empty_like(x, dtype=dtype or x.dtype))


def _rotated64(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x zero-padded to len(signs)) * signs @ H / sqrt(len(signs)), in float64."""
    d = signs.numel()
    padded = torch.nn.functional.pad(x.double(), (0, d - x.shape[-1]))
    return (padded * signs.double()) @ hadamard_matrix(d, device=x.device) / math.sqrt(d)


def hadamard_ref(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x zero-padded to len(signs)) * signs @ H / sqrt(len(signs)), in float64, returned in x's dtype."""
    return _rotated64(x, signs).to(x.dtype)


def _e4m3_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest even, saturating at 448), times scale, in float64."""
    return (x / scale).clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn).double() * scale


def smoothing_mean_ref(k: torch.Tensor) -> torch.Tensor:
    """The vector K smoothing subtracts: the mean of every ``smoothing_stride(N)``-th key of k (B, H_kv, N,
    D), per batch and KV head, in float32, (B, H_kv, 1, D)."""
    return k[:, :, ::smoothing_stride(k.shape[2])].mean(dim=2, keepdim=True, dtype=torch.float32)


def smooth_keys_ref(k: torch.Tensor) -> torch.Tensor:
    """K minus ``smoothing_mean_ref(k)``, in K's dtype: what ``flash_attention(..., fp8=..., smooth_k=True)``
    hands the FP8 kernels."""
    return (k - smoothing_mean_ref(k)).to(k.dtype)


def scores_operands_ref(q: torch.Tensor, k: torch.Tensor, signs: torch.Tensor | None = None,
                        smooth_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, K) as the FP8 kernels' scores take them, in the inputs' dtypes. With ``signs`` both rotated
    (``hadamard_ref``), and with ``smooth_k`` K's rotated rows minus the rotated ``smoothing_mean_ref(k)``, in
    float64 with one rounding (``fp8_quantize(k, mean=, signs=)``); without a rotation
    ``smooth_keys_ref(k)``."""
    if signs is None:
        return q, smooth_keys_ref(k) if smooth_k else k
    if not smooth_k:
        return hadamard_ref(q, signs), hadamard_ref(k, signs)
    mean = smoothing_mean_ref(k)
    return hadamard_ref(q, signs), (_rotated64(k, signs) - _rotated64(mean, signs)).to(k.dtype)


def fp8_attention_ref(q, k, v, *, causal=False, scale=None, scheme="block+hadamard", block_m=128, block_n=128,
                      signs=None, smooth_k=False):
    """FP8 attention simulated in float64: what an FP8 kernel computes, up to its accumulation order.

    scheme: "tensor" (one scale per tensor), "block" (one scale per tile of block_m query / block_n key rows,
    per batch and head), or "block+hadamard" (the same after rotating Q and K by diag(signs) H / sqrt(d')).
    Q K^T uses the dequantised Q and K; the softmax numerator P = exp(S - rowmax), in [0, 1], is rounded to
    e4m3 with the fixed scale 1/448 before P V, and the row sum uses the unrounded P. ``smooth_k``: K enters
    smoothed (``scores_operands_ref``; the output is the same in exact arithmetic). Returns float64 output.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if smooth_k and not scheme.endswith("+hadamard"):
        k = smooth_keys_ref(k)
    q, k, v = q.double(), k.double(), v.double()
    if scheme.endswith("+hadamard"):
        q, k = scores_operands_ref(q, k, signs, smooth_k)
    if scheme == "tensor":
        quant = [_e4m3_round_trip(t, t.abs().amax().clamp_min(1e-30) / 448.0) for t in (q, k, v)]
    elif scheme in ("block", "block+hadamard"):
        quant = []
        for t, block in ((q, block_m), (k, block_n), (v, block_n)):
            _, scales = fp8_quantize_ref(t, block)
            quant.append(_e4m3_round_trip(t, scales.double().repeat_interleave(block, -1)[..., : t.shape[2], None]))
    else:
        raise ValueError(f"scheme={scheme!r}: expected 'tensor', 'block' or 'block+hadamard'")
    q8, k8, v8 = quant
    group = q.shape[1] // k.shape[1]
    k8, v8 = k8.repeat_interleave(group, 1), v8.repeat_interleave(group, 1)
    s = q8 @ k8.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    p = torch.exp(s - row_max.masked_fill(torch.isneginf(row_max), 0.0))  # rows that see no key: p = 0
    p8 = _e4m3_round_trip(p, torch.tensor(1.0 / 448.0, dtype=torch.float64))
    row_sum = p.sum(-1, keepdim=True)
    return (p8 @ v8) / row_sum.masked_fill(row_sum == 0, 1.0)  # and output 0


def _tile_quantize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (..., M, N) rounded to e4m3 with one scale per (rows x cols) tile: amax / 448 rounded up to a power of
    two (1 for an all-zero tile), in float64."""
    m, n = x.shape[-2:]
    pm, pn = -(-m // rows) * rows, -(-n // cols) * cols
    padded = torch.nn.functional.pad(x, (0, pn - n, 0, pm - m))
    tiles = padded.unflatten(-2, (pm // rows, rows)).unflatten(-1, (pn // cols, cols))  # (..., Tm, r, Tn, c)
    scale = _pow2_scales(tiles.abs().amax(dim=(-3, -1), keepdim=True))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _e4m3_round_trip(tiles, scale).flatten(-4, -3).flatten(-2, -1)[..., :m, :n]


def _pow2_scales(amax: torch.Tensor, amax_to: float = 448.0, empty_tile_scale: float = 0.0) -> torch.Tensor:
    """amax / amax_to, at least ``MIN_SCALE``, rounded up to a power of two (``pow2_at_least``);
    ``empty_tile_scale`` where amax is 0 (the kernels' ``_tile_scale``, and ``fp8_quantize``'s argument)."""
    scales = pow2_at_least((amax / amax_to).clamp_min(MIN_SCALE))
    return torch.where(amax > 0, scales, torch.full_like(amax, empty_tile_scale))


def _empty_tiles_zero(x: torch.Tensor, block: int, amax_to: float = 448.0) -> torch.Tensor:
    """x's tile scales (fp8_quantize_ref) per row, (B, H, >= N) float64, 0 for an all-zero tile (the backward
    quantises Q and dO with ``empty_tile_scale=0.0``)."""
    scales = fp8_quantize_ref(x, block, amax_to)[1].double()
    amax = torch.nn.functional.pad(x.double(), (0, 0, 0, scales.shape[-1] * block - x.shape[2]))
    amax = amax.unflatten(2, (scales.shape[-1], block)).abs().amax(dim=(-2, -1))
    return torch.where(amax > 0, scales, torch.zeros_like(scales)).repeat_interleave(block, -1)


def _round_in_units(x: torch.Tensor, to_unit: torch.Tensor) -> torch.Tensor:
    """x * to_unit rounded to e4m3 (as a kernel quantises in its accumulator's units), then divided back;
    float64, 0 where to_unit is 0."""
    rounded = _e4m3_round_trip(x * to_unit, torch.ones((), dtype=torch.float64))
    return torch.where(to_unit > 0, rounded / to_unit, torch.zeros_like(rounded))


def _group_unit_p(p: torch.Tensor, do_scales: torch.Tensor, group: int) -> torch.Tensor:
    """P (B, H_q, M, N) as the dK/dV kernel rounds it for dV, dequantised, float64: P8 = round_e4m3(448 P *
    do_scale / unit), unit the largest dO tile scale of the GQA group (dV accumulates in units of unit / 448).
    ``do_scales``: dO's tile scales per row (B, H_q, >= M), 0 for an all-zero tile."""
    heads_q, m = p.shape[1], p.shape[2]
    unit = do_scales.unflatten(1, (heads_q // group, group)).amax(dim=(2, 3), keepdim=True)  # (B, H_kv, 1, 1)
    unit = unit.repeat_interleave(group, 1)  # (B, H_q, 1, 1)
    return _round_in_units(p, torch.where(unit > 0, 448.0 * do_scales[..., :m, None] / unit, torch.zeros_like(p)))


def _running_unit_quantize(ds: torch.Tensor, q_scales: torch.Tensor, group: int, block_m: int) -> torch.Tensor:
    """dS (B, H_q, M, N) as the dK/dV kernel rounds it, dequantised, float64. The kernel walks the query tiles
    of BLOCK_M rows (of each query head of a GQA group in turn) and keeps each key's dK row in units of the
    running max over the tiles so far of c = (that key's dS scale over the tile) * q_scale, at least ``MIN_SCALE``;
    it rounds dS * q_scale / unit to e4m3. ``q_scales``: Q's scale per query row (B, H_q, >= M)."""
    batch, heads_q, m, n = ds.shape
    tiles = -(-m // block_m)
    padded = torch.nn.functional.pad(ds, (0, 0, 0, tiles * block_m - m)).unflatten(2, (tiles, block_m))
    q_scale = q_scales[..., : tiles * block_m : block_m][..., None, None]  # (B, H_q, T, 1, 1)
    c = (_pow2_scales(padded.abs().amax(dim=3, keepdim=True)) * q_scale).clamp_min(MIN_SCALE)  # (B, H_q, T, 1, N)
    # the running max in the kernel's order: the group's heads one after another, each over its tiles
    unit = c.unflatten(1, (heads_q // group, group)).flatten(2, 3).cummax(dim=2).values
    unit = unit.unflatten(2, (group, tiles)).flatten(1, 2)
    rounded = _round_in_units(padded, torch.where(unit > 0, q_scale / unit, torch.zeros_like(unit)))
    return rounded.flatten(2, 3)[:, :, :m]


def fp8_attention_bwd_ref(q, k, v, out, lse, dout, *, tiles, causal=False, scale=None, signs=None, smooth_k=False,
                          scores_amax=448.0, _operands_ready=False):
    """The FP8 backward (``fp8="full"``) simulated in float64, given the forward's ``out`` and natural-log
    ``lse``, with the kernels' tiling ``tiles`` (``flashtrain.kernels.fp8.tiles.fp8_bwd_tiles``): Q and dO (Q
    rotated by ``signs`` if given, in its dtype) rounded to e4m3 per tile of SCALE_M rows, K (rotated) and V per
    tile of SCALE_N rows, P to e4m3 with the fixed scale 1/448 for dV, dS with one power-of-two scale per row of
    each kernel's tile (ROW_SCALES; else per tile): per key over the dK/dV kernel's BLOCK_M queries for dK, per
    query over the dQ kernel's BLOCK_N keys for dQ; delta from out and the rounded dout (dO8, as dP takes it).
    ``smooth_k``: K enters smoothed (``scores_operands_ref``), with the LSE of those scores, and dK goes back
    through the centring. ``scores_amax``: the magnitude Q's and K's tiles are scaled to (``fp8_quantize``'s
    amax_to): the backward takes the forward's FP8 Q and K, quantised to 16 where the FP8 Hopper forward sums its
    scores in float16 (``flashtrain.kernels.fp8.fwd.scores_amax``). Returns float64 (dq, dk, dv)."""
    head_dim = v.shape[-1]  # q's, also where q comes rotated (_operands_ready) and wider
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if smooth_k:
        k_mean = smoothing_mean_ref(k).double()
        group = q.shape[1] // k.shape[1]
        shift = (q.double().unflatten(1, (k.shape[1], group)) @ k_mean.unsqueeze(2).transpose(-1, -2))
        lse = lse.double() - scale * shift.flatten(1, 2)[..., 0]  # the centred scores' LSE
        q, k = scores_operands_ref(q, k, signs, smooth_k=True)
        dq, dk, dv = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=tiles, causal=causal, scale=scale,
                                           signs=signs, scores_amax=scores_amax, _operands_ready=True)
        return dq, dk - dk.mean(dim=2, keepdim=True), dv
    if not _operands_ready:  # rotated, then rounded to the input dtype, as the kernels' inputs are
        q, k = scores_operands_ref(q, k, signs)
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))

    def tiles_of_rows(t, block, amax_to=448.0):
        _, scales = fp8_quantize_ref(t, block, amax_to)
        return _e4m3_round_trip(t, scales.double().repeat_interleave(block, -1)[..., : t.shape[2], None])

    q8, do8 = tiles_of_rows(q, tiles["SCALE_M"], scores_amax), tiles_of_rows(dout, tiles["SCALE_M"])
    q8_scales_rows = _empty_tiles_zero(q, tiles["SCALE_M"], scores_amax)
    do_scales_rows = _empty_tiles_zero(dout, tiles["SCALE_M"])
    k8, v8 = tiles_of_rows(k, tiles["SCALE_N"], scores_amax), tiles_of_rows(v, tiles["SCALE_N"])
    group = q.shape[1] // k.shape[1]
    k8r, v8r = k8.repeat_interleave(group, 1), v8.repeat_interleave(group, 1)
    s = q8 @ k8r.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = lse.double()
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), float("inf"))[..., None])  # no key: P = 0
    p_for_dv = _group_unit_p(p, do_scales_rows, group)
    delta = (do8 * out).sum(-1, keepdim=True)  # from the dO8 that dP takes
    ds = p * (do8 @ v8r.transpose(-1, -2) - delta)
    ds_for_dk = _running_unit_quantize(ds, q8_scales_rows, group, tiles["dkdv"]["BLOCK_M"])
    ds_for_dq = _tile_quantize(ds, 1, tiles["dq"]["BLOCK_N"])  # one scale per query row of a key tile

    def per_kv_head(t):  # (B, H_q, ...) -> (B, H_kv, ...): sum over each GQA group
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    dv = per_kv_head(p_for_dv.transpose(-1, -2) @ do8)
    dq = ds_for_dq @ k8r * scale
    dk = per_kv_head(ds_for_dk.transpose(-1, -2) @ q8) * scale
    if signs is not None:  # back from the rotated space: the inverse of x -> (x * signs) @ H / sqrt(d')
        d = signs.numel()
        h = hadamard_matrix(d, device=q.device) / math.sqrt(d)
        dq, dk = (((g @ h) * signs.double())[..., :head_dim] for g in (dq, dk))
    return dq, dk, dv
