"""``flash_attention``: the public op and its ``torch.library`` registration.

The kernels are wrapped in two custom ops, ``flashtrain::attention_fwd`` and ``flashtrain::attention_bwd``,
each with a fake (meta) implementation, and joined by ``register_autograd``. ``torch.compile`` therefore
sees one opaque node per direction: ``fullgraph=True`` traces through ``flash_attention`` with no graph
break, and the compiled graph launches the same kernels as eager mode. In eager mode ``flash_attention``
calls the same launchers through a plain ``torch.autograd.Function``: torch.library's dispatch costs about
as much host time as everything else in a call (624 vs 313 us per forward + backward with the kernel launches
stubbed out, on a 2-core x86 host), and short kernels wait for the host.

Which kernel runs inside each op is ``dispatch``'s decision. Inside the ops the LSE lives in the log2 domain, as
the kernels use it; ``flash_attention`` converts it to natural log for the caller.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from flashtrain.kernels import hopper as hopper_kernels
from flashtrain.kernels.attention.bwd import attention_bwd
from flashtrain.kernels.attention.fwd import attention_fwd
from flashtrain.kernels.common import lse_dtype
from flashtrain.kernels.masking import Varlen

from . import dispatch
from .checks import check_fp8, check_inputs, check_window
from .fp8 import fp8_attention
from .lse import kernel_dlse, natural_lse


def forward_kernels(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, key_padding_mask: Tensor | None,
                    dropout_p: float, seed: int, window_size: tuple[int, int] = (-1, -1),
                    varlen: Varlen | None = None) -> tuple[Tensor, Tensor]:
    """(out, log2-domain LSE) from the forward ``dispatch.forward`` picks."""
    choice = dispatch.forward(q, k, v, causal, scale, key_padding_mask, dropout_p, window_size, varlen is not None)
    if choice.kernel == dispatch.HOPPER:
        return hopper_kernels.kernel_module("fwd").attention_fwd_hopper(q, k, v, causal, scale)
    return attention_fwd(q, k, v, causal, scale, key_padding_mask, dropout_p, seed, window_size, varlen)


def backward_kernels(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
                     causal: bool, scale: float, key_padding_mask: Tensor | None = None, dropout_p: float = 0.0,
                     seed: int = 0, window_size: tuple[int, int] = (-1, -1),
                     varlen: Varlen | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the backward ``dispatch.backward`` picks; ``lse`` log2-domain, ``dlse`` as the kernels
    take it (``lse.kernel_dlse``)."""
    choice = dispatch.backward(q, k, v, dout, causal, key_padding_mask, dropout_p, window_size, varlen is not None)
    if choice.kernel == dispatch.HOPPER:
        return hopper_kernels.kernel_module("bwd").attention_bwd_hopper(dout, q, k, v, out, lse, dlse, causal, scale)
    return attention_bwd(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p, seed,
                         window_size, varlen, split_dkdv=choice.kernel == dispatch.TRITON_SPLIT)


def _varlen(cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
            max_seqlen_k: int) -> Varlen | None:
    return None if cu_seqlens_q is None else Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


