"""Plain PyTorch references for the kernels: the ground truth the tests compare against.

These materialise the full (seq_q, seq_k) score matrix: use them only on small inputs.
"""

from __future__ import annotations

import math

import torch


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
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (padded / scales[..., None, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(batch, heads, tiles * block_n, head_dim)[:, :, :seq], scales


def fp8_dequantize_ref(q: torch.Tensor, scales: torch.Tensor, block_n: int) -> torch.Tensor:
    """q.float() * the scale of each row's tile."""
    return q.float() * scales.repeat_interleave(block_n, dim=-1)[..., : q.shape[2], None]


def hadamard_matrix(d: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix (d x d, d a power of two), entries +-1."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_ref(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x zero-padded to len(signs)) * signs @ H / sqrt(len(signs)), in float64, returned in x's dtype."""
    d = signs.numel()
    padded = torch.nn.functional.pad(x.double(), (0, d - x.shape[-1]))
    return ((padded * signs.double()) @ hadamard_matrix(d, device=x.device) / math.sqrt(d)).to(x.dtype)


def _e4m3_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest even, saturating at 448), times scale, in float64."""
    return (x / scale).clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn).double() * scale


def fp8_attention_ref(q, k, v, *, causal=False, scale=None, scheme="block+hadamard", block_m=128, block_n=128,
                      signs=None):
    """FP8 attention simulated in float64: what an FP8 kernel computes, up to its accumulation order.

    scheme: "tensor" (one scale per tensor), "block" (one scale per tile of block_m query / block_n key rows,
    per batch and head), or "block+hadamard" (the same after rotating Q and K by diag(signs) H / sqrt(d')).
    Q K^T uses the dequantised Q and K; the softmax numerator P = exp(S - rowmax), in [0, 1], is rounded to
    e4m3 with the fixed scale 1/448 before P V, and the row sum uses the unrounded P. Returns float64 output.
    """
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
