"""The Hopper (sm_90) kernels, written in Triton's Gluon dialect: ``fwd`` (16-bit forward), ``bwd`` (16-bit
backward at head_dim 64), ``fp8_fwd`` (FP8 forward), ``common`` (the Gluon pieces they share), ``tiles`` (their
fixed configurations). Which of them runs for a call is decided in ``flashtrain.ops.dispatch``.

Importing this package imports no Gluon: ``kernel_module`` does, on first use, and returns None where this Triton
lacks Gluon's Hopper API (the Triton kernels run there instead).
"""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def kernel_module(name: str):
    """The Gluon kernel module ``name`` of this package ('fwd', 'bwd', 'fp8_fwd'), imported on first use, or None
    where this triton lacks Gluon's Hopper API."""
    try:
        return importlib.import_module(f".{name}", __name__)
    except ImportError:
        return None


def tma_addressable(t: torch.Tensor) -> bool:
    """TMA's rules for the per-(batch, head) (seq, head_dim) tiles: unit stride along head_dim, a 16-byte aligned
    start for every (batch, head), a row stride of a multiple of 16 bytes."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0 and t.stride(2) * size % 16 == 0
            and all(t.stride(d) * size % 16 == 0 for d in (0, 1) if t.shape[d] > 1))
