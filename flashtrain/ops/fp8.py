"""FP8 attention: ``flash_attention(..., fp8="forward" | "full")``, and its building blocks usable alone
(``fp8_quantize``: per-tile e4m3; ``hadamard_transform``: the randomised Hadamard rotation; ``random_signs``).

``fp8="forward"`` runs the forward's two matmuls on e4m3 operands with per-tile power-of-two scales, and the
backward's in the input precision on the scores the forward computed (its FP8 Q and K, saved and dequantised
exactly). ``fp8="full"`` runs the backward's four matmuls in FP8 too (``kernels/fp8/bwd.py``). Q and K are rotated
by a random-sign Hadamard matrix before they are quantised (``hadamard``), and K loses a sampled mean over its keys
(``smooth_k``), which softmax ignores and the returned LSE gets back. The numerics, with their measured errors, are
in docs/fp8.md; ``flashtrain.ops.reference`` simulates the scheme in float64.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from flashtrain.kernels.attention.bwd import attention_bwd
from flashtrain.kernels.common import LOG2E, cdiv
from flashtrain.kernels.fp8 import tiles
from flashtrain.kernels.fp8.bwd import attention_fp8_bwd
from flashtrain.kernels.fp8.centring import centre, seq_mean
from flashtrain.kernels.fp8.fwd import attention_fp8_fwd, f16_softmax_scale, fp8_tiles
from flashtrain.kernels.fp8.hadamard import hadamard, padded_dim
from flashtrain.kernels.fp8.quant import fp8_dequantize, fp8_quantize
from flashtrain.kernels.hopper.tiles import fp8_scores_in_f16

from . import dispatch
from .lse import kernel_dlse

__all__ = ["fp8_quantize", "hadamard_transform", "random_signs", "padded_dim"]


def random_signs(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """A fixed random +-1 vector of length padded_dim(head_dim), float32, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (padded_dim(head_dim),), generator=gen).float() * 2 - 1
    return signs.to(device) if device is not None else signs