# The dropout seed travels as a CPU int64 tensor, not an int: a traced int would be baked into a compiled
# graph as a constant (the same mask every step), and reading a CPU tensor costs no device sync.
@torch.library.custom_op("flashtrain::attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                      key_padding_mask: Tensor | None, dropout_p: float, seed: Tensor | None,
                      window_left: int, window_right: int, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                      max_seqlen_q: int, max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    return forward_kernels(q, k, v, causal, scale, key_padding_mask, dropout_p, _seed_value(seed),
                           (window_left, window_right), _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@_attention_fwd_op.register_fake
def _(q, k, v, causal, scale, key_padding_mask, dropout_p, seed, window_left, window_right, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("flashtrain::attention_bwd", mutates_args=())
def _attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      dlse: Tensor | None, causal: bool, scale: float, key_padding_mask: Tensor | None,
                      dropout_p: float, seed: Tensor | None, window_left: int, window_right: int,
                      cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
                      max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor]:
    return backward_kernels(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p,
                            _seed_value(seed), (window_left, window_right),
                            _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p, seed, *mask):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _seed_value(seed: Tensor | None) -> int:
    return 0 if seed is None else int(seed)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, key_padding_mask, dropout_p, seed, window_left, window_right, cu_q, cu_k, max_q, max_k = (
        inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed, cu_q, cu_k)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
    ctx.window, ctx.max_seqlens = (window_left, window_right), (max_q, max_k)


def _backward_with(bwd, ctx, dout, dlse2):
    """The backward, with ``bwd`` the custom op (compiled graphs) or ``_eager_bwd``."""
    q, k, v, out, lse2, key_padding_mask, seed, cu_q, cu_k = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse2, kernel_dlse(dlse2), ctx.causal, ctx.scale, key_padding_mask,
                     ctx.dropout_p, seed, *ctx.window, cu_q, cu_k, *ctx.max_seqlens)
    return dq, dk, dv, *([None] * 11)


def _backward(ctx, dout, dlse2):
    return _backward_with(_attention_bwd_op, ctx, dout, dlse2)


torch.library.register_autograd("flashtrain::attention_fwd", _backward, setup_context=_setup_context)


def _eager_bwd(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p, seed, window_left,
               window_right, cu_q, cu_k, max_q, max_k):
    return backward_kernels(dout, q, k, v, out, lse, dlse, causal, scale, key_padding_mask, dropout_p,
                            _seed_value(seed), (window_left, window_right), _varlen(cu_q, cu_k, max_q, max_k))


class _EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward, minus torch.library's dispatch (see the module docstring)."""

    @staticmethod
    def forward(ctx, *inputs):
        (q, k, v, causal, scale, key_padding_mask, dropout_p, seed, window_left, window_right, cu_q, cu_k, max_q,
         max_k) = inputs
        output = forward_kernels(q, k, v, causal, scale, key_padding_mask, dropout_p, _seed_value(seed),
                                 (window_left, window_right), _varlen(cu_q, cu_k, max_q, max_k))
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # an unused LSE sends None, and the kernels skip its term
        return output

    @staticmethod
    def backward(ctx, dout, dlse2):
        return _backward_with(_eager_bwd, ctx, dout, dlse2)


SEED_BOUND = 2**31 - 1  # seeds stay int32-sized, so every seed runs the same compiled kernel


def attend(*inputs) -> tuple[Tensor, Tensor]:
    """(out, log2-domain LSE) through the custom op when compiling or under a dispatch mode (selective activation
    checkpointing saves the op's outputs by its name, ``ATTENTION_FORWARD_OPS``), else the eager autograd function."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return _attention_fwd_op(*inputs)
    return _EagerAttention.apply(*inputs)


# The forward custom ops, for policies that save their outputs (selective activation checkpointing)
ATTENTION_FORWARD_OPS = (torch.ops.flashtrain.attention_fwd.default, torch.ops.flashtrain.attention_fp8_fwd.default)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                    window_size: tuple[int, int] = (-1, -1), key_padding_mask: Tensor | None = None,
                    dropout_p: float = 0.0, return_lse: bool = False, fp8: str | None = None, hadamard: bool = True,
                    smooth_k: bool = True):
    """Exact softmax attention, computed in tiles by Triton kernels (no seq_q x seq_k matrix in memory).

    Args:
        q: (batch, heads_q, seq_q, head_dim). Any strides: a ``(B, N, H, D).transpose(1, 2)`` view works
            without a copy.
        k, v: (batch, heads_kv, seq_k, head_dim); heads_q must be a multiple of heads_kv (GQA / MQA; the
            kernels index the shared KV head, they never repeat K/V in memory).
        causal: mask aligned bottom-right, as flash-attn: query i sees keys j <= i + seq_k - seq_q. A query
            that sees no key gets an output of zeros and an LSE of -inf.
        scale: softmax scale; defaults to 1/sqrt(head_dim).
        window_size: (left, right), flash-attn's sliding window: query i sees key j iff
            i + seq_k - seq_q - left <= j <= i + seq_k - seq_q + right; -1 leaves that side unbounded, and
            ``causal`` caps the right side at 0. Key blocks outside every row's window are never loaded. A query
            that sees no key gets zeros (LSE -inf).
        key_padding_mask: optional (batch, seq_k), with ``nn.MultiheadAttention``'s meaning: bool, True where
            a key is padding and must not be attended to; or float, added to the scaled scores of that key
            (-inf = padding; no gradient flows to it). Applied inside the kernels as a per-key bias, so
            nothing (seq_q, seq_k)-sized is built; combines with ``causal`` and windows. A query that sees no key gets
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
            key_padding_mask, dropout or a window yet. Numerics: docs/fp8.md.
        hadamard: with fp8, rotate Q and K by a fixed random-sign Hadamard matrix before quantising
            (incoherent processing: Q K^T is unchanged, outlier channels are spread out, the error drops).
            On by default; ignored without fp8.
        smooth_k: with fp8, subtract the keys' mean over the sequence (per batch and KV head; the mean of
            every (N // 256)-th key) before quantising. Softmax is unchanged (each
            query's scores move by one constant), and the tiles' scales no longer carry the component all
            keys share, which would otherwise dominate K's rounding and, in fp8="full", dQ's (dS's rows sum
            to zero, so dQ = dS K cancels that component; its rounding error does not). The returned LSE
            is corrected back. On by default; ignored without fp8.

    dtypes: float16, bfloat16, float32 (full fp32 products unless ``torch.backends.cuda.matmul.allow_tf32``)
    and float64; q, k and v share one and the output has it. head_dim 1..256, any sequence lengths.
    Differentiable in q, k and v (and through the LSE, if returned).

    CUDA tensors run compiled kernels (``flashtrain.ops.dispatch`` picks which). CPU tensors run the same kernels
    through Triton's interpreter (slow: for tests and tiny runs), which needs ``TRITON_INTERPRET=1`` in the
    environment before triton is first imported (else a RuntimeError says so) and cannot compute bfloat16 (a
    TypeError says so).

    Returns:
        out (batch, heads_q, seq_q, head_dim), or (out, lse) with lse float32 (batch, heads_q, seq_q).
    """
    scale = check_inputs(q, k, v, causal, scale, return_lse, key_padding_mask, dropout_p)
    window = (-1, -1) if window_size == (-1, -1) else check_window(window_size)
    if fp8 is not None or not isinstance(hadamard, bool) or not isinstance(smooth_k, bool):
        check_fp8(q, key_padding_mask, dropout_p, fp8, hadamard, smooth_k)
        if fp8 is not None and window != (-1, -1):
            raise ValueError(f"flash_attention: fp8={fp8!r} does not support window_size={window_size!r} yet; "
                             "use fp8=None for windows")
    if fp8 is not None:
        out, lse2 = fp8_attention(q, k, v, causal, scale, fp8, hadamard, smooth_k, return_lse)
    else:
        seed = torch.randint(SEED_BOUND, (), dtype=torch.int64) if dropout_p > 0 else None
        out, lse2 = attend(q, k, v, causal, scale, key_padding_mask, float(dropout_p), seed, *window,
                           None, None, 0, 0)
    if return_lse:
        return out, natural_lse(lse2)
    return out


