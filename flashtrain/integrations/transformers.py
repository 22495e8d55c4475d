"""Hugging Face transformers: ``attn_implementation="flashtrain"``.

Importing this module registers flashtrain with transformers (``pip install flashtrain[transformers]``)::

    import flashtrain.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtrain")

transformers treats every implementation whose name contains "flash" as a FlashAttention-style kernel: it
builds 2-D padding masks (``masking_utils.flash_attention_mask``: None when nothing is padded, for full and
sliding-window layers alike), and its ``modeling_flash_attention_utils._flash_attention_forward`` un-pads padded
or packed batches into variable-length sequences and calls the kernel's ``flash_attn_func`` (fixed length)
or ``flash_attn_varlen_func`` (variable length). This module supplies those two functions on top of
``flash_attention`` and ``flash_attention_varlen``, with GQA on the shared KV heads and flash-attn's bottom-right
causal alignment:
  * a padded batch (a 2-D mask) skips the un-padding: the mask goes to the kernels as ``key_padding_mask``, one
    launch for the whole batch (outputs at padded query positions are zeros or unused values, as the loss and
    generation ignore them);
  * a packed batch (batch size 1, ``position_ids`` restarting at each document, no attention mask; or
    ``cu_seq_lens_q/k`` given) goes to ``flash_attn_varlen_func``: one ``flash_attention_varlen`` launch for all
    documents, each attending only to itself;
  * sliding-window layers (Mistral, Qwen 2, Gemma 2) get flash-attn's ``window_size`` exactly as transformers'
    own flash path derives it (``_process_flash_attention_kwargs``: ``(sliding_window - 1, sliding_window - 1)``
    once the keys outnumber the window; causal caps the right side at 0), which is ``eager``'s causal mask
    ``q - sliding_window < k <= q``.
Attention dropout runs in the kernels, except on packed batches: ``flash_attention_varlen`` has no dropout, and
a packed batch with dropout runs one ``flash_attention`` launch per document. Logit softcapping (Gemma 2's
``attn_logit_softcapping``) and attention sinks (``s_aux``) are not in the kernels and raise ValueError.

Two private transformers functions are involved, both checked by the tests:
  * ``_lazy_imports``, which loads a flash implementation and knows only the flash-attn packages and hub
    kernels: ``register`` wraps it so that the name "flashtrain" returns the functions below and every other
    name goes through unchanged;
  * ``_flash_attention_forward``, called by ``flashtrain_attention_forward`` below in place of transformers'
    generic wrapper, which would cast float32 inputs to half precision (flash-attn has no float32; flashtrain
    computes float32 and float64 as they are). It passes each keyword below only if the function's signature
    names it (``window_size``, ``softcap``, ``deterministic``, ``max_seqlen_q/k``), so the signatures matter.

The tests run Llama (GQA) and GPT-2 models, padded and not, against ``attn_implementation="eager"`` in float32
and ``"sdpa"`` in float64; a packed Llama batch against ``eager`` and its documents run one at a time; and
sliding-window Mistral, Qwen 2 and Gemma 2 models, padded and not, against ``eager``.
"""

from __future__ import annotations

import torch
import transformers.modeling_flash_attention_utils as fa_utils
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from flashtrain.ops.attention import flash_attention
from flashtrain.ops.varlen import flash_attention_varlen

NAME = "flashtrain"
Window = tuple[int, int]


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size: Window = (-1, -1), softcap: float | None = 0.0, deterministic: bool = False):
    """flash-attn's fixed-length API: q (B, L, H, D), k/v (B, S, H_kv, D) -> (B, L, H, D)."""
    _check_flash_kwargs(softcap, deterministic)
    out = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                          scale=softmax_scale, window_size=tuple(window_size), dropout_p=dropout_p)  # (B, H, L, D)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size: Window = (-1, -1), softcap: float | None = 0.0, deterministic: bool = False):
    """flash-attn's variable-length API: sequences concatenated along dim 0, q (total_q, H, D), k/v
    (total_k, H_kv, D), sequence i at rows cu_seqlens[i]:cu_seqlens[i + 1] (batch + 1,), any integer dtype.
    ``max_seqlen_q/k``: int, 0-d tensor or None (then read from the offsets). Returns (total_q, H, D).

    One ``flash_attention_varlen`` launch for all sequences; with ``dropout_p > 0`` one ``flash_attention``
    launch per sequence instead.
    """
    _check_flash_kwargs(softcap, deterministic)
    cu_q = _offsets(cu_seqlens_q, q.device)
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else _offsets(cu_seqlens_k, q.device)
    window = tuple(window_size)
    if dropout_p > 0:
        # the varlen kernels have no dropout: per-sequence launches keep packed batches of models trained with
        # attention dropout (GPT-2's attn_pdrop) exact, at a launch per sequence, rather than refusing them
        return _per_sequence(q, k, v, cu_q, cu_k, dropout_p, softmax_scale, causal, window)
    return flash_attention_varlen(q, k, v, cu_q, cu_k, _max_seqlen(max_seqlen_q, cu_q), _max_seqlen(max_seqlen_k, cu_k),
                                  causal=causal, scale=softmax_scale, window_size=window)


