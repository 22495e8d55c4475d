"""Hugging Face transformers: ``attn_implementation="flashtrain"``.

Importing this module registers flashtrain with transformers (``pip install flashtrain[transformers]``)::

    import flashtrain.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtrain")

transformers treats every implementation whose name contains "flash" as a FlashAttention-style kernel: it
builds 2-D padding masks, and its ``modeling_flash_attention_utils._flash_attention_forward`` un-pads padded
or packed batches into variable-length sequences and calls the kernel's ``flash_attn_func`` (fixed length)
or ``flash_attn_varlen_func`` (variable length). This module supplies those two functions on top of
``flash_attention``, with GQA on the shared KV heads and flash-attn's bottom-right causal alignment.
A padded batch (a 2-D mask) skips the un-padding: the mask goes to the kernels as ``key_padding_mask``, one
launch for the whole batch (outputs at padded query positions are zeros or unused values, as the loss and
generation ignore them). Attention dropout runs in the kernels.

Two private transformers functions are involved, both checked by the tests:
  * ``_lazy_imports``, which loads a flash implementation and knows only the flash-attn packages and hub
    kernels: ``register`` wraps it so that the name "flashtrain" returns the functions below and every other
    name goes through unchanged;
  * ``_flash_attention_forward``, called by ``flashtrain_attention_forward`` below in place of transformers'
    generic wrapper, which would cast float32 inputs to half precision (flash-attn has no float32; flashtrain
    computes float32 and float64 as they are). Sliding-window attention raises: the kernels have no window.

The tests run a Llama (GQA) and a GPT-2 model, padded and not, against ``attn_implementation="eager"``
in float32 and ``"sdpa"`` in float64.
"""

from __future__ import annotations

import torch
import transformers.modeling_flash_attention_utils as fa_utils
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from flashtrain.ops.attention import flash_attention

NAME = "flashtrain"


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False):
    """flash-attn's fixed-length API: q (B, L, H, D), k/v (B, S, H_kv, D) -> (B, L, H, D)."""
    out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                          scale=softmax_scale, dropout_p=dropout_p)  # (B, H, L, D)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False):
    """flash-attn's variable-length API: sequences concatenated along dim 0, q (total_q, H, D), k/v
    (total_k, H_kv, D), sequence i at rows cu_seqlens[i]:cu_seqlens[i + 1]. Returns (total_q, H, D).

    One kernel launch per sequence (each as a batch of one): exact, with a launch cost per sequence.
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for i in range(len(starts_q) - 1):
        qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0)  # (1, heads, len_i, D)
                      for t, a, b in ((q, starts_q[i], starts_q[i + 1]), (k, starts_k[i], starts_k[i + 1]),
                                      (v, starts_k[i], starts_k[i + 1])))
        outs.append(flash_attention(qi, ki, vi, causal=causal, scale=softmax_scale,
                                    dropout_p=dropout_p)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def flashtrain_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                 scaling: float | None = None, sliding_window: int | None = None,
                                 softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query (B, H, L, D), key/value (B, H_kv, S, D), a 2-D padding
    mask or None. Returns ((B, L, H, D), None)."""
    if sliding_window is not None:
        raise ValueError(f"attn_implementation='flashtrain' has no sliding-window attention "
                         f"(sliding_window={sliding_window}); use 'sdpa' for this model")
    kwargs.pop("output_attentions", None)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 2 and not softcap:
        # (B, S) with 1/True = token, 0/False = padding: straight to the kernels' key padding mask
        out = flash_attention(query, key, value, causal=is_causal, scale=scaling,
                              key_padding_mask=~attention_mask.bool(), dropout_p=dropout)  # (B, H, L, D)
        return out.transpose(1, 2), None
    out = fa_utils._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
        query_length=query.shape[2], is_causal=is_causal, dropout=dropout, softmax_scale=scaling, softcap=softcap,
        use_top_left_mask=False, target_dtype=None, attn_implementation=NAME, **kwargs)
    return out, None


_original_lazy_imports = fa_utils._lazy_imports


def _lazy_imports(implementation, *args, **kwargs):
    if implementation == NAME:
        return flash_attn_func, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
    return _original_lazy_imports(implementation, *args, **kwargs)


def register() -> None:
    """Register ``attn_implementation="flashtrain"`` (idempotent; done on import)."""
    fa_utils._lazy_imports = _lazy_imports
    AttentionInterface.register(NAME, flashtrain_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
