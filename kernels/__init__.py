"""Triton kernels of flashtrain, installed as ``flashtrain.kernels``.

Shared pieces at the top, one folder per kernel family:

* ``common``: host integer math, the ``@triton.jit`` helpers every kernel loads rows and scales scores with.
* ``masking``: which key blocks a query block visits (causal ranges, tile masks) and the causal launch order.
* ``tuning``: the autotuner's key, timing and picks; forced configs (tests).
* ``launch``: launches without Triton's per-call binding; device helpers.
* ``attention/``: the 16-bit Triton forward (``fwd``) and backward (``bwd``), their tiles, the dropout mask.
* ``hopper/``: the sm_90 Gluon kernels (16-bit forward, backward at head_dim 64, FP8 forward) and their tiles.
* ``fp8/``: per-tile e4m3 quantisation, the Hadamard rotation, centring, the FP8 forward and backward, their tiles.

Each ``*_kernel`` is a jitted kernel; the function beside it that takes torch tensors is its launcher. Launchers run
the kernel they are; which launcher runs for a call is decided in ``flashtrain.ops.dispatch``. The plain PyTorch
references live in ``flashtrain.ops.reference`` and import nothing from here.
"""

from .attention.dropout_mask import dropout_keep_mask
from .launch import INTERPRET

__all__ = ["dropout_keep_mask", "INTERPRET"]
