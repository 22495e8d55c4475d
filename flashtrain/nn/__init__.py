"""Modules on top of the op: ``FlashMultiheadAttention`` (a drop-in ``nn.MultiheadAttention``) and
``swap_attention`` / ``unswap_attention``, which swap it in and out of a model in place."""

from .multihead import FlashMultiheadAttention, swap_attention, unswap_attention

__all__ = ["FlashMultiheadAttention", "swap_attention", "unswap_attention"]
