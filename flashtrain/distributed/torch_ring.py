"""PyTorch's own ring attention over its SDPA kernels: the baseline beside ``ring_attention``.

``torch.distributed.tensor.experimental.context_parallel`` shards a model's buffers and reroutes
``F.scaled_dot_product_attention`` to a ring of SDPA calls over DTensors. The trainer already holds each rank's shard,
in the layout PyTorch's head-tail load balancer uses too (rank r: chunks r and 2P-1-r of 2P), so this calls the ring
underneath that context manager directly: ``_templated_ring_attention`` and its backward (private, torch 2.11),
which run one SDPA kernel call per ring step and merge the partial outputs through their LSE in float32. The kernel
is SDPA's flash kernel on CUDA (FlashAttention-2) and its CPU flash kernel elsewhere (the gloo tests).

Causal only (PyTorch's load balance assumes it); float16 or bfloat16 on CUDA (the flash kernel's types); keys and
values with fewer heads (GQA) are repeated to the query heads first, as the SDPA kernels take equal head counts.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from .ring import check_shards

FN = "torch_ring_attention"
_state = threading.local()  # inside_ring(): a ring's forward is running on this thread


def inside_ring() -> bool:
    """Whether this thread is inside the ring's forward: selective checkpointing then leaves the per-block SDPA
    calls unsaved (their P partial outputs would cost a whole sequence's output a layer) and recomputes the ring."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _in_ring():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _ring_module():
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as error:  # private: present in the pinned torch 2.11
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.tensor.experimental._context_parallel:"
                           " PyTorch's ring attention (attn=sdpa with context_parallel > 1) needs the torch this "
                           "package pins (2.11); attn=flash runs flashtrain's ring on any") from error
    if not _attention._cp_options.enable_load_balance:
        raise RuntimeError("torch's context-parallel load balance is off (_cp_options.enable_load_balance=False): "
                           "the shards here are in its head-tail layout, which needs it on")
    return _attention


def _kernels(device: torch.device):
    """(forward op, backward op, forward kwargs, backward kwargs from the forward's extra outputs) of the SDPA flash
    kernel for ``device``."""
    aten = torch.ops.aten
    if device.type == "cuda":
        def backward_kwargs(rest):  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask
            cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
            return dict(cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0,
                        philox_seed=seed, philox_offset=offset)
        return (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward.default,
                dict(dropout_p=0.0), backward_kwargs)
    return (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default, dict(dropout_p=0.0),
            lambda rest: dict(dropout_p=0.0))


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _ring_module()
        forward, _, kwargs, _ = _kernels(q.device)
        with _in_ring():
            out, lse, *rest = ring._templated_ring_attention(group, 2, forward, q, k, v, is_causal=True, scale=scale,
                                                             **kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.rest = group, scale, rest
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ring = _ring_module()
        q, k, v, out, lse = ctx.saved_tensors
        _, backward, _, backward_kwargs = _kernels(q.device)
        dq, dk, dv, *_ = ring._templated_ring_attention_backward(
            ctx.group, 2, backward, grad_out.contiguous(), "grad_out", q, k, v, out, lse, is_causal=True,
            scale=ctx.scale, **backward_kwargs(ctx.rest))
        return dq, dk, dv, None, None


def torch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention over the full sequence from every rank's shard, by PyTorch's ring (see the module docstring).

    q: (batch, heads_q, N / P, head_dim), k, v: (batch, heads_kv, N / P, head_dim), this rank's shards in the
    load-balanced layout (``shard_sequence``), heads_q a multiple of heads_kv; group: the P ranks (default: the
    world); scale: default 1 / sqrt(head_dim). Returns this rank's (batch, heads_q, N / P, head_dim) rows.
    Differentiable in q, k, v."""
    scale = check_shards(FN, q, k, v, True, scale, False)
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{FN}: q is {q.dtype} on CUDA: PyTorch's ring runs SDPA's flash kernel there, which takes "
                         "float16 or bfloat16 (trainer.precision=bf16-mixed), or use attn=flash")
    if q.shape[1] != k.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return _TorchRing.apply(q, k, v, group if group is not None else dist.group.WORLD, scale)
