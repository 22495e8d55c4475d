"""Which kernel runs for a call, and why: the one place that decides.

Three decisions, each returning a ``Choice(kernel, reason)`` with kernel ``"triton"`` or ``"hopper"``:

* ``forward``: the 16-bit forward: ``kernels/attention/fwd.py`` or the warp-specialised ``kernels/hopper/fwd.py``;
* ``backward``: the 16-bit backward: ``kernels/attention/bwd.py`` (two kernels, deterministic; ``"triton_split"``:
  with dK and dV in two launches of its dK/dV kernel) or the five-matmul ``kernels/hopper/bwd.py`` (head_dim 64; dQ
  summed with fp32 atomics, so not bitwise reproducible);
* ``fp8_forward``: the FP8 forward: ``kernels/fp8/fwd.py`` or ``kernels/hopper/fp8_fwd.py``.

A Hopper kernel runs where it can (an sm_90 GPU, a Triton with Gluon, inputs it handles, tensors TMA can address)
and, in the default "auto" mode, where it was measured faster: from the sequence lengths in the ``*_MIN_SEQ``
tables, kept per GPU architecture (compute capability). ``hopper_forward(mode)`` and ``hopper_backward(mode)``
switch the mode within a block: "always" (wherever it can; tests), "never" (the Triton kernels; benchmarks);
``split_dkdv(mode)`` does the same for the split dK/dV launches (``SPLIT_DKDV_MIN_HEAD_DIM``).

The reasons are fixed strings (no formatting on the hot path); ``explain`` formats one for people.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from flashtrain.kernels import hopper as hopper_kernels
from flashtrain.kernels.common import LOG2E
from flashtrain.kernels.hopper.tiles import (FP8_HOPPER_FWD_CONFIGS, HOPPER_BWD_CONFIGS, HOPPER_FWD_CONFIGS,
                                             fp8_scores_in_f16)
from flashtrain.kernels.launch import INTERPRET, device_capability
from flashtrain.kernels.tuning import is_forced

TRITON, TRITON_SPLIT, HOPPER = "triton", "triton_split", "hopper"
SM90 = (9, 0)

# Shortest sequence (the longer of seq_q, seq_k) at which each Hopper kernel is the faster one, per compute
# capability: measured on an H200 (bf16; docs/tuning.md has the sweeps). The H100 is the same sm_90 chip with slower
# memory; it takes the H200's figures.
HOPPER_FWD_MIN_SEQ = {SM90: {(64, False): 2048, (64, True): 8192, (128, False): 1024, (128, True): 2048}}
HOPPER_BWD_MIN_SEQ = {SM90: {False: 4096, True: 8192}}
# (head_dim, causal) -> shortest sequence for the FP8 Hopper forward
FP8_HOPPER_FWD_MIN_SEQ = {SM90: {(128, False): 1024, (128, True): 2048, (256, False): 512, (256, True): 512}}

# Narrowest head_dim from which the Triton backward writes dK and dV in two launches (one fp32 accumulator each,
# so key tiles of a whole wgmma height fit), per compute capability (docs/performance-notes.md, 16-bit backward).
SPLIT_DKDV_MIN_HEAD_DIM: dict = {SM90: 256}

F16_NORMAL_MIN, F16_MAX = 2.0 ** -14, 65504.0  # float16's smallest normal and largest finite values


class Choice(NamedTuple):
    """The kernel family that runs (``TRITON`` or ``HOPPER``) and why."""
    kernel: str
    reason: str


_modes = {"forward": "auto", "backward": "auto", "split_dkdv": "auto"}


@contextlib.contextmanager
def _mode(direction: str, mode: str, switch: str):
    """Set ``_modes[direction]`` within the block; ``switch``: the public function's name, for the error."""
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"{switch}: mode={mode!r}; expected 'auto', 'always' or 'never'")
    saved = _modes[direction]
    _modes[direction] = mode
    try:
        yield
    finally:
        _modes[direction] = saved


def hopper_forward(mode: str):
    """Within the block, run the Hopper forwards (16-bit and FP8) per ``mode``: "auto" (the default), "always"
    or "never"."""
    return _mode("forward", mode, "hopper_forward")


def hopper_backward(mode: str):
    """Within the block, run the Hopper backward per ``mode``: "auto" (the default), "always" or "never"."""
    return _mode("backward", mode, "hopper_backward")


def split_dkdv(mode: str):
    """Within the block, the Triton backward writes dK and dV in two launches per ``mode``: "auto" (the default:
    from ``SPLIT_DKDV_MIN_HEAD_DIM``), "always" or "never"."""
    return _mode("split_dkdv", mode, "split_dkdv")


