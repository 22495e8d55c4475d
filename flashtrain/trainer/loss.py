"""Memory-bounded fused LM head + cross-entropy: ``chunked_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy((hidden @ weight.T).float(), targets)`` without ever holding the (tokens, vocab) logits.

At 1M tokens and a 32k vocabulary the bf16 logits alone are 64 GiB (128 GiB upcast to fp32); here ``chunk_tokens``
rows of logits exist at a time, and the gradients of hidden and weight are computed chunk by chunk in the forward
pass (the Liger-Kernel "fused linear cross entropy" scheme), so backward only scales them by grad_output.

Why not a library (fp32 forward + backward, N=2048 tokens, V=4096, C=64, on a 2-core CPU with torch 2.13):
- Liger-Kernel 0.8.5 ``liger_fused_linear_cross_entropy`` is Triton only; on CPU it runs through Triton's interpreter,
  where it matched F.cross_entropy but took 10.4 s against 0.07 s here (plain F.cross_entropy 0.09 s): too slow for
  the CPU tests and configs, and a dependency for what chunked torch matmuls already do.
- ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(batch_chunk_size=...))`` chunks the same way in
  torch 2.13 (0.03 s; peak RSS 398 MiB against 396 MiB here for N=8192, V=32768, C=768, chunks of 1024, where plain
  F.cross_entropy peaks at 3082 MiB), but pyproject allows torch>=2.6, which lacks it. tests/trainer/test_loss.py
  checks this function against it where it exists.
- torchtune's ``CEWithChunkedOutputLoss`` takes logits already computed (it chunks only the fp32 upcast): the 16-bit
  logits are still N x V.
"""

from __future__ import annotations

import functools

import torch

_REDUCTIONS = ("mean", "sum")


