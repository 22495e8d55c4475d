"""The load-balanced sequence layout of context parallelism: which tokens each rank holds.

A sequence of N tokens is cut into 2P equal chunks (P ranks in the group); rank r holds chunks r and 2P-1-r, one
from each end. Under a causal mask chunk i attends to chunks 0..i, so every rank gets the same work:

    chunks    0  1  2  3  4  5  6  7        (P = 4)
    rank      0  1  2  3  3  2  1  0

``shard_sequence`` gives this rank its two chunks, concatenated; ``unshard_sequence`` gathers every rank's shard
and puts the chunks back in order (differentiable: the gradient of each rank's shard comes back to it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_size(group=None) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size); (0, 1) without an initialised process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 * size) that ``rank`` holds: (rank, 2 * size - 1 - rank)."""
    return rank, 2 * size - 1 - rank


def positions(seq: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global positions (seq // size,) of the tokens ``rank`` holds of a sequence of ``seq`` tokens."""
    chunk = seq // (2 * size)
    first, second = chunk_ids(rank, size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def _check_divisible(length: int, size: int, fn: str, what: str) -> None:
    if length % (2 * size):
        raise ValueError(f"{fn}: {what} has length {length}, not a multiple of 2 x the group size {size} "
                         f"(= {2 * size}): the load-balanced layout cuts the sequence into {2 * size} equal chunks")


def shard_sequence(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's shard of the full-length ``x`` along ``dim``: chunks r and 2P-1-r of 2P, concatenated (a copy).
    The length along ``dim`` must divide by 2P; with one process (or none initialised) ``x`` itself."""
    rank, size = group_rank_size(group)
    if size == 1:
        return x
    return shard_sequence_for(x, dim, rank, size)


def shard_sequence_for(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """``shard_sequence`` for a given rank of a group of ``size``, without a process group (data loaders, the
    one-GPU simulation)."""
    _check_divisible(x.shape[dim], size, "shard_sequence", f"x (dim {dim})")
    chunks = x.chunk(2 * size, dim=dim)
    first, second = chunk_ids(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(x_local: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full-length tensor from every rank's shard (``shard_sequence``'s inverse): an all-gather, then the
    chunks in sequence order. Differentiable."""
    rank, size = group_rank_size(group)
    if size == 1:
        return x_local
    _check_divisible(x_local.shape[dim], 2, "unshard_sequence", f"x_local (dim {dim})")
    shards = _AllGather.apply(x_local.contiguous(), group, rank, size).unbind(0)
    ordered = [None] * (2 * size)
    for r, shard in enumerate(shards):
        first, second = chunk_ids(r, size)
        ordered[first], ordered[second] = shard.chunk(2, dim=dim)
    return torch.cat(ordered, dim=dim)


class _AllGather(torch.autograd.Function):
    """Every rank's tensor, stacked in rank order (size, ...); the gradient of this rank's is the sum over ranks of
    their gradients of its slot (an all-reduce, then the slot: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        gathered = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(gathered, x, group=group)
        ctx.group, ctx.rank = group, rank
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None