def _check_flash_kwargs(softcap: float | None, deterministic: bool | None) -> None:
    """ValueError for the flash-attn keywords the kernels cannot honour."""
    if softcap:  # None and 0.0 both mean no softcapping, as in flash-attn
        raise ValueError(f"attn_implementation={NAME!r}: softcap={softcap!r}; the kernels have no attention logit "
                         "softcapping, expected None or 0.0 (for Gemma 2: config.attn_logit_softcapping=None, or "
                         "attn_implementation='eager')")
    if deterministic and not torch.are_deterministic_algorithms_enabled():
        # the one backward with atomics (sm_90 Hopper dQ) is skipped only under torch's deterministic flag
        raise ValueError(f"attn_implementation={NAME!r}: deterministic={deterministic!r} (FLASH_ATTENTION_"
                         "DETERMINISTIC=1) without torch.use_deterministic_algorithms(True); expected "
                         "deterministic=False, or torch's flag set, which keeps every backward deterministic")


def _offsets(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Offsets as ``flash_attention_varlen`` takes them: int32 on q's device (no copy when already so)."""
    return cu_seqlens.to(device=device, dtype=torch.int32)


def _max_seqlen(value, cu_seqlens: torch.Tensor):
    """An int (or SymInt) from flash-attn's ``max_seqlen``: transformers' position_ids path gives a 0-d tensor
    (read back here, as flash-attn's C++ does), and None means the longest sequence in ``cu_seqlens``."""
    if isinstance(value, (int, torch.SymInt)):
        return value
    if value is None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return max(1, int(lengths.max())) if lengths.numel() else 1
    return int(value)


def _per_sequence(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, dropout_p: float, scale: float | None,
                  causal: bool, window: Window) -> torch.Tensor:
    """Packed sequences as one ``flash_attention`` launch each (a batch of one): q (total_q, H, D), k/v
    (total_k, H_kv, D) -> (total_q, H, D); rows past ``cu_q[-1]`` get zeros, as in the varlen kernels."""
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    out = q.new_zeros(q.shape)
    for i in range(len(starts_q) - 1):
        (a, b), (c, d) = starts_q[i:i + 2], starts_k[i:i + 2]
        if a == b or c == d:  # no query, or no key: zeros, as in the varlen kernels
            continue
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[a:b], k[c:d], v[c:d]))  # (1, heads, len_i, D)
        out[a:b] = flash_attention(qi, ki, vi, causal=causal, scale=scale, window_size=window,
                                   dropout_p=dropout_p)[0].transpose(0, 1)
    return out


def sliding_window_to_window_size(sliding_window: int | None, key_length: int) -> Window:
    """flash-attn's ``window_size`` for transformers' ``sliding_window``, as transformers' flash path derives it
    (``_process_flash_attention_kwargs``): a causal layer then sees the ``sliding_window`` keys ending at its own
    position, ``eager``'s ``q - sliding_window < k <= q``."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def flashtrain_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                 scaling: float | None = None, sliding_window: int | None = None,
                                 softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query (B, H, L, D), key/value (B, H_kv, S, D), a 2-D padding
    mask (B, S) or None; ``sliding_window``: the layer's window in keys, or None. Returns ((B, L, H, D), None)."""
    _check_flash_kwargs(softcap, False)
    if kwargs.get("s_aux") is not None:  # transformers would drop the sinks silently for a kernel without them
        raise ValueError(f"attn_implementation={NAME!r}: s_aux (attention sinks) of shape "
                         f"{tuple(kwargs['s_aux'].shape)}; the kernels have no sinks, expected None")
    kwargs.pop("output_attentions", None)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 2:
        # (B, S) with 1/True = token, 0/False = padding: straight to the kernels' key padding mask
        out = flash_attention(query, key, value, causal=is_causal, scale=scaling,
                              window_size=sliding_window_to_window_size(sliding_window, key.shape[2]),
                              key_padding_mask=~attention_mask.bool(), dropout_p=dropout)  # (B, H, L, D)
        return out.transpose(1, 2), None
    out = fa_utils._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
        query_length=query.shape[2], is_causal=is_causal, dropout=dropout, softmax_scale=scaling,
        sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False, target_dtype=None,
        attn_implementation=NAME, **kwargs)
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