@functools.cache
def _function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function for one device type: ``torch.amp.custom_fwd``/``custom_bwd`` take the device type at
    decoration time, and the same loss runs on cpu and cuda tensors."""

    class _ChunkedLinearCrossEntropy(torch.autograd.Function):
        # Gradients are computed in forward and stored (N*C + V*C extra memory) rather than recomputed in backward:
        # one pass of the three matmuls per chunk instead of a second logits matmul in backward.

        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index, reduction, need_hidden, need_weight):
            return _forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index, reduction, need_hidden,
                            need_weight, device_type)

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_output):
            grad_hidden, grad_weight = ctx.saved_tensors
            # scaled copies, not in place: retain_graph (and gradcheck's re-entrance check) run backward twice;
            # the cost is one more (N, C) and (V, C) until the saved ones are freed after this node
            return (grad_hidden * grad_output if ctx.need_hidden else None,
                    grad_weight * grad_output if ctx.need_weight else None,
                    None, None, None, None, None, None)

    return _ChunkedLinearCrossEntropy


def _forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index, reduction, need_hidden, need_weight,
             device_type):
    """Loss (0-dim) and, when asked, grad_hidden (N, C) in hidden.dtype and grad_weight (V, C) in weight.dtype for a
    grad_output of 1, saved on ctx. hidden (N, C), weight (V, C), targets (N,) int64."""
    # the matmul follows autocast as nn.Linear would; everything after it is cast explicitly
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = hidden.dtype
    # the log-sum-exp and gradients run in fp32 for 16-bit matmuls (F.cross_entropy(logits.float())), fp64 for fp64
    acc = torch.promote_types(dtype, torch.float32)
    device = hidden.device
    n = hidden.shape[0]
    need_grad = need_hidden or need_weight

    with torch.autocast(device_type, enabled=False):
        w = weight.to(dtype)  # (V, C); no copy when already in dtype
        valid_all = targets != ignore_index  # (N,)
        count = valid_all.sum()
        total = torch.zeros((), dtype=acc, device=device)
        if reduction == "mean":
            # no targets: the loss is 0/0 = NaN and the gradients zero, as F.cross_entropy gives
            scale = 1.0 / count.clamp(min=1).to(acc)
        else:
            scale = torch.ones((), dtype=acc, device=device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # accumulated over chunks in fp32 (fp64 for fp64): a 16-bit sum over N / chunk_tokens chunks would round
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=device) if need_weight else None

        for start in range(0, n, chunk_tokens):
            stop = min(start + chunk_tokens, n)
            h = hidden[start:stop].to(dtype)  # (rows, C)
            t = targets[start:stop]
            valid = valid_all[start:stop]
            logits = (h @ w.T).to(acc)  # (rows, V): vocab-sized buffers exist for one chunk only
            safe = t.masked_fill(~valid, 0)  # ignored rows gather class 0, then are masked out
            # log_softmax and softmax rather than logsumexp and exp_: the same two (rows, V) buffers at the peak, and
            # on CPU exp of logits far below the row max (subnormal results) measured 4x slower than softmax
            picked = torch.log_softmax(logits, dim=-1).gather(1, safe[:, None]).squeeze(1)
            total -= torch.where(valid, picked, 0).sum()
            if not need_grad:
                del logits
                continue
            # d loss / d logits = (softmax - one_hot(target)) * scale, ignored rows zero
            grad_logits = torch.softmax(logits, dim=-1)
            del logits
            grad_logits[torch.arange(stop - start, device=device), safe] -= 1.0
            row_scale = (valid.to(acc) * scale)[:, None]
            if dtype == acc:
                grad_logits.mul_(row_scale)
            else:  # scaled and cast to the matmul dtype in one pass over the chunk
                grad_logits = torch.mul(grad_logits, row_scale, out=torch.empty_like(grad_logits, dtype=dtype))
            if need_hidden:
                grad_hidden[start:stop] = grad_logits @ w
            if need_weight and dtype == acc:
                grad_weight.addmm_(grad_logits.T, h)  # in place: no (V, C) temporary per chunk
            elif need_weight:
                grad_weight += grad_logits.T @ h  # a 16-bit matmul, summed into the fp32 accumulator
            del grad_logits

        loss = total / count if reduction == "mean" else total

    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    ctx.need_hidden, ctx.need_weight = need_hidden, need_weight
    ctx.save_for_backward(grad_hidden, grad_weight)
    return loss


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_tokens: int = 8192, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, ``chunk_tokens`` rows at a time.

    Equals ``F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index, reduction=reduction)``
    ("mean" over the non-ignored targets, or "sum"), fp64 staying fp64. Under ``torch.autocast`` the matmul runs in
    the autocast dtype, as ``nn.Linear`` would. Memory: at most two fp32 (chunk_tokens, V) buffers (and one 16-bit for
    16-bit matmuls) at a time, and the gradients (N, C) and (V, C) computed in forward and kept for backward.
    Higher-order gradients are not supported (the stored gradients are constants to autograd).

    Args:
        hidden: (..., C) float, the final normed hidden states.
        weight: (V, C) float, the LM head (tied embedding) weight.
        targets: (...) integer class indices in [0, V) or ``ignore_index``; the leading shape of hidden.
        chunk_tokens: rows of logits computed at a time, an int >= 1.
        ignore_index: targets with this value add nothing to the loss, the count or the gradients.
        reduction: "mean" or "sum".

    Returns:
        The 0-dim loss, fp32 for 16-bit matmuls and the matmul dtype otherwise. Gradients reach hidden and weight in
        their own dtypes.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: expected an int >= 1")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {_REDUCTIONS}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index={ignore_index!r}: expected an int")
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"hidden: shape {tuple(hidden.shape)} dtype {hidden.dtype}: expected a float (..., C) tensor")
    if not weight.is_floating_point() or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} dtype {weight.dtype}: expected a float (V, C) tensor "
                         f"with C={hidden.shape[-1]} from hidden")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool \
            or targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: shape {tuple(targets.shape)} dtype {targets.dtype}: expected integer class "
                         f"indices of shape {tuple(hidden.shape[:-1])} (hidden's leading shape)")
    device_type = hidden.device.type
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(device_type):
        raise ValueError(f"hidden dtype {hidden.dtype} and weight dtype {weight.dtype}: expected the same dtype "
                         "(or torch.autocast, which casts both)")
    grad = torch.is_grad_enabled()
    return _function(device_type).apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
                                        chunk_tokens, ignore_index, reduction, grad and hidden.requires_grad,
                                        grad and weight.requires_grad)