def hopper_forward_mode() -> str:
    return _modes["forward"]


def hopper_backward_mode() -> str:
    return _modes["backward"]


def _not_on_hopper(mode: str, q: torch.Tensor) -> str | None:
    """Why no Hopper kernel can run (mode "never", not a CUDA tensor, the interpreter), or None."""
    if mode == "never":
        return "Hopper kernels switched off (mode 'never')"
    if INTERPRET or not q.is_cuda:
        return "not on a CUDA GPU"
    return None


def _not_16bit_hopper(mode: str, q: torch.Tensor, key_padding_mask, dropout_p: float,
                      triton_kernels: tuple[str, ...], window_size: tuple[int, int], varlen: bool) -> str | None:
    """The cheap rules both 16-bit Hopper kernels share, or None when they pass."""
    reason = _not_on_hopper(mode, q)
    if reason is not None:
        return reason
    if any(is_forced(n) for n in triton_kernels):
        return "a Triton config is forced"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "the Hopper kernels take float16 or bfloat16"
    if key_padding_mask is not None or dropout_p > 0:
        return "the Hopper kernels take no key padding mask or dropout"
    if window_size != (-1, -1) or varlen:
        return "the Hopper kernels take no sliding window or packed sequences"
    return None


def _not_ready(tensors: tuple[torch.Tensor, ...], module: str, device: torch.device) -> str | None:
    """The device-side rules: tensors TMA can address, an sm_90 GPU, a Triton with Gluon's Hopper API."""
    if not all(hopper_kernels.tma_addressable(t) for t in tensors):
        return "a tensor TMA cannot address (unit stride on head_dim, 16-byte aligned rows)"
    if device_capability(device) != SM90:
        return "not an sm_90 GPU"
    if hopper_kernels.kernel_module(module) is None:
        return "this Triton has no Gluon Hopper API"
    return None


def _not_forward_shape(causal: bool, seq_q: int, seq_k: int, scale: float) -> str | None:
    """The rules both Hopper forwards (16-bit and FP8) share: every row sees a key, and a scale > 0."""
    if causal and seq_q > seq_k:
        return "causal with seq_q > seq_k: rows that see no key"
    if not scale > 0:
        return "scale <= 0 (the Hopper kernel takes the row max before scaling)"
    return None


def _hopper(mode: str, auto_reason: str) -> Choice:
    """The Choice of a Hopper kernel that passed every rule: ``auto_reason`` in "auto" mode."""
    return Choice(HOPPER, auto_reason if mode == "auto" else "Hopper forced (mode 'always')")


def _too_short(table: dict, device: torch.device, key, seq: int) -> bool:
    """Whether ``seq`` is below the table's threshold for this GPU (a key without one: never faster). A GPU without
    a table is left to ``_not_ready``, which turns away everything but sm_90."""
    thresholds = table.get(device_capability(device))
    if thresholds is None:
        return False
    min_seq = thresholds.get(key)
    return min_seq is None or seq < min_seq


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            key_padding_mask: torch.Tensor | None, dropout_p: float, window_size: tuple[int, int] = (-1, -1),
            varlen: bool = False) -> Choice:
    """The 16-bit forward's kernel for these (validated) inputs; ``varlen``: packed sequences."""
    mode = _modes["forward"]
    reason = _not_16bit_hopper(mode, q, key_padding_mask, dropout_p, ("fwd",), window_size, varlen)
    if reason is not None:
        return Choice(TRITON, reason)
    head_dim, seq_q, seq_k = q.shape[3], q.shape[2], k.shape[2]
    if head_dim not in HOPPER_FWD_CONFIGS:
        return Choice(TRITON, "no Hopper forward for this head_dim")
    reason = _not_forward_shape(causal, seq_q, seq_k, scale)
    if reason is not None:
        return Choice(TRITON, reason)
    if mode == "auto" and _too_short(HOPPER_FWD_MIN_SEQ, q.device, (head_dim, causal), max(seq_q, seq_k)):
        return Choice(TRITON, "shorter than where the Hopper forward is faster")
    reason = _not_ready((q, k, v), "fwd", q.device)
    if reason is not None:
        return Choice(TRITON, reason)
    return _hopper(mode, "sm_90 and a shape where the Hopper forward is faster")


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
             key_padding_mask: torch.Tensor | None, dropout_p: float, window_size: tuple[int, int] = (-1, -1),
             varlen: bool = False) -> Choice:
    """The 16-bit backward's kernel for these inputs (``do``: the output's gradient, whose layout TMA reads too)."""
    choice = _backward_family(q, k, v, do, causal, key_padding_mask, dropout_p, window_size, varlen)
    if choice.kernel != TRITON:
        return choice
    mode = _modes["split_dkdv"]
    if mode == "always":
        return Choice(TRITON_SPLIT, "dK and dV in two launches forced (split_dkdv mode 'always')")
    if mode == "auto" and SPLIT_DKDV_MIN_HEAD_DIM and q.is_cuda and not INTERPRET:  # empty table: no device query
        min_head_dim = SPLIT_DKDV_MIN_HEAD_DIM.get(device_capability(q.device))
        if min_head_dim is not None and q.shape[3] >= min_head_dim:
            return Choice(TRITON_SPLIT, "a head_dim where dK and dV in two launches are faster")
    return choice


