"""Input validation of ``flash_attention``: every argument is checked before any kernel launches, and a bad one
raises a ``TypeError``/``ValueError`` (``RuntimeError`` for an environment that cannot run it) naming the argument,
its value and what was expected."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from flashtrain.kernels.launch import INTERPRET, device_capability

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Triton's interpreter multiplies bfloat16's raw bit patterns (upstream triton issue 11584): CPU tensors refuse it
INTERPRETER_DTYPES = (torch.float16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535  # CUDA's limit on grid dims y and z, where heads and batch go
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper
FP8_MODES = (None, "forward", "full")


def check_window(window_size, fn: str = "flash_attention") -> tuple[int, int]:
    """flash-attn's ``window_size`` as a pair of ints, each -1 (unbounded) or >= 0."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"{fn}: window_size={window_size!r}; each side must be -1 (unbounded) or >= 0")
    return left, right


def check_fp8(q, key_padding_mask, dropout_p, fp8, hadamard, smooth_k) -> None:
    if fp8 not in FP8_MODES:
        raise ValueError(f"flash_attention: fp8={fp8!r}; expected None, 'forward' or 'full'")
    for name, flag in (("hadamard", hadamard), ("smooth_k", smooth_k)):
        if not isinstance(flag, bool):
            raise TypeError(f"flash_attention: {name} must be a bool, got {flag!r}")
    if fp8 is None:
        return
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_attention: fp8={fp8!r} takes float16, bfloat16 or float32 inputs; got {q.dtype}")
    if key_padding_mask is not None or dropout_p:
        raise ValueError(f"flash_attention: fp8={fp8!r} does not support key_padding_mask or dropout_p yet; "
                         "use fp8=None for them")
    if q.device.type == "cuda" and device_capability(q.device) < FP8_MIN_CAPABILITY:
        raise ValueError(f"flash_attention: fp8={fp8!r} needs FP8 tensor cores (compute capability 8.9+); "
                         f"{torch.cuda.get_device_name(q.device)} has "
                         f"{'.'.join(map(str, device_capability(q.device)))}")


def _check_padding_and_dropout(q, k, key_padding_mask, dropout_p) -> None:
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or not (key_padding_mask.dtype == torch.bool
                                                             or key_padding_mask.is_floating_point()):
            what = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError("flash_attention: key_padding_mask must be a bool tensor (True = padding) or a float "
                            f"tensor (added to the scores), got {what}")
        if key_padding_mask.requires_grad:
            raise ValueError("flash_attention: key_padding_mask requires grad, but no gradient flows to it; "
                             "pass key_padding_mask.detach()")
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(f"flash_attention: key_padding_mask has shape {tuple(key_padding_mask.shape)}; "
                             f"expected (batch, seq_k) = {expected}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"flash_attention: key_padding_mask is on {key_padding_mask.device}, q on {q.device}; "
                             "expected one device")
    if (not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool)
            or not 0.0 <= dropout_p < 1.0):
        raise ValueError(f"flash_attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")


def check_inputs(q, k, v, causal, scale, return_lse, key_padding_mask, dropout_p) -> float:
    """Validate the arguments of ``flash_attention`` before any kernel runs; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"flash_attention: {name} has dtype {t.dtype}; expected one of "
                            "torch.float16, torch.bfloat16, torch.float32, torch.float64")
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (batch, heads, seq, head_dim); "
                             f"got {t.dim()}-D with shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k and v must be on one device; got q on {q.device}, "
                         f"k on {k.device}, v on {v.device}")
    batch, heads_q, _, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"flash_attention: batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected the same dim 0")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"flash_attention: head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected the same last dim")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same "
                         "(heads_kv, seq_k)")
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"flash_attention: heads_q={heads_q} (q.shape[1]) must be a multiple of "
                         f"heads_kv={heads_kv} (k.shape[1])")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim={head_dim} (q.shape[3]); expected 1..{MAX_HEAD_DIM}")
    if batch > MAX_GRID_DIM or heads_q > MAX_GRID_DIM:
        raise ValueError(f"flash_attention: batch={batch} and heads_q={heads_q} must each be at most "
                         f"{MAX_GRID_DIM}")
    if not isinstance(causal, bool):
        raise TypeError(f"flash_attention: causal must be a bool, got {causal!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"flash_attention: return_lse must be a bool, got {return_lse!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"flash_attention: scale must be a finite real number or None, got {scale!r}")
    _check_padding_and_dropout(q, k, key_padding_mask, dropout_p)
    _check_device(q)
    return float(scale)


def _check_device(q: Tensor) -> None:
    """CUDA runs every supported dtype; the CPU only what Triton's interpreter can compute."""
    if q.device.type == "cuda":
        return
    if q.device.type != "cpu":
        raise ValueError(f"flash_attention: tensors on {q.device} are not supported; expected cuda "
                         "(or cpu through Triton's interpreter)")
    if not INTERPRET:
        raise RuntimeError("flash_attention: q, k, v are CPU tensors, which run only through Triton's "
                           "interpreter; set TRITON_INTERPRET=1 in the environment before triton is "
                           "imported (before importing flashtrain), or move the tensors to a CUDA device")
    if q.dtype not in INTERPRETER_DTYPES:
        raise TypeError(f"flash_attention: q, k, v have dtype {q.dtype} on device {q.device}; Triton's interpreter "
                        "has no bfloat16 arithmetic (it would return wrong numbers), so CPU tensors must be "
                        "float16, float32 or float64: convert them (e.g. q.float()) or move them to a CUDA device")