class _HadamardTransform(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, signs):
        ctx.save_for_backward(signs)
        ctx.head_dim = x.shape[-1]
        return hadamard(x, signs)

    @staticmethod
    def backward(ctx, grad_y):
        (signs,) = ctx.saved_tensors
        # the transform is orthogonal: its gradient is its inverse, cut back to head_dim
        return hadamard(grad_y, signs, inverse=True, out_dim=ctx.head_dim), None


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) -> (..., padded_dim(head_dim)): (x * signs) @ H / sqrt(d'), differentiable in x."""
    return _HadamardTransform.apply(x, signs)


@functools.lru_cache(maxsize=None)
def _rotation_signs(head_dim: int, device: torch.device) -> Tensor:
    """The fixed random signs of the incoherent-processing rotation (seed 0): one per (head_dim, device)."""
    return random_signs(head_dim, seed=0, device=device)


def _seq_mean(x: Tensor) -> Tensor:
    """x (B, H, N, D)'s mean over the sequence, (B, H, D) in fp32."""
    return x.mean(dim=2, dtype=torch.float32)


def _smoothing_mean(k: Tensor) -> Tensor:
    """K smoothing's vector for k (B, H_kv, N, D): the mean of every ``tiles.smoothing_stride(N)``-th key,
    (B, H_kv, D) in fp32. The rotation or quantisation kernel subtracts it and rounds the difference to K's dtype
    as ``_centred`` does. One kernel (``kernels/fp8/centring.py``: ``seq_mean``): the value of ``_seq_mean`` of those
    keys up to the order of its fp32 sums."""
    return seq_mean(k, tiles.smoothing_stride(k.shape[2]))


def _centred(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x minus ``_seq_mean(x)``, in x's dtype (or ``dtype``): what the backward does to dK with K smoothing (the
    output's exact dK sums to zero over the keys; this takes off the part of the rounding error they share):
    the mean, then one kernel pass that subtracts it in fp32 and rounds once (``kernels/fp8/centring.py``: the bits
    of ``(x - mean).to(dtype)``)."""
    return centre(x, _seq_mean(x), dtype)


def _backward_reads_forward_tiles(q: Tensor, k: Tensor, qk_dim: int) -> bool:
    """Whether fp8="full"'s backward quantises Q and K in the forward's tiles (``fp8_tiles``: Q per tile of
    SCALE_M rows, K per tile of SCALE_N, ``tiles.fp8_bwd_tiles``), so that it can take the forward's FP8 Q and
    K instead of rotating and quantising them again: on the GPU at head_dim 128 and 256 (tiles of 128 x 128),
    not at 64 (the forward's K tiles are 64 keys)."""
    bwd = tiles.fp8_bwd_tiles(max(q.shape[2], k.shape[2]), qk_dim)
    return fp8_tiles(q, k) == (bwd["SCALE_M"], bwd["SCALE_N"])


# the dtypes of the op's quantised outputs (q8, q_scales, k8, k_scales, q8_t, k8_t)
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float32) * 2 + (torch.float8_e4m3fn, ) * 2


def _padded_rows(t: Tensor) -> Tensor:
    """The whole buffer of a transposed e4m3 copy (``fp8_quantize(..., with_transposed=True)``'s third output, a
    (B, H, D, N) view with its row stride padded to 16 bytes): (B, H, D, row stride), contiguous; ``[..., :N]``
    gives the view back. What the custom op returns (an output is a whole tensor)."""
    return t.as_strided((*t.shape[:3], t.stride(2)), t.stride(), t.storage_offset())


# K smoothing runs inside the custom ops (not as torch ops around them), so that torch.compile runs the same
# code as eager mode: Inductor's own fusion of the mean would round differently, and one flipped e4m3 rounding
# changes the result's bits.
def _fp8_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, rotate: bool, fp8_backward: bool,
             smooth_k: bool) -> tuple[Tensor, ...]:
    """(out, lse, q8, q_scales, k8, k_scales, q8_t, k8_t, k_mean): the quantised (rotated) Q and K are outputs
    too (non-differentiable), so that the backward recomputes the forward's scores from them instead of
    rotating and quantising again: fp8="forward"'s (q8_t and k8_t empty) and fp8="full"'s where it reads the
    forward's tiles (``_backward_reads_forward_tiles``; q8_t and k8_t are then the transposed copies, whole
    buffers (``_padded_rows``), and an all-zero Q tile's scale is 0). Otherwise for fp8="full" all six are empty
    and its backward quantises Q and K itself. With smooth_k, the kernels see k minus k_mean and lse is the LSE
    of those scores; k_mean, ``_smoothing_mean(k)`` (empty without smooth_k), is an output for the backward that
    centres K again and for the LSE's correction."""
    # Q M (K M)^T = Q K^T for the orthogonal M: only the quantisation sees the rotation (and the centring)
    signs = _rotation_signs(q.shape[-1], q.device) if rotate else None
    k_mean = _smoothing_mean(k) if smooth_k else None
    qk_dim = q.shape[-1] if signs is None else signs.numel()
    both_layouts = fp8_backward and _backward_reads_forward_tiles(q, k, qk_dim)
    hopper = dispatch.fp8_forward(q, k, qk_dim, causal, scale).kernel == dispatch.HOPPER
    out, lse, quantized = attention_fp8_fwd(q, k, v, causal, scale, signs, k_mean, both_layouts=both_layouts,
                                            hopper=hopper)
    q8, q_scales, k8, k_scales, q8_t, k8_t = quantized
    if both_layouts:
        q8_t, k8_t = _padded_rows(q8_t), _padded_rows(k8_t)
    elif fp8_backward:
        q8, q_scales, k8, k_scales = (q.new_empty(0, dtype=t.dtype) for t in (q8, q_scales, k8, k_scales))
    if not both_layouts:
        q8_t, k8_t = (q.new_empty(0, dtype=torch.float8_e4m3fn) for _ in range(2))
    return (out, lse, q8, q_scales, k8, k_scales, q8_t, k8_t,
            q.new_empty(0, dtype=torch.float32) if k_mean is None else k_mean)


@torch.library.custom_op("flashtrain::attention_fp8_fwd", mutates_args=())
def _attention_fp8_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, rotate: bool,
                          fp8_backward: bool, smooth_k: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor, Tensor]:
    return _fp8_fwd(q, k, v, causal, scale, rotate, fp8_backward, smooth_k)