def _backward_family(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
                     key_padding_mask: torch.Tensor | None, dropout_p: float, window_size: tuple[int, int],
                     varlen: bool) -> Choice:
    """``backward``'s choice between the Triton and the Hopper kernels."""
    mode = _modes["backward"]
    if torch.are_deterministic_algorithms_enabled():
        return Choice(TRITON, "deterministic algorithms requested (the Hopper backward's dQ uses atomics)")
    reason = _not_16bit_hopper(mode, q, key_padding_mask, dropout_p, ("dkdv", "dq"), window_size, varlen)
    if reason is not None:
        return Choice(TRITON, reason)
    head_dim, seq_q, seq_k = q.shape[3], q.shape[2], k.shape[2]
    if head_dim not in HOPPER_BWD_CONFIGS:
        return Choice(TRITON, "no Hopper backward for this head_dim")
    if q.shape[1] != k.shape[1]:
        return Choice(TRITON, "GQA (the Hopper backward takes one query head per KV head)")
    if causal and seq_q != seq_k:
        return Choice(TRITON, "causal with seq_q != seq_k")
    if mode == "auto" and _too_short(HOPPER_BWD_MIN_SEQ, q.device, causal, max(seq_q, seq_k)):
        return Choice(TRITON, "shorter than where the Hopper backward is faster")
    reason = _not_ready((q, k, v, do), "bwd", q.device)
    if reason is not None:
        return Choice(TRITON, reason)
    return _hopper(mode, "sm_90 and a shape where the Hopper backward is faster")


def fp8_forward(q: torch.Tensor, k: torch.Tensor, qk_dim: int, causal: bool, scale: float) -> Choice:
    """The FP8 forward's kernel for these inputs, whose Q and K rows are ``qk_dim`` wide once rotated. Decided
    before the quantisation, which depends on it (the float16 scores' bound); follows ``hopper_forward``'s mode."""
    mode = _modes["forward"]
    reason = _not_on_hopper(mode, q)
    if reason is not None:
        return Choice(TRITON, reason)
    head_dim, seq_q, seq_k = q.shape[3], q.shape[2], k.shape[2]
    if qk_dim != head_dim or head_dim not in FP8_HOPPER_FWD_CONFIGS:
        return Choice(TRITON, "no FP8 Hopper forward for this head_dim (or a rotation that pads it)")
    reason = _not_forward_shape(causal, seq_q, seq_k, scale)
    if reason is not None:
        return Choice(TRITON, reason)
    if mode == "auto" and _too_short(FP8_HOPPER_FWD_MIN_SEQ, q.device, (head_dim, causal), max(seq_q, seq_k)):
        return Choice(TRITON, "shorter than where the FP8 Hopper forward is faster")
    if fp8_scores_in_f16(head_dim) and not F16_NORMAL_MIN <= scale * LOG2E <= F16_MAX:
        return Choice(TRITON, "a scale outside float16's normal range (the kernel applies it in float16)")
    reason = _not_ready((), "fp8_fwd", q.device)  # its quantised operands are allocated TMA-aligned
    if reason is not None:
        return Choice(TRITON, reason)
    return _hopper(mode, "sm_90 and a shape where the FP8 Hopper forward is faster")


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
            key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
            window_size: tuple[int, int] = (-1, -1), varlen: bool = False) -> str:
    """One line per direction saying which 16-bit kernel ``flash_attention`` runs for these inputs, and why."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fwd = forward(q, k, v, causal, scale, key_padding_mask, dropout_p, tuple(window_size), varlen)
    bwd = backward(q, k, v, q, causal, key_padding_mask, dropout_p, tuple(window_size), varlen)
    return f"forward: {fwd.kernel} ({fwd.reason})\nbackward: {bwd.kernel} ({bwd.reason})"
