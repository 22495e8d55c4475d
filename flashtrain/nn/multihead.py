"""``FlashMultiheadAttention``, a drop-in ``nn.MultiheadAttention``, and ``swap_attention`` for existing models.

``FlashMultiheadAttention`` subclasses ``nn.MultiheadAttention`` and adds no state: parameters, state_dict
keys and the attributes PyTorch's transformer layers read are the parent's, so a state_dict loads both
ways and ``swap_attention`` can change a module's class in place (weights, device, dtype, requires_grad,
hooks and training mode untouched).

Forward runs the flash kernels for: no mask; a causal ``attn_mask`` passed with ``is_causal=True`` (query
and key lengths equal, as PyTorch's hint requires); a ``key_padding_mask``, bool or float (applied inside
the kernels as a per-key bias, alone or with the causal mask; no (L, S) tensor is built; PyTorch's
transformer layers pass it as float); attention dropout in training (Philox inside the kernels, seeded
from torch's generator, so ``torch.manual_seed`` reproduces it); ``add_bias_kv`` / ``add_zero_attn``;
kdim/vdim; batched and unbatched inputs. A query whose keys are all padded gets a zero attention output, as
in PyTorch's SDPA-based path (its inference fast path gives NaN).

Everything else takes PyTorch's own exact implementation (``nn.MultiheadAttention.forward``):
``need_weights=True`` (the weights are the N x N matrix: pass ``need_weights=False`` to keep the memory
savings; a warning says so once), a key padding mask that requires grad, arbitrary ``attn_mask`` (an
additive bias or a non-causal pattern), causal masks combined with ``add_bias_kv`` / ``add_zero_attn``,
``dropout=1.0``, and CPU tensors without Triton's interpreter (or in bfloat16, which it cannot compute).
``FlashMultiheadAttention.flash_skip_reason(...)`` tells which path a call takes.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.kernels.launch import INTERPRET
from flashtrain.ops.attention import flash_attention
from flashtrain.ops.checks import INTERPRETER_DTYPES, SUPPORTED_DTYPES

_warned_need_weights = False


class FlashMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with its attention computed by flashtrain's kernels where they apply.

    Same constructor, parameters, state_dict and forward as ``nn.MultiheadAttention``; see the module
    docstring for which calls run the kernels.
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        reason = self.flash_skip_reason(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        if reason is not None:
            if reason == "need_weights=True":
                _warn_need_weights()
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        dropout_p = self.dropout if self.training else 0.0
        return self._flash_forward(query, key, value, is_causal, key_padding_mask, dropout_p), None

    def flash_skip_reason(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                          is_causal=False) -> str | None:
        """None when this call runs the flash kernels, else why it takes PyTorch's implementation."""
        if need_weights:
            return "need_weights=True"
        if key_padding_mask is not None and key_padding_mask.requires_grad:
            return "key_padding_mask requires grad"
        if self.training and self.dropout >= 1.0:
            return "dropout=1.0"
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            return "input rank (PyTorch reports the error)"
        if attn_mask is not None and not is_causal:
            return "attn_mask without the is_causal hint"
        if is_causal:
            if attn_mask is None:
                return "is_causal without attn_mask (PyTorch reports the error)"
            seq_axis = 1 if self.batch_first and query.dim() == 3 else 0
            if query.shape[seq_axis] != key.shape[seq_axis]:
                return "causal with different query and key lengths"
            if self.bias_k is not None or self.add_zero_attn:
                return "causal with add_bias_kv / add_zero_attn"
        if query.dtype not in SUPPORTED_DTYPES:
            return f"dtype {query.dtype}"
        if query.device.type == "cpu" and not INTERPRET:
            return "CPU tensors without TRITON_INTERPRET=1"
        if query.device.type == "cpu" and query.dtype not in INTERPRETER_DTYPES:
            return f"dtype {query.dtype} on the CPU (Triton's interpreter has no bfloat16 arithmetic)"
        if query.device.type not in ("cpu", "cuda"):
            return f"device {query.device}"
        return None

    def _flash_forward(self, query, key, value, causal: bool, key_padding_mask, dropout_p: float):
        batched = query.dim() == 3
        self_attention = query is key and key is value and self._qkv_same_embed_dim
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        elif not self.batch_first:  # (L, B, E) -> (B, L, E) views
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, L, E = query.shape
        H = self.num_heads
        if self_attention:  # one (E -> 3E) projection, as PyTorch does; q, k, v are strided views of it
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)  # (B, L, E) each
        else:
            if self._qkv_same_embed_dim:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            else:
                w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
            b_q = b_k = b_v = None
            if self.in_proj_bias is not None:
                b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            q = F.linear(query, w_q, b_q)  # (B, L, E)
            k = F.linear(key, w_k, b_k)  # (B, S, E)
            v = F.linear(value, w_v, b_v)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.view(B, -1)  # (B, S); unbatched masks come as (S,)
        appended = 0
        if self.bias_k is not None:  # one learned key/value appended to every sequence
            k = torch.cat([k, self.bias_k.expand(B, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, E)], dim=1)
            appended += 1
        if self.add_zero_attn:  # then one all-zero key/value
            k = torch.cat([k, k.new_zeros(B, 1, E)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, E)], dim=1)
            appended += 1
        if key_padding_mask is not None and appended:  # appended keys are never padding, as in PyTorch
            key_padding_mask = F.pad(key_padding_mask, (0, appended), value=False)
        q, k, v = (t.view(B, t.shape[1], H, E // H).transpose(1, 2) for t in (q, k, v))  # (B, H, *, hd)
        out = flash_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                              dropout_p=dropout_p)  # (B, H, L, hd)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))
        if not batched:
            return out.squeeze(0)
        return out if self.batch_first else out.transpose(0, 1)


def _warn_need_weights():
    global _warned_need_weights
    if not _warned_need_weights:
        _warned_need_weights = True
        warnings.warn("FlashMultiheadAttention: need_weights=True (PyTorch's default) returns the attention "
                      "weights, which needs the full (L, S) matrix, so it runs PyTorch's implementation and "
                      "forfeits the memory savings. Pass need_weights=False.", stacklevel=3)


def swap_attention(model: nn.Module) -> nn.Module:
    """Make every ``nn.MultiheadAttention`` in ``model`` a ``FlashMultiheadAttention``, in place; return model.

    The class is changed on the existing modules, so weights, device, dtype, requires_grad, hooks and training
    mode stay as they are. ``unswap_attention`` undoes it. Warns when there was nothing to swap.
    """
    swapped = 0
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = FlashMultiheadAttention
            swapped += 1
    if swapped == 0:
        warnings.warn(f"swap_attention: {type(model).__name__} holds no torch.nn.MultiheadAttention; "
                      "nothing was swapped", stacklevel=2)
    return model


def unswap_attention(model: nn.Module) -> nn.Module:
    """Turn every ``FlashMultiheadAttention`` in ``model`` back into ``nn.MultiheadAttention``; return model."""
    for module in model.modules():
        if type(module) is FlashMultiheadAttention:
            module.__class__ = nn.MultiheadAttention
    return model
