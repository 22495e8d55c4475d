"""Causal attention backends for the GPT: the `attn=` choice of the trainer.

Each is ``attn(q, k, v) -> out`` on (B, nh, T, hs) tensors; ``conf/attn/*.yaml`` name them (with options,
e.g. ``fp8: forward``) and ``get`` looks them up.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from flashtrain.ops.attention import flash_attention


def flash(q, k, v):
    """flashtrain's Triton kernels."""
    return flash_attention(q, k, v, causal=True)


def flash_fp8(q, k, v, fp8: str = "forward", hadamard: bool = True, smooth_k: bool = True):
    """flashtrain's FP8 path: "forward" (FP8 forward, 16-bit backward) or "full" (FP8 backward too), with
    ``flash_attention``'s Hadamard rotation and K smoothing (both on by default)."""
    return flash_attention(q, k, v, causal=True, fp8=fp8, hadamard=hadamard, smooth_k=smooth_k)


def sdpa(q, k, v):
    """PyTorch's scaled_dot_product_attention (it picks cuDNN / flash / efficient / math itself)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager(q, k, v, causal: bool = True):
    """Matmul, softmax, matmul: the full (T, T) score matrix in memory, as unfused PyTorch code has it."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


BACKENDS = {"flash": flash, "flash_fp8": flash_fp8, "sdpa": sdpa, "eager": eager}


def get(name: str, **options):
    """The backend called ``name``, with ``options`` (its keyword arguments) bound; a clear error for an
    unknown name or option."""
    if name not in BACKENDS:
        raise ValueError(f"attn={name!r} is not an attention backend; expected one of {sorted(BACKENDS)}")
    fn = BACKENDS[name]
    accepted = list(inspect.signature(fn).parameters)[3:]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"attn={name!r} takes the options {accepted}; got unknown {unknown}")
    return functools.partial(fn, **options) if options else fn
