"""Context parallelism in the trainer: a mesh of data-parallel x context-parallel ranks.

``context_parallel=P`` splits each sequence over P ranks (``flashtrain.distributed``: the load-balanced layout and
ring attention, flashtrain's with attn=flash, PyTorch's with attn=sdpa); the W = trainer.devices x trainer.num_nodes
processes form a (D, P) mesh, D = W / P data-parallel replicas, rank = d x P + c. Lightning's
``ModelParallelStrategy`` builds that mesh, with the dimension names ("data_parallel", "tensor_parallel"): its second
dimension is the context-parallel one here (``CONTEXT_DIM``).
Parameters are sharded with FSDP2 (``fully_shard``) over the flattened mesh, so gradients are averaged over all W
ranks: every rank's loss is the mean over its equal-sized shard, and the average of their gradients is the gradient
of the mean over all the step's tokens.

The ranks of one context-parallel group read the same samples (data-parallel rank d = rank // P of D), and each
keeps its shard of every sequence (context-parallel rank c = rank % P of P).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, ListConfig

DATA_DIM = "data_parallel"
# Lightning's ModelParallelStrategy names its second mesh dimension "tensor_parallel"; it carries the sequence here
CONTEXT_DIM = "tensor_parallel"
STRATEGIES = ("auto", "model_parallel")  # trainer.strategy values that context_parallel > 1 accepts
RING_BACKENDS = ("flash", "sdpa")  # attn= values with ring attention: flashtrain's ring, PyTorch's over SDPA


def world_size(trainer: DictConfig) -> int:
    """The processes a Lightning Trainer config starts: trainer.devices (an int, a list of ids, "0,1", or "auto" /
    -1: every GPU, or one process on a CPU) x trainer.num_nodes."""
    devices = trainer.get("devices", "auto")
    nodes = int(trainer.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple, ListConfig)):
        count = len(devices)
    elif str(devices).strip() in ("auto", "-1"):
        accelerator = str(trainer.get("accelerator", "auto"))
        gpus = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        count = torch.cuda.device_count() if gpus else 1
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    else:
        count = int(devices)
    return count * nodes


def check_layout(cfg: DictConfig) -> tuple[int, int]:
    """(D, P): data-parallel replicas and context-parallel ranks of ``cfg``; a ValueError naming the options when
    they do not fit together (checked before anything is built)."""
    size = cfg.get("context_parallel", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"context_parallel={size!r}: expected an int >= 1 (the ranks that split each sequence)")
    world = world_size(cfg.trainer)
    if world % size:
        raise ValueError(f"context_parallel={size} with trainer.devices={cfg.trainer.get('devices')} x "
                         f"trainer.num_nodes={cfg.trainer.get('num_nodes', 1)} = {world} processes: expected a "
                         f"world size that is a multiple of context_parallel")
    if size == 1:
        return world, 1
    seq = cfg.data.seq_len
    if seq % (2 * size):
        raise ValueError(f"seq_len={seq} with context_parallel={size}: expected a multiple of 2 x context_parallel "
                         f"= {2 * size} (the load-balanced layout cuts each sequence into {2 * size} equal chunks)")
    _check_supported(cfg, size)
    return world // size, size


def _check_supported(cfg: DictConfig, size: int) -> None:
    """What ring attention does not do yet: refuse it with context_parallel > 1."""
    if cfg.attn.name not in RING_BACKENDS:
        raise ValueError(f"attn={cfg.attn.name} with context_parallel={size}: only attn=flash (flashtrain's ring) "
                         "and attn=sdpa (PyTorch's) run ring attention; use one of them or context_parallel=1")
    if cfg.data.get("document_masking"):
        raise ValueError(f"data.document_masking={cfg.data.document_masking} with context_parallel={size}: ring "
                         "attention has no document masking yet; use data.document_masking=false or "
                         "context_parallel=1")
    if cfg.model.get("window_size") is not None:
        raise ValueError(f"model.window_size={cfg.model.window_size} with context_parallel={size}: ring attention "
                         "has no sliding windows yet; use model.window_size=null or context_parallel=1")
    strategy = cfg.trainer.get("strategy", "auto")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy={strategy!r} with context_parallel={size}: expected one of {STRATEGIES} "
                         "(Lightning's ModelParallelStrategy over the data_parallel x context_parallel mesh)")


def strategy_override(cfg: DictConfig, data_size: int, context_size: int) -> dict:
    """The Trainer's ``strategy`` argument when the config asks for the mesh: {} for an ordinary run, else
    {"strategy": ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=P)}."""
    if context_size == 1 and cfg.trainer.get("strategy", "auto") != "model_parallel":
        return {}
    from lightning.pytorch.strategies import ModelParallelStrategy

    return {"strategy": ModelParallelStrategy(data_parallel_size=data_size, tensor_parallel_size=context_size)}


def data_rank(global_rank: int, world: int, context_size: int) -> tuple[int, int]:
    """(d, D): this process's data-parallel rank and the number of replicas; the ranks d x P ... d x P + P - 1 of
    one context-parallel group read the same samples."""
    return global_rank // context_size, world // context_size


def context_rank(global_rank: int, context_size: int) -> int:
    """c: which shard of each sequence this process holds (``flashtrain.distributed.positions``)."""
    return global_rank % context_size


def context_group(mesh):
    """The process group of this rank's context-parallel ranks (the mesh's ``CONTEXT_DIM``)."""
    return mesh[CONTEXT_DIM].get_group()


def shard_model(model: torch.nn.Module, mesh) -> None:
    """FSDP2 over every rank of ``mesh`` (its dimensions flattened): each block, then the root (the embeddings, the
    tied LM head and the final norm). Gradients are reduce-scattered as the mean over all ranks."""
    from torch.distributed.fsdp import fully_shard

    flat = mesh[DATA_DIM, CONTEXT_DIM]._flatten("data_context")
    for block in model.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
