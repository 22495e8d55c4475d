"""``flash_attention_varlen``: attention over packed sequences (flash-attn's varlen API).

Many sequences of different lengths are concatenated along one token axis, with ``cu_seqlens`` marking where each
starts. The kernels run the packed rows as a batch of one in which each program looks its sequence up in the
offsets (``kernels/masking._sequence``), so the work follows the sequences' own lengths: documents of 2k packed
into 16k cost eight 2k attentions, not one 16k one, and no key block of another document is ever loaded.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .attention import attend
from .checks import check_inputs, check_window
from .lse import natural_lse

FN = "flash_attention_varlen"


def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           return_lse: bool = False):
    """Exact attention over packed sequences: sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q
    attending to rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v, and never to another sequence.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), heads_q a multiple of heads_kv
            (GQA). Any strides (a slice of a fused QKV projection works without a copy).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: cumulative offsets starting at 0,
            non-decreasing (empty sequences are allowed). Rows of q past ``cu_seqlens_q[-1]`` belong to no
            sequence: their output is zero and they get no gradient; so do keys past ``cu_seqlens_k[-1]``.
        max_seqlen_q, max_seqlen_k: the longest sequence in each (sizes the launch grid).
        causal, scale, window_size: as in ``flash_attention``, applied per sequence (bottom-right aligned within
            each pair of sequences).
        return_lse: also return the natural-log LSE, float32 (heads_q, total_q); -inf on rows that see no key.

    The offsets are checked (int32, 1-D, equal lengths, starting at 0, non-decreasing, the last within the rows,
    every sequence within ``max_seqlen``). On a GPU that reads them back, one device sync, done once per offsets
    tensor: the same tensor passed again, as every layer of a model does, is not read again unless torch wrote to it
    since (its version counter; a write through ``.data``, numpy or DLPack is not seen). Inside
    ``torch.compile`` nothing is read back (a sync would break the graph), as in flash-attn: a sequence longer
    than ``max_seqlen`` then leaves its rows past ``max_seqlen`` unwritten, and offsets that decrease or pass the
    last row read and write out of bounds.

    Returns:
        out (total_q, heads_q, head_dim) (contiguous when q is), or (out, lse).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{FN}: {name} must be 3-D (total_tokens, heads, head_dim); got {t.dim()}-D with "
                             f"shape {tuple(t.shape)}")
    # (1, heads, total, head_dim) views: the dense checks and kernels take them as a batch of one
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    scale = check_inputs(q4, k4, v4, causal, scale, return_lse, None, 0.0)
    window = (-1, -1) if window_size == (-1, -1) else check_window(window_size, FN)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_offsets(cu_seqlens_q, cu_seqlens_k, q, k, max_q, max_k)
    out, lse2 = attend(q4, k4, v4, causal, scale, None, 0.0, None, *window, cu_seqlens_q, cu_seqlens_k, max_q, max_k)
    out = out[0].transpose(0, 1)  # empty_like(q4) kept q's token-major layout
    if return_lse:
        return out, natural_lse(lse2)[0]
    return out


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 1:
        raise ValueError(f"{FN}: {name}={value!r}; expected an int >= 1 (the longest sequence's length)")
    return value


# Offsets tensors already read back, by id: (a weak reference, what was checked). Each is checked once, not once
# per layer; its version counter changes when it is written to, and a new tensor at a reused id has a dead reference.
_checked: dict[int, tuple] = {}


def _check_offsets(cu_q, cu_k, q: Tensor, k: Tensor, max_q: int, max_k: int) -> None:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor):
            raise TypeError(f"{FN}: {name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{FN}: {name} has dtype {cu.dtype} and shape {tuple(cu.shape)}; expected int32 "
                             "(batch + 1,)")
        if cu.device != q.device:
            raise ValueError(f"{FN}: {name} is on {cu.device}, q on {q.device}; expected one device")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{FN}: cu_seqlens_q has shape {tuple(cu_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_k.shape)}; expected one offset per sequence boundary in each")
    if torch.compiler.is_compiling():
        return
    for name, cu, rows, longest in (("cu_seqlens_q", cu_q, q.shape[0], max_q), ("cu_seqlens_k", cu_k, k.shape[0],
                                                                                 max_k)):
        seen = _checked.get(id(cu))
        # CPU offsets are read every call (no sync to save, and writes through aliases keep _version)
        if cu.is_cuda and seen is not None and seen[0]() is cu and seen[1] == (cu._version, rows, longest):
            continue
        offsets = cu.tolist()  # one device sync for a CUDA tensor
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or any(n < 0 for n in lengths):
            raise ValueError(f"{FN}: {name}={_short(offsets)}; expected non-decreasing offsets starting at 0")
        if offsets[-1] > rows:
            raise ValueError(f"{FN}: {name}[-1]={offsets[-1]} is past the {rows} packed rows; expected at most "
                             f"{rows}")
        if lengths and max(lengths) > longest:
            raise ValueError(f"{FN}: a sequence of {max(lengths)} rows in {name}, longer than max_seqlen="
                             f"{longest}; expected max_seqlen >= the longest sequence")
        if len(_checked) > 64:
            _checked.clear()
        _checked[id(cu)] = (weakref.ref(cu), (cu._version, rows, longest))


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
