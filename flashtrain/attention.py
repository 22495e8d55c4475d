"""``flash_attention``: the public op, its input checks, and its ``torch.library`` registration.

The kernels are wrapped in two custom ops, ``flashtrain::attention_fwd`` and ``flashtrain::attention_bwd``,
each with a fake (meta) implementation, and joined by ``register_autograd``. ``torch.compile`` therefore
sees one opaque node per direction: ``fullgraph=True`` traces through ``flash_attention`` with no graph
break, and the compiled graph launches the same kernels as eager mode. In eager mode ``flash_attention``
calls the same launchers through a plain ``torch.autograd.Function``: torch.library's dispatch costs about
as much host time as everything else in a call (measured on the CPU box: 624 vs 313 us per forward +
backward with the kernel launches stubbed out), and short kernels wait for the host.

Inside the ops the LSE lives in the log2 domain, as the kernels use it; ``flash_attention`` converts it to
natural log for the caller.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from flashtrain.kernels import INTERPRET, attention_bwd, attention_fwd, lse_dtype
from flashtrain.kernels.attention_fwd import LOG2E
from flashtrain.kernels.configs import device_capability

LN2 = math.log(2.0)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535  # CUDA's limit on grid dims y and z, where heads and batch go


# The dropout seed travels as a CPU int64 tensor, not an int: a traced int would be baked into a compiled
# graph as a constant (the same mask every step), and reading a CPU tensor costs no device sync.
@torch.library.custom_op("flashtrain::attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      key_padding_mask: Tensor | None, dropout_p: float,
                      seed: Tensor | None) -> tuple[Tensor, Tensor]:
    return attention_fwd(q, k, v, causal, scale, key_padding_mask, dropout_p, _seed_value(seed))


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale, key_padding_mask, dropout_p, seed):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("flashtrain::attention_bwd", mutates_args=())
def _attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      dlse: Tensor | None, causal: bool, scale: float, key_padding_mask: Tensor | None,
                      dropout_p: float, seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return attention_bwd(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p,
                         _seed_value(seed))


@_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _seed_value(seed: Tensor | None) -> int:
    return 0 if seed is None else int(seed)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, key_padding_mask, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p


def kernel_dlse(dlse2: Tensor | None) -> Tensor | None:
    """The gradient of the ops' log2-domain LSE output as the backward kernels take it: the gradient of the
    natural-log LSE (None when the LSE was not used)."""
    return None if dlse2 is None else dlse2 * LOG2E


def _backward_with(bwd, ctx, dout, dlse2):
    """The backward, with ``bwd`` the custom op (compiled graphs) or ``_eager_bwd``."""
    q, k, v, out, lse2, key_padding_mask, seed = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse2, kernel_dlse(dlse2), ctx.causal, ctx.scale, key_padding_mask,
                     ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None, None


def _backward(ctx, dout, dlse2):
    return _backward_with(_attention_bwd_op, ctx, dout, dlse2)


torch.library.register_autograd("flashtrain::attention_fwd", _backward, setup_context=_setup_context)


def _eager_bwd(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p, seed):
    return attention_bwd(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p,
                         _seed_value(seed))


class _EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward, minus torch.library's dispatch (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, key_padding_mask, dropout_p, seed):
        output = attention_fwd(q, k, v, causal, scale, key_padding_mask, dropout_p, _seed_value(seed))
        _setup_context(ctx, (q, k, v, causal, scale, key_padding_mask, dropout_p, seed), output)
        ctx.set_materialize_grads(False)  # an unused LSE sends None, and the kernels skip its term
        return output

    @staticmethod
    def backward(ctx, dout, dlse2):
        return _backward_with(_eager_bwd, ctx, dout, dlse2)


SEED_BOUND = 2**31 - 1  # seeds stay int32-sized, so every seed runs the same compiled kernel


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                    key_padding_mask: Tensor | None = None, dropout_p: float = 0.0, return_lse: bool = False,
                    fp8: str | None = None, hadamard: bool = True, smooth_k: bool = True):
    """Exact softmax attention, computed in tiles by Triton kernels (no seq_q x seq_k matrix in memory).

    Args:
        q: (batch, heads_q, seq_q, head_dim). Any strides: a ``(B, N, H, D).transpose(1, 2)`` view works
            without a copy.
        k, v: (batch, heads_kv, seq_k, head_dim); heads_q must be a multiple of heads_kv (GQA / MQA; the
            kernels index the shared KV head, they never repeat K/V in memory).
        causal: mask aligned bottom-right, as flash-attn: query i sees keys j <= i + seq_k - seq_q. A query
            that sees no key gets an output of zeros and an LSE of -inf.
        scale: softmax scale; defaults to 1/sqrt(head_dim).
        key_padding_mask: optional (batch, seq_k), with ``nn.MultiheadAttention``'s meaning: bool, True where
            a key is padding and must not be attended to; or float, added to the scaled scores of that key
            (-inf = padding; no gradient flows to it). Applied inside the kernels as a per-key bias, so
            nothing (seq_q, seq_k)-sized is built; combines with ``causal``. A query that sees no key gets
            zeros (LSE -inf).
        dropout_p: attention dropout probability in [0, 1): each attention probability is zeroed with
            probability p and the kept ones are scaled by 1 / (1 - p), as ``nn.Dropout`` on the weights.
            The mask comes from Philox inside the kernels, keyed by a seed drawn from torch's default
            (CPU) generator, so ``torch.manual_seed`` makes it reproducible; the backward regenerates it.
            Pass 0.0 in evaluation (this function does not look at any module's training flag).
        return_lse: also return the natural-log logsumexp of each row's scaled scores (before dropout).
        fp8: None (default: the 16/32/64-bit kernels), "forward" (the forward's two matmuls in FP8 e4m3 with
            per-tile scales; the backward's matmuls in the input precision, on the forward's scores
            recomputed from its saved FP8 Q and K) or "full" (the backward's four matmuls in FP8 too, with
            per-tile scales for dO and dS). FP8 takes float16/bfloat16
            (or float32) inputs and returns the input dtype; quantisation happens inside. Not combinable with
            key_padding_mask or dropout yet. Numerics: ``flashtrain.fp8``.
        hadamard: with fp8, rotate Q and K by a fixed random-sign Hadamard matrix before quantising
            (incoherent processing: Q K^T is unchanged, outlier channels are spread out, the error drops).
            On by default; ignored without fp8.
        smooth_k: with fp8, subtract the keys' mean over the sequence (per batch and KV head; the mean of
            every (N // 256)-th key, ``flashtrain.fp8``) before quantising. Softmax is unchanged (each
            query's scores move by one constant), and the tiles' scales no longer carry the component all
            keys share, which would otherwise dominate K's rounding and, in fp8="full", dQ's (dS's rows sum
            to zero, so dQ = dS K cancels that component; its rounding error does not). The returned LSE
            is corrected back. On by default; ignored without fp8.

    dtypes: float16, bfloat16, float32 (full fp32 products unless ``torch.backends.cuda.matmul.allow_tf32``)
    and float64; q, k and v share one and the output has it. head_dim 1..256, any sequence lengths.
    Differentiable in q, k and v (and through the LSE, if returned).

    CUDA tensors run compiled kernels. CPU tensors run the same kernels through Triton's interpreter
    (slow: for tests and tiny runs), which needs ``TRITON_INTERPRET=1`` in the environment before triton
    is first imported; without it a CPU call raises a RuntimeError that says so.

    Returns:
        out (batch, heads_q, seq_q, head_dim), or (out, lse) with lse float32 (batch, heads_q, seq_q).
    """
    scale = _check_inputs(q, k, v, causal, scale, return_lse, key_padding_mask, dropout_p)
    if fp8 is not None or not isinstance(hadamard, bool) or not isinstance(smooth_k, bool):
        _check_fp8(q, key_padding_mask, dropout_p, fp8, hadamard, smooth_k)
    if fp8 is not None:
        from .fp8 import fp8_attention  # imports this module: resolved at call time

        out, lse2 = fp8_attention(q, k, v, causal, scale, fp8, hadamard, smooth_k, return_lse)
    else:
        seed = torch.randint(SEED_BOUND, (), dtype=torch.int64) if dropout_p > 0 else None
        attend = _attention_fwd_op if torch.compiler.is_compiling() else _EagerAttention.apply
        out, lse2 = attend(q, k, v, causal, scale, key_padding_mask, float(dropout_p), seed)
    if return_lse:
        return out, (lse2 * LN2).float()  # natural log; the multiply runs in lse2's precision
    return out


def _check_fp8(q, key_padding_mask, dropout_p, fp8, hadamard, smooth_k) -> None:
    if fp8 not in (None, "forward", "full"):
        raise ValueError(f"flash_attention: fp8={fp8!r}; expected None, 'forward' or 'full'")
    for name, flag in (("hadamard", hadamard), ("smooth_k", smooth_k)):
        if not isinstance(flag, bool):
            raise TypeError(f"flash_attention: {name} must be a bool, got {flag!r}")
    if fp8 is None:
        return
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_attention: fp8={fp8!r} takes float16, bfloat16 or float32 inputs; got {q.dtype}")
    if key_padding_mask is not None or dropout_p:
        raise ValueError(f"flash_attention: fp8={fp8!r} does not support key_padding_mask or dropout_p yet; "
                         "use fp8=None for them")
    if q.device.type == "cuda" and device_capability(q.device) < (8, 9):
        raise ValueError(f"flash_attention: fp8={fp8!r} needs FP8 tensor cores (compute capability 8.9+); "
                         f"{torch.cuda.get_device_name(q.device)} has "
                         f"{'.'.join(map(str, device_capability(q.device)))}")


def _check_padding_and_dropout(q, k, key_padding_mask, dropout_p) -> None:
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or not (key_padding_mask.dtype == torch.bool
                                                             or key_padding_mask.is_floating_point()):
            what = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError("flash_attention: key_padding_mask must be a bool tensor (True = padding) or a float "
                            f"tensor (added to the scores), got {what}")
        if key_padding_mask.requires_grad:
            raise ValueError("flash_attention: key_padding_mask requires grad, but no gradient flows to it; "
                             "pass key_padding_mask.detach()")
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(f"flash_attention: key_padding_mask has shape {tuple(key_padding_mask.shape)}; "
                             f"expected (batch, seq_k) = {expected}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"flash_attention: key_padding_mask is on {key_padding_mask.device}, q on {q.device}; "
                             "expected one device")
    if (not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool)
            or not 0.0 <= dropout_p < 1.0):
        raise ValueError(f"flash_attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _check_inputs(q, k, v, causal, scale, return_lse, key_padding_mask, dropout_p) -> float:
    """Validate the arguments of ``flash_attention`` before any kernel runs; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"flash_attention: {name} has dtype {t.dtype}; expected one of "
                            "torch.float16, torch.bfloat16, torch.float32, torch.float64")
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (batch, heads, seq, head_dim); "
                             f"got {t.dim()}-D with shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k and v must be on one device; got q on {q.device}, "
                         f"k on {k.device}, v on {v.device}")
    batch, heads_q, _, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"flash_attention: batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected the same dim 0")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"flash_attention: head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected the same last dim")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same "
                         "(heads_kv, seq_k)")
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"flash_attention: heads_q={heads_q} (q.shape[1]) must be a multiple of "
                         f"heads_kv={heads_kv} (k.shape[1])")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim={head_dim} (q.shape[3]); expected 1..{MAX_HEAD_DIM}")
    if batch > MAX_GRID_DIM or heads_q > MAX_GRID_DIM:
        raise ValueError(f"flash_attention: batch={batch} and heads_q={heads_q} must each be at most "
                         f"{MAX_GRID_DIM}")
    if not isinstance(causal, bool):
        raise TypeError(f"flash_attention: causal must be a bool, got {causal!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"flash_attention: return_lse must be a bool, got {return_lse!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"flash_attention: scale must be a finite real number or None, got {scale!r}")
    _check_padding_and_dropout(q, k, key_padding_mask, dropout_p)
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("flash_attention: q, k, v are CPU tensors, which run only through Triton's "
                           "interpreter; set TRITON_INTERPRET=1 in the environment before triton is "
                           "imported (before importing flashtrain), or move the tensors to a CUDA device")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: tensors on {q.device} are not supported; expected cuda "
                         "(or cpu through Triton's interpreter)")
    return float(scale)
