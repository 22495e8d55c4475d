"""Causal attention backends for the GPT: the `attn=` choice of the trainer.

Each is ``attn(q, k, v, mask=None) -> out`` on (B, nh, T, hs) tensors, ``mask`` a ``model.AttentionMask`` (the
documents and the sliding window, or None); ``conf/attn/*.yaml`` name them (with options, e.g. ``fp8: forward``)
and ``get`` looks them up. flash runs documents as packed sequences (``flash_attention_varlen``) and windows in the
kernels; sdpa and eager build the explicit (T, T) mask. Context parallelism (a mask with a process group): flash
runs flashtrain's ``ring_attention`` over the ranks' shards, sdpa PyTorch's own ring over its SDPA kernels
(``torch_ring_attention``).
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from flashtrain.distributed import ring_attention
from flashtrain.distributed.torch_ring import torch_ring_attention
from flashtrain.ops.attention import flash_attention
from flashtrain.ops.varlen import flash_attention_varlen


def _window(mask) -> tuple[int, int]:
    return (-1, -1) if mask is None or mask.window is None else (mask.window, 0)


def _refuse_context_parallel(name: str, mask) -> None:
    if mask is not None and mask.group is not None:
        raise ValueError(f"attn={name} has no context parallelism (ring attention); use attn=flash or attn=sdpa")


def flash(q, k, v, mask=None):
    """flashtrain's Triton kernels; documents as packed sequences, one launch for the batch; with a context-parallel
    group, ``ring_attention`` over the group's shards (q, k, v: this rank's (B, nh, T / P, hs))."""
    if mask is not None and mask.group is not None:
        if mask.documents is not None or mask.window is not None:
            raise ValueError("attn=flash with context parallelism has no document masking or sliding windows yet")
        return ring_attention(q, k, v, causal=True, group=mask.group)
    if mask is None or mask.documents is None:
        return flash_attention(q, k, v, causal=True, window_size=_window(mask))
    B, H, T, D = q.shape
    docs = mask.documents
    # (B, nh, T, hs) views of (B, T, nh, hs) tensors -> (B * T, nh, hs) views, no copy
    packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
    out = flash_attention_varlen(*packed, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen,
                                 causal=True, window_size=_window(mask))
    return out.view(B, T, H, D).transpose(1, 2)


def flash_fp8(q, k, v, mask=None, fp8: str = "forward", hadamard: bool = True, smooth_k: bool = True):
    """flashtrain's FP8 path: "forward" (FP8 forward, 16-bit backward) or "full" (FP8 backward too), with
    ``flash_attention``'s Hadamard rotation and K smoothing (both on by default). No documents or windows."""
    if mask is not None and (mask.documents is not None or mask.window is not None):
        raise ValueError("attn=flash_fp8 has no document masking or sliding windows yet; use attn=flash")
    _refuse_context_parallel("flash_fp8", mask)
    return flash_attention(q, k, v, causal=True, fp8=fp8, hadamard=hadamard, smooth_k=smooth_k)


def sdpa(q, k, v, mask=None):
    """PyTorch's scaled_dot_product_attention (it picks cuDNN / flash / efficient / math itself); documents and
    windows through an explicit (T, T) boolean mask; with a context-parallel group, PyTorch's ring attention over
    SDPA's flash kernel (``torch_ring_attention``, what its ``context_parallel`` runs)."""
    if mask is not None and mask.group is not None:
        if mask.documents is not None or mask.window is not None:
            raise ValueError("attn=sdpa with context parallelism has no document masking or sliding windows")
        return torch_ring_attention(q, k, v, group=mask.group)
    if mask is None or (mask.documents is None and mask.window is None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.shape[-2], q.device))


def eager(q, k, v, mask=None, causal: bool = True):
    """Matmul, softmax, matmul: the full (T, T) score matrix in memory, as unfused PyTorch code has it."""
    _refuse_context_parallel("eager", mask)
    T = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
    if mask is not None:
        scores = scores.masked_fill(~mask.dense(T, q.device), float("-inf"))
    elif causal:
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


BACKENDS = {"flash": flash, "flash_fp8": flash_fp8, "sdpa": sdpa, "eager": eager}


def get(name: str, **options):
    """The backend called ``name``, with ``options`` (its keyword arguments) bound; a clear error for an
    unknown name or option."""
    if name not in BACKENDS:
        raise ValueError(f"attn={name!r} is not an attention backend; expected one of {sorted(BACKENDS)}")
    fn = BACKENDS[name]
    accepted = [p for p in list(inspect.signature(fn).parameters)[3:] if p not in ("mask", "causal")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"attn={name!r} takes the options {accepted}; got unknown {unknown}")
    return functools.partial(fn, **options) if options else fn
