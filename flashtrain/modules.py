"""``FlashMultiheadAttention``, a drop-in ``nn.MultiheadAttention``, and ``swap_attention`` for existing models.

``FlashMultiheadAttention`` subclasses ``nn.MultiheadAttention`` and adds no state: parameters, state_dict
keys and the attributes PyTorch's transformer layers read are the parent's, so a state_dict loads both
ways and ``swap_attention`` can change a module's class in place (weights, device, dtype, requires_grad,
hooks and training mode untouched).

Forward runs the flash kernels for: no mask; a causal ``attn_mask`` passed with ``is_causal=True`` (query
and key lengths equal, as PyTorch's hint requires); a boolean ``key_padding_mask`` without a causal mask
(each batch element's unpadded keys are gathered and attended to in their own launch: exact, no (L, S)
tensor, one launch per element); ``add_bias_kv`` / ``add_zero_attn``; kdim/vdim; batched and unbatched
inputs. Everything else takes PyTorch's own exact implementation (``nn.MultiheadAttention.forward``):
``need_weights=True`` (the weights are the N x N matrix: pass ``need_weights=False`` to keep the memory
savings; a warning says so once), float or causal-combined key padding masks, a sequence whose keys are all
padded (PyTorch returns NaN there), arbitrary ``attn_mask``, attention dropout in training, and CPU tensors
without Triton's interpreter.
``FlashMultiheadAttention.flash_skip_reason(...)`` tells which path a call takes.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SUPPORTED_DTYPES, flash_attention
from .kernels import INTERPRET

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
        return self._flash_forward(query, key, value, causal=is_causal, key_padding_mask=key_padding_mask), None

    def flash_skip_reason(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                          is_causal=False) -> str | None:
        """None when this call runs the flash kernels, else why it takes PyTorch's implementation."""
        if need_weights:
            return "need_weights=True"
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                return "float key_padding_mask"
            if is_causal or attn_mask is not None:
                return "key_padding_mask with attn_mask"
            if self.bias_k is None and not self.add_zero_attn and bool(key_padding_mask.all(dim=-1).any()):
                return "a sequence whose keys are all padded"
        if self.training and self.dropout > 0:
            return "attention dropout in training"
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
        if query.device.type not in ("cpu", "cuda"):
            return f"device {query.device}"
        return None

    def _flash_forward(self, query, key, value, causal: bool, key_padding_mask=None):
        batched = query.dim() == 3
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        elif not self.batch_first:  # (L, B, E) -> (B, L, E) views
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, L, E = query.shape
        H = self.num_heads
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
        if self.bias_k is not None:  # one learned key/value appended to every sequence
            k = torch.cat([k, self.bias_k.expand(B, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, E)], dim=1)
        if self.add_zero_attn:  # then one all-zero key/value
            k = torch.cat([k, k.new_zeros(B, 1, E)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, E)], dim=1)
        q, k, v = (t.view(B, t.shape[1], H, E // H).transpose(1, 2) for t in (q, k, v))  # (B, H, *, hd)
        if key_padding_mask is None:
            out = flash_attention(q, k, v, causal=causal)  # (B, H, L, hd)
        else:
            out = self._attend_unpadded(q, k, v, key_padding_mask.view(B, -1))
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))
        if not batched:
            return out.squeeze(0)
        return out if self.batch_first else out.transpose(0, 1)


    def _attend_unpadded(self, q, k, v, key_padding_mask):
        """Attention of each batch element over its unpadded keys. key_padding_mask (B, S): True = padding;
        keys appended by add_bias_kv / add_zero_attn (past S) are never padding, as in PyTorch."""
        B, S = key_padding_mask.shape
        keep = torch.ones(B, k.shape[2], dtype=torch.bool, device=k.device)
        keep[:, :S] = ~key_padding_mask
        outs = []
        for b in range(B):
            idx = keep[b].nonzero().squeeze(1)
            outs.append(flash_attention(q[b:b + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx]))  # (1, H, L, hd)
        return torch.cat(outs, dim=0)


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
