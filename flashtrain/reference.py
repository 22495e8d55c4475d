"""Plain PyTorch references for the kernels: the ground truth the tests compare against.

These materialise the full (seq_q, seq_k) score matrix: use them only on small inputs.
"""

from __future__ import annotations

import math

import torch

# the +-1 matrix only (a constant): hadamard_ref's matmul with it stays independent of the butterfly kernel
from .kernels.hadamard import hadamard_matrix


def causal_mask(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """Bool (seq_q, seq_k), True where query i may see key j: j <= i + seq_k - seq_q (bottom-right)."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    return j <= i + (seq_k - seq_q)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                  dropout_keep: torch.Tensor | None = None, dropout_p: float = 0.0, upcast: bool = True):
    """Reference attention with the semantics of ``flashtrain.flash_attention``. Returns (out, lse).

    q: (B, H_q, N_q, D); k, v: (B, H_kv, N_k, D) with H_q a multiple of H_kv (GQA by repetition here).
    key_padding_mask: bool (B, N_k), True = padding, or float (B, N_k), added to the scores. dropout_keep: bool (B, H_q, N_q, N_k), the kept
    probabilities (``flashtrain.kernels.dropout_keep_mask`` gives the kernels' mask), scaled by 1/(1-p).
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
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
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


def fp8_quantize_ref(x: torch.Tensor, block_n: int):
    """Per-tile e4m3 quantisation (see flashtrain.kernels.fp8_quant): returns (q, scales) like the kernel."""
    batch, heads, seq, head_dim = x.shape
    tiles = -(-seq // block_n)
    padded = torch.zeros(batch, heads, tiles * block_n, head_dim, dtype=torch.float32, device=x.device)
    padded[:, :, :seq] = x.float()
    padded = padded.view(batch, heads, tiles, block_n, head_dim)
    amax = padded.abs().amax(dim=(-1, -2))  # (B, H, tiles)
    scales = torch.where(amax > 0, pow2_at_least(amax / 448.0), torch.ones_like(amax))
    q = (padded / scales[..., None, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(batch, heads, tiles * block_n, head_dim)[:, :, :seq], scales


def pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (float32, x > 0), elementwise."""
    return torch.exp2(torch.ceil(torch.log2(x.double()))).float()


def fp8_dequantize_ref(q: torch.Tensor, scales: torch.Tensor, block_n: int) -> torch.Tensor:
    """q.float() * the scale of each row's tile."""
    return q.float() * scales.repeat_interleave(block_n, dim=-1)[..., : q.shape[2], None]


def hadamard_ref(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x zero-padded to len(signs)) * signs @ H / sqrt(len(signs)), in float64, returned in x's dtype."""
    d = signs.numel()
    padded = torch.nn.functional.pad(x.double(), (0, d - x.shape[-1]))
    return ((padded * signs.double()) @ hadamard_matrix(d, device=x.device) / math.sqrt(d)).to(x.dtype)


def _e4m3_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest even, saturating at 448), times scale, in float64."""
    return (x / scale).clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn).double() * scale


def smooth_keys_ref(k: torch.Tensor) -> torch.Tensor:
    """K minus its mean over the sequence (per batch and KV head; mean in float32), in K's dtype: what
    ``flash_attention(..., fp8=..., smooth_k=True)`` hands the FP8 kernels."""
    return (k - k.mean(dim=2, keepdim=True, dtype=torch.float32)).to(k.dtype)


def fp8_attention_ref(q, k, v, *, causal=False, scale=None, scheme="block+hadamard", block_m=128, block_n=128,
                      signs=None, smooth_k=False):
    """FP8 attention simulated in float64: what an FP8 kernel computes, up to its accumulation order.

    scheme: "tensor" (one scale per tensor), "block" (one scale per tile of block_m query / block_n key rows,
    per batch and head), or "block+hadamard" (the same after rotating Q and K by diag(signs) H / sqrt(d')).
    Q K^T uses the dequantised Q and K; the softmax numerator P = exp(S - rowmax), in [0, 1], is rounded to
    e4m3 with the fixed scale 1/448 before P V, and the row sum uses the unrounded P. ``smooth_k``: K enters as
    ``smooth_keys_ref(k)`` (the output is the same in exact arithmetic). Returns float64 output.
    """
    if smooth_k:
        k = smooth_keys_ref(k)
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if scheme.endswith("+hadamard"):
        q, k = hadamard_ref(q, signs), hadamard_ref(k, signs)
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


def _tile_quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., M, N) rounded to e4m3 with one scale per (block x block) tile (amax / 448), in float64."""
    m, n = x.shape[-2:]
    pm, pn = -(-m // block) * block, -(-n // block) * block
    padded = torch.nn.functional.pad(x, (0, pn - n, 0, pm - m))
    tiles = padded.unflatten(-2, (pm // block, block)).unflatten(-1, (pn // block, block))  # (..., Tm, b, Tn, b)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return _e4m3_round_trip(tiles, scale).flatten(-4, -3).flatten(-2, -1)[..., :m, :n]


def fp8_attention_bwd_ref(q, k, v, out, lse, dout, *, causal=False, scale=None, block=64, signs=None,
                          smooth_k=False):
    """The FP8 backward (``fp8="full"``) simulated in float64, given the forward's ``out`` and natural-log
    ``lse``: Q, K (rotated by ``signs`` if given, in their dtype), V and dO rounded to e4m3 per tile of ``block`` rows, P to
    e4m3 with the fixed scale 1/448 for dV, dS per (block x block) tile for dQ and dK, delta from the
    unrounded out and dout. ``smooth_k``: K enters as ``smooth_keys_ref(k)``, with the LSE of those scores,
    and dK goes back through the centring. Returns float64 (dq, dk, dv)."""
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if smooth_k:
        k_mean = k.mean(dim=2, keepdim=True, dtype=torch.float32).double()
        group = q.shape[1] // k.shape[1]
        shift = (q.double().unflatten(1, (k.shape[1], group)) @ k_mean.unsqueeze(2).transpose(-1, -2))
        lse = lse.double() - scale * shift.flatten(1, 2)[..., 0]  # the centred scores' LSE
        dq, dk, dv = fp8_attention_bwd_ref(q, smooth_keys_ref(k), v, out, lse, dout, causal=causal, scale=scale,
                                           block=block, signs=signs)
        return dq, dk - dk.mean(dim=2, keepdim=True), dv
    if signs is not None:  # rotated, then rounded to the input dtype, as the kernels' inputs are
        q, k = hadamard_ref(q, signs), hadamard_ref(k, signs)
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))

    def tiles_of_rows(t):
        _, scales = fp8_quantize_ref(t, block)
        return _e4m3_round_trip(t, scales.double().repeat_interleave(block, -1)[..., : t.shape[2], None])

    q8, k8, v8, do8 = (tiles_of_rows(t) for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    k8r, v8r = k8.repeat_interleave(group, 1), v8.repeat_interleave(group, 1)
    s = q8 @ k8r.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = lse.double()
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), float("inf"))[..., None])  # no key: P = 0
    p8 = _e4m3_round_trip(p, torch.tensor(1.0 / 448.0, dtype=torch.float64))
    delta = (dout * out).sum(-1, keepdim=True)
    ds = _tile_quantize(p * (do8 @ v8r.transpose(-1, -2) - delta), block)

    def per_kv_head(t):  # (B, H_q, ...) -> (B, H_kv, ...): sum over each GQA group
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    dv = per_kv_head(p8.transpose(-1, -2) @ do8)
    dq = ds @ k8r * scale
    dk = per_kv_head(ds.transpose(-1, -2) @ q8) * scale
    if signs is not None:  # back from the rotated space: the inverse of x -> (x * signs) @ H / sqrt(d')
        d = signs.numel()
        h = hadamard_matrix(d, device=q.device) / math.sqrt(d)
        dq, dk = (((g @ h) * signs.double())[..., :head_dim] for g in (dq, dk))
    return dq, dk, dv
