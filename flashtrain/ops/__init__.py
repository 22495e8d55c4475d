"""The public op and everything between it and the kernels.

* ``attention``: ``flash_attention``, its ``torch.library`` custom ops and autograd;
* ``varlen``: ``flash_attention_varlen``, packed sequences on the same ops;
* ``fp8``: the FP8 path (``fp8="forward" | "full"``) and its building blocks;
* ``checks``: input validation; ``lse``: the LSE's log2 / natural-log conversions;
* ``dispatch``: which kernel runs for a call, and why (the one place that decides);
* ``reference``: plain PyTorch references, which import no kernel code.
"""

from .attention import flash_attention
from .varlen import flash_attention_varlen

__all__ = ["flash_attention", "flash_attention_varlen"]
