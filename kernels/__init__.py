"""Triton kernels of flashtrain, installed as ``flashtrain.kernels``.

One file per operator: ``attention_fwd`` (forward; ``attention_fwd_hopper`` holds its warp-specialised
sm_90 variant in Triton's Gluon dialect), ``attention_bwd`` (backward; ``attention_bwd_hopper`` holds its
five-matmul sm_90 variant, also Gluon), ``attention_fp8_fwd`` and ``attention_fp8_bwd`` (the FP8 path;
``attention_fp8_fwd_hopper`` holds the FP8 forward's sm_90 Gluon variant), ``fp8_quant`` (per-tile e4m3
quantisation), ``hadamard`` (the rotation for incoherent processing), ``centring`` (a mean subtracted per
(batch, head): dK in the FP8 backwards), ``dropout_mask`` (the dropout mask
materialised, for tests) and ``configs`` (launch configurations). Each ``<op>_kernel`` is a ``triton.jit``
kernel; each ``<op>`` function next to it is the launcher that takes torch tensors. The plain PyTorch
references live in ``flashtrain.reference``.
"""

from .attention_bwd import attention_bwd
from .attention_fwd import attention_fwd, lse_dtype
from .configs import INTERPRET
from .dropout_mask import dropout_keep_mask

__all__ = ["attention_fwd", "attention_bwd", "lse_dtype", "dropout_keep_mask", "INTERPRET"]