@_attention_fp8_fwd_op.register_fake
def _(q, k, v, causal, scale, rotate, fp8_backward, smooth_k):
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    k_mean = q.new_empty((*k.shape[:2], k.shape[3]) if smooth_k else (0, ), dtype=torch.float32)
    qk_dim = padded_dim(q.shape[-1]) if rotate else q.shape[-1]
    both_layouts = fp8_backward and _backward_reads_forward_tiles(q, k, qk_dim)
    if fp8_backward and not both_layouts:
        return out, lse, *(q.new_empty(0, dtype=dt) for dt in _QUANTIZED_DTYPES), k_mean
    e4m3, fp32 = torch.float8_e4m3fn, torch.float32
    quantized, transposed = [], []
    for x, block in zip((q, k), fp8_tiles(q, k)):
        batch, heads, seq = x.shape[:3]
        quantized += [x.new_empty((batch, heads, seq, qk_dim), dtype=e4m3),
                      x.new_empty((batch, heads, cdiv(seq, block)), dtype=fp32)]
        transposed.append(x.new_empty((batch, heads, qk_dim, cdiv(seq, 16) * 16) if both_layouts else (0, ),
                                      dtype=e4m3))
    return out, lse, *quantized, *transposed, k_mean


def _fp8_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
             causal: bool, scale: float, rotate: bool, smooth_k: bool, k_mean: Tensor, q8: Tensor, q_scales: Tensor,
             k8: Tensor, k_scales: Tensor, q8_t: Tensor, k8_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp8="full": FP8 gradient matmuls (kernels/fp8/bwd.py) on the forward's FP8 Q and K (q8 ... k8_t,
    ``_fp8_fwd``'s outputs; q and k then empty, of the inputs' dtype), or, where those are empty, on Q and K
    rotated and quantised again (with smooth_k, K smoothed as in the forward, with the forward's k_mean: the same
    bits). dQ and dK are rotated back, and with smooth_k dK passes back through the centring."""
    # S = (Q M)(K M)^T: dQ = dQ_rot M^T, the inverse rotation (M is orthogonal), run by the kernels before they
    # store dQ and dK. With smooth_k, dK comes in fp32 with its per-program key sums, and is rounded to K's dtype
    # by its centring: one pass over it.
    signs = _rotation_signs(v.shape[-1], v.device) if rotate else None
    quantized = None
    if q8.numel():
        quantized = (q8, q_scales, k8, k_scales, q8_t[..., :q8.shape[2]], k8_t[..., :k8.shape[2]])
    dq, dk, dv, dk_sums = attention_fp8_bwd(dout, q, k, v, out, lse, dlse, causal, scale, signs,
                                            k_mean if smooth_k else None,
                                            dk_dtype=torch.float32 if smooth_k else None, key_sums=smooth_k,
                                            quantized=quantized)
    if smooth_k:
        dk = centre(dk, dk_sums.sum(dim=2) / v.shape[2], v.dtype)  # dK's mean over the keys, (B, H_kv, D) fp32
    return dq, dk, dv


@torch.library.custom_op("flashtrain::attention_fp8_bwd", mutates_args=())
def _attention_fp8_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Tensor | None, causal: bool, scale: float, rotate: bool, smooth_k: bool,
                          k_mean: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor, q8_t: Tensor,
                          k8_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _fp8_bwd(dout, q, k, v, out, lse, dlse, causal, scale, rotate, smooth_k, k_mean, q8, q_scales, k8,
                    k_scales, q8_t, k8_t)


@_attention_fp8_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, rotate, smooth_k, k_mean, q8, q_scales, k8, k_scales, q8_t, k8_t):
    # the kernels' outputs are contiguous; dq has dout's shape and dk v's (q and k may be empty placeholders)
    return dout.new_empty(dout.shape), v.new_empty(v.shape), v.new_empty(v.shape)


def _fp8_forward_bwd(dout: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor, v: Tensor,
                     out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool, scale: float, rotate: bool,
                     block_m: int, block_n: int, smooth_k: bool) -> tuple[Tensor, Tensor, Tensor]:
    """fp8="forward": the 16-bit backward kernels, on the scores the FP8 forward computed.

    q8, k8 and their scales are the forward's quantised (rotated) Q and K, in tiles of block_m / block_n rows;
    dequantising them is exact in the input dtype (power-of-two tile scales). So the backward's recomputed
    probabilities are the forward's, and each row sums to one under the forward's LSE. Recomputing them from
    the unquantised Q and K instead let rows sum to exp(LSE_exact - LSE_fp8), 0.3-2.3 on logits 8x sharper than
    N(0, 1) inputs', and gpt2-small training diverged after ~180 steps. The gradient passes straight through the
    quantisation and back through the rotation (and with smooth_k, through the forward's K smoothing); dV and dP
    use the unquantised V and dO.
    """
    head_dim = v.shape[-1]
    q_scores = fp8_dequantize(q8, q_scales, block_m, v.dtype)
    k_scores = fp8_dequantize(k8, k_scales, block_n, v.dtype)
    pad = q_scores.shape[-1] - head_dim  # the rotation's width, when head_dim is not a power of two
    if pad:
        v, out, dout = (torch.nn.functional.pad(t, (0, pad)) for t in (v, out, dout))
    dq, dk, dv = attention_bwd(dout, q_scores, k_scores, v, out, lse, dlse, causal, scale)
    if rotate:  # with smooth_k, dK's centring runs in its inverse transform (it commutes with the rotation)
        signs = _rotation_signs(head_dim, v.device)
        dq = hadamard(dq, signs, inverse=True, out_dim=head_dim)
        dk = hadamard(dk, signs, inverse=True, out_dim=head_dim, mean=_seq_mean(dk) if smooth_k else None)
    elif smooth_k:
        dk = _centred(dk)
    return dq.contiguous(), dk.contiguous(), dv[..., :head_dim].contiguous()  # contiguous, as the fake says


@torch.library.custom_op("flashtrain::attention_fp8_forward_bwd", mutates_args=())
def _attention_fp8_forward_bwd_op(dout: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor,
                                  v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
                                  scale: float, rotate: bool, block_m: int, block_n: int,
                                  smooth_k: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _fp8_forward_bwd(dout, q8, q_scales, k8, k_scales, v, out, lse, dlse, causal, scale, rotate, block_m,
                            block_n, smooth_k)


@_attention_fp8_forward_bwd_op.register_fake
def _(dout, q8, q_scales, k8, k_scales, v, out, lse, dlse, causal, scale, rotate, block_m, block_n, smooth_k):
    head_dim = v.shape[-1]
    return (v.new_empty((*q8.shape[:3], head_dim)), v.new_empty((*k8.shape[:3], head_dim)),
            v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, rotate, fp8_backward, smooth_k = inputs
    out, lse, *quantized, k_mean = output
    ctx.mark_non_differentiable(*quantized, k_mean)
    q8 = quantized[0]
    if fp8_backward and q8.numel():  # the forward's FP8 Q and K in both layouts: as many bytes as Q and K
        ctx.save_for_backward(*quantized, v, out, lse)
    elif fp8_backward:  # the FP8 backward quantises Q and K in its own tiles (K centred by k_mean)
        ctx.save_for_backward(q, k, v, out, lse, k_mean)
    else:  # the forward's FP8 Q and K (half the bytes of Q and K), for its scores
        ctx.save_for_backward(*quantized[:4], v, out, lse)
        ctx.tiles = fp8_tiles(q, k)
    ctx.reads_forward_fp8 = fp8_backward and q8.numel() > 0
    ctx.causal, ctx.scale, ctx.rotate, ctx.fp8_backward, ctx.smooth_k = causal, scale, rotate, fp8_backward, smooth_k


def _backward_with(full_bwd, forward_bwd, ctx, dout, dlse2):
    """fp8="forward": the 16-bit backward kernels on the forward's scores (``forward_bwd``); fp8="full": the FP8
    kernels (``full_bwd``). Each is the custom op (compiled graphs) or its plain function (eager mode). ``dout``
    None: only the LSE was used (eager mode sends None for an output without a gradient)."""
    dlse = kernel_dlse(dlse2)
    if ctx.fp8_backward:
        if ctx.reads_forward_fp8:
            *quantized, v, out, lse2 = ctx.saved_tensors
            q, k, k_mean = v.new_empty(0), v.new_empty(0), v.new_empty(0, dtype=torch.float32)
        else:
            q, k, v, out, lse2, k_mean = ctx.saved_tensors
            quantized = (v.new_empty(0, dtype=dt) for dt in _QUANTIZED_DTYPES)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = full_bwd(dout, q, k, v, out, lse2, dlse, ctx.causal, ctx.scale, ctx.rotate, ctx.smooth_k,
                              k_mean, *quantized)
    else:
        q8, q_scales, k8, k_scales, v, out, lse2 = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = forward_bwd(dout, q8, q_scales, k8, k_scales, v, out, lse2, dlse, ctx.causal, ctx.scale,
                                 ctx.rotate, *ctx.tiles, ctx.smooth_k)
    return dq, dk, dv, None, None, None, None, None


def _backward(ctx, dout, dlse2, *_):
    return _backward_with(_attention_fp8_bwd_op, _attention_fp8_forward_bwd_op, ctx, dout, dlse2)


torch.library.register_autograd("flashtrain::attention_fp8_fwd", _backward, setup_context=_setup_context)


class _EagerFP8Attention(torch.autograd.Function):
    """The FP8 custom ops' forward and backward without torch.library's dispatch, for eager mode (as
    ``ops.attention``'s 16-bit path: it roughly halves a call's host time)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, rotate, fp8_backward, smooth_k):
        output = _fp8_fwd(q, k, v, causal, scale, rotate, fp8_backward, smooth_k)
        _setup_context(ctx, (q, k, v, causal, scale, rotate, fp8_backward, smooth_k), output)
        # outputs without a gradient (the quantised Q and K, k_mean, an unused LSE) send None to the backward:
        # autograd's default would fill a zero tensor for each, two of Q's and K's size in e4m3
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse2, *_):
        return _backward_with(_fp8_bwd, _fp8_forward_bwd, ctx, dout, dlse2)


