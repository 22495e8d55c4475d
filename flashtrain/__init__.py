"""flashtrain: Triton FlashAttention for long-context PyTorch training.

``flash_attention`` is the op (``flashtrain.ops``); ``FlashMultiheadAttention`` is a drop-in
``nn.MultiheadAttention`` and ``swap_attention(model)`` swaps it in (``flashtrain.nn``); the kernels live in
``flashtrain.kernels``, the GPT trainer in ``flashtrain.trainer``.

The names below load on first use, so importing ``flashtrain.trainer.cli`` (the console entry point) imports no
Triton before it has chosen Triton's interpreter on a machine without a GPU.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"
__all__ = ["flash_attention", "flash_attention_varlen", "FlashMultiheadAttention", "swap_attention",
           "unswap_attention"]

_HOMES = {"flash_attention": "flashtrain.ops.attention", "flash_attention_varlen": "flashtrain.ops.varlen",
          "FlashMultiheadAttention": "flashtrain.nn.multihead",
          "swap_attention": "flashtrain.nn.multihead", "unswap_attention": "flashtrain.nn.multihead"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'flashtrain' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
