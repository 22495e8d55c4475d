"""flashtrain: Triton FlashAttention for long-context PyTorch training.

``flash_attention(q, k, v, *, causal=False, scale=None, return_lse=False)`` is the op; its kernels live
in ``flashtrain.kernels`` and its plain PyTorch reference in ``flashtrain.reference``.
``FlashMultiheadAttention`` is a drop-in ``nn.MultiheadAttention``; ``swap_attention(model)`` swaps it in.
"""

from .attention import flash_attention
from .modules import FlashMultiheadAttention, swap_attention, unswap_attention

__all__ = ["flash_attention", "FlashMultiheadAttention", "swap_attention", "unswap_attention"]
__version__ = "0.1.0"