def fp8_forward_scale(q: Tensor, k: Tensor, causal: bool, scale: float, qk_dim: int) -> float:
    """The softmax scale the FP8 forward applies for these inputs (Q and K rows ``qk_dim`` wide once rotated):
    where the FP8 Hopper forward sums the scores in float16 it applies the scale as a float16 value
    (``f16_softmax_scale``), and the op and its backward take that one; else ``scale``."""
    if fp8_scores_in_f16(q.shape[3]) and dispatch.fp8_forward(q, k, qk_dim, causal, scale).kernel == dispatch.HOPPER:
        return f16_softmax_scale(scale)
    return scale


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mode: str, hadamard: bool,
                  smooth_k: bool, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """The FP8 path of ``flash_attention`` (inputs already validated there). Returns (out, log2-domain LSE),
    the LSE only if ``need_lse`` (None otherwise).

    With smooth_k the kernels see K - m (m = ``_smoothing_mean(K)``): query i's scores all move by
    -scale * q_i . m, which softmax ignores, and the LSE by the same, added back here (plain autograd: its
    gradient reaches q and k).
    """
    scale = fp8_forward_scale(q, k, causal, scale, padded_dim(q.shape[-1]) if hadamard else q.shape[-1])
    # the custom op when compiling or under a dispatch mode (selective checkpointing saves it by name)
    custom = torch.compiler.is_compiling() or is_in_torch_dispatch_mode()
    attend = _attention_fp8_fwd_op if custom else _EagerFP8Attention.apply
    out, lse, *_, k_mean = attend(q, k, v, causal, scale, hadamard, mode == "full", smooth_k)
    if not need_lse:
        return out, None
    if smooth_k:
        # q_i . k_mean per row (k_mean shared by the query heads of a GQA group): k_mean's value, with the gradient
        # of the mean of all keys. The backward centres dK over all keys: the output's exact dK sums to zero over
        # the keys, while the LSE's sums to scale * sum_i dlse_i q_i, which this term's gradient puts back.
        full_mean = _seq_mean(k)
        k_mean = k_mean + (full_mean - full_mean.detach())
        shift = torch.einsum("bhgnd,bhd->bhgn", q.float().unflatten(1, (k.shape[1], -1)), k_mean)
        lse = lse + shift.flatten(1, 2) * (scale * LOG2E)  # the log2-domain LSE, (B, H_q, N_q)
    return out, lse
