"""A decoder-only GPT for long-context training: rotary positions, pre-norm blocks, tied embeddings.

The attention inner product is a pluggable function ``attn(q, k, v, mask) -> out`` on (B, nh, T, hs) tensors,
causal, with an ``AttentionMask`` that may keep each query within its document (packed batches) and within a
sliding window: ``flashtrain.trainer.backends`` holds the choices (flash, sdpa, eager). Every choice computes the
same function, so weights and losses agree up to kernel rounding.

Sliding windows: ``window_size=W`` lets each token see itself and the W tokens before it (flash-attn's
``window_size=(W, 0)``); ``window_pattern`` says which layers are local ("L") and which global ("G"), cycled over
the layers: "LG" alternates them (Gemma 2), "LLLG" keeps every fourth layer global; None makes every layer local.

Context parallelism: given a ``SequenceShard`` the model runs on one rank's shard of each sequence (the
load-balanced layout of ``flashtrain.distributed``), rotary angles at the tokens' global positions; the mask carries
the process group, and the ``flash`` backend attends over the whole sequence with ``ring_attention``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flashtrain.distributed import torch_ring

from .loss import chunked_cross_entropy

# Activation checkpointing per block: "none" keeps every activation; "full" keeps each block's input and recomputes
# the block in the backward; "selective" keeps the input and the attention's output and LSE, and recomputes the
# rest, so the flash forward (the costly part at long context) never runs twice. Ring attention (context
# parallelism) is recomputed: flashtrain's launches its kernels inside an autograd.Function that the policy cannot
# see, and PyTorch's ring (attn=sdpa) calls SDPA kernels per block, whose P partial outputs the policy leaves alone.
CHECKPOINTING = ("none", "selective", "full")


def _saved_ops() -> tuple:
    """The ops whose outputs selective checkpointing keeps: flashtrain's attention forwards and PyTorch's SDPA
    kernels (as torchtitan's policy does)."""
    from flashtrain.ops.attention import ATTENTION_FORWARD_OPS

    aten = torch.ops.aten
    sdpa = [getattr(aten, name).default for name in ("_scaled_dot_product_flash_attention",
                                                     "_scaled_dot_product_efficient_attention",
                                                     "_scaled_dot_product_cudnn_attention")
            if hasattr(aten, name)]
    return (*ATTENTION_FORWARD_OPS, *sdpa)


def _keep_attention(ctx, op, *args, **kwargs):
    keep = op in _saved_ops() and not torch_ring.inside_ring()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_contexts():
    """Selective checkpointing's context pair: the attention forwards' outputs saved, everything else recomputed."""
    return create_selective_checkpoint_contexts(_keep_attention)


def offload_saved_tensors(keep: tuple[torch.Tensor, ...] = ()):
    """Saved-tensor hooks that copy what autograd saves to host memory (pinned, for CUDA tensors) and copy it back
    when the backward needs it, except the tensors in ``keep``. Around checkpointed blocks the only tensors autograd
    saves are each checkpoint's inputs (the checkpoint's own hooks hold everything inside the block): the blocks'
    (B, T, C) fp32 residual inputs, 3 KB a token a layer at n_embd 768, leave the GPU. The copy out is synchronous
    (the host waits for it); the copy back is queued on the current stream ahead of the block's recompute."""
    # torch.autograd.graph.save_on_cpu(pin_memory=True) copies the same way but has no ``keep``: every block would
    # copy the shared rotary tables too (12 x 256 MiB of pinned memory and copies a step at 1M; estimated, not timed)
    kept = {t.data_ptr() for t in keep}

    def pack(tensor):
        if tensor.numel() == 0 or tensor.data_ptr() in kept:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        host.copy_(tensor)
        return tensor.device, tensor.requires_grad, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, requires_grad, host = packed
        return host.to(device, non_blocking=True).requires_grad_(requires_grad)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level by default
    seq_len: int = 1024  # context length trained at (for FLOP counts; rotary positions work at any length)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    bias: bool = False
    activation_checkpointing: str = "none"  # none | selective | full (see ``checkpoint_contexts``)
    activation_offload: bool = False  # the checkpointed blocks' inputs in host memory (``offload_saved_tensors``)
    window_size: int | None = None  # sliding-window attention over the W previous tokens (None: none)
    window_pattern: str | None = None  # local ("L") and global ("G") layers, cycled; None: all local
    loss_chunk: int = 8192  # tokens per chunk of the fused LM head + cross-entropy (its (chunk, vocab) logits)

    def __post_init__(self):
        if isinstance(self.activation_checkpointing, bool):  # the older boolean form
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"model.activation_checkpointing={self.activation_checkpointing!r}; expected one of "
                             f"{CHECKPOINTING}")
        if self.activation_offload and self.activation_checkpointing == "none":
            raise ValueError("model.activation_offload=true moves the checkpointed blocks' inputs to host memory: set "
                             "model.activation_checkpointing=selective or full (it is 'none')")
        if self.window_size is not None and (isinstance(self.window_size, bool) or not isinstance(self.window_size, int)
                                             or self.window_size < 0):
            raise ValueError(f"model.window_size={self.window_size!r}; expected null or an int >= 0 (the tokens "
                             "before each token that it sees)")
        if self.window_pattern is not None and (not self.window_pattern or set(self.window_pattern) - {"L", "G"}):
            raise ValueError(f"model.window_pattern={self.window_pattern!r}; expected null or a string of L (local) "
                             "and G (global), e.g. 'LG'")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head dim n_embd/n_head={self.n_embd // self.n_head} must be even for rotary "
                             "position embeddings")


class AttentionMask(NamedTuple):
    """What a causal query may see besides the keys before it: only its own document (packed batches) and only
    the ``window`` keys before it. ``documents``: ``flashtrain.trainer.data.Documents`` or None. ``group``: the
    context-parallel process group whose ranks hold the rest of the sequence (None: the whole sequence is here)."""
    documents: object = None
    window: int | None = None
    group: object = None

    def dense(self, seq: int, device) -> torch.Tensor:
        """The explicit mask, bool (B or 1, 1, T, T), True where query i may see key j."""
        i = torch.arange(seq, device=device)[:, None]
        j = torch.arange(seq, device=device)[None, :]
        visible = j <= i
        if self.window is not None:
            visible = visible & (i - j <= self.window)
        visible = visible[None, None]
        if self.documents is not None:
            doc = self.documents.doc_ids.to(device)
            visible = visible & (doc[:, None, :, None] == doc[:, None, None, :])
        return visible


class SequenceShard(NamedTuple):
    """This rank's part of sequences split over a context-parallel process group (``flashtrain.distributed``'s
    load-balanced layout): ``positions`` (T_local,) long, the global positions of its tokens; ``group`` the process
    group of the ranks holding the other parts; ``size`` their number P (the full length is T_local x P)."""
    positions: torch.Tensor
    group: object
    size: int


def layer_windows(config: GPTConfig) -> list[int | None]:
    """Each layer's sliding window (None: global), from ``window_size`` and ``window_pattern``."""
    if config.window_size is None:
        return [None] * config.n_layer
    pattern = config.window_pattern or "L"
    return [config.window_size if pattern[i % len(pattern)] == "L" else None for i in range(config.n_layer)]


def rotary_cos_sin(seq_len: int, head_dim: int, base: float, device, dtype):
    """cos, sin tables (T, hs/2) for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :hs/2], x[..., hs/2:]) of x (B, T, nh, hs) by the position angles, cos and sin
    (T, hs/2), or (B, T, hs/2) where positions differ by row (documents)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, hs/2): broadcast over heads
    # back to x's dtype: under autocast the tables are fp32 while q, k come out of a bf16 linear layer
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attn: Callable):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn = attn

    def forward(self, x, cos, sin, mask: AttentionMask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)  # each (B, T, nh, hs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # (B, nh, T, hs) views: flash_attention takes them as they are, no copy
        y = self.attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=config.bias)
        self.down = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, attn: Callable, window: int | None = None):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, attn)
        self.norm2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, documents=None, group=None):
        mask = AttentionMask(documents, self.window, group)
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attn: Callable):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, attn, window) for window in layer_windows(config))
        self.norm_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self._rotary: dict = {}  # (length, device, dtype) -> the cos, sin tables: built once per length
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def rotary_tables(self, seq: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos, sin tables (seq, head_dim / 2), computed once per (length, device, dtype)."""
        key = (seq, torch.device(device), dtype)
        if key not in self._rotary:
            if len(self._rotary) >= 8:  # a few lengths at a time (training, validation, generation)
                self._rotary.clear()
            # outside inference mode: tables built during validation are used by training steps too
            with torch.inference_mode(False), torch.no_grad():
                self._rotary[key] = rotary_cos_sin(seq, self.config.n_embd // self.config.n_head,
                                                   self.config.rope_base, device, dtype)
        return self._rotary[key]

    def _rotary_for(self, seq: int, x: torch.Tensor, documents, shard) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``seq`` tokens: (T, hs/2) at positions 0..T-1, (B, T, hs/2) at each document's positions,
        or (T, hs/2) at a shard's global positions (the table spans the full T x P sequence)."""
        if shard is not None:
            cos, sin = self.rotary_tables(seq * shard.size, x.device, x.dtype)
            positions = shard.positions.to(x.device)
            return cos[positions], sin[positions]
        cos, sin = self.rotary_tables(seq, x.device, x.dtype)
        if documents is not None:
            positions = documents.positions.to(x.device)
            cos, sin = cos[positions], sin[positions]  # (B, T, hs/2)
        return cos, sin

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, documents=None,
                shard: SequenceShard | None = None):
        """idx, targets: (B, T) token ids; documents: ``flashtrain.trainer.data.Documents`` of idx (attention
        within each document, rotary positions restarting at each), or None; shard: a ``SequenceShard`` when idx
        is this rank's shard of longer sequences (context parallelism; no documents), or None. Returns (logits
        (B, T, vocab), None) without targets, (None, the mean cross-entropy over these tokens) with them
        (``loss.chunked_cross_entropy``: no logits tensor)."""
        B, T = idx.shape
        x = self.wte(idx)  # (B, T, C)
        cos, sin = self._rotary_for(T, x, documents, shard)
        group = shard.group if shard is not None else None
        mode = self.config.activation_checkpointing if self.training else "none"
        offload = self.config.activation_offload and mode != "none" and torch.is_grad_enabled()
        with offload_saved_tensors(keep=(cos, sin)) if offload else contextlib.nullcontext():
            for block in self.blocks:
                if mode == "full":
                    x = checkpoint(block, x, cos, sin, documents, group, use_reentrant=False)
                elif mode == "selective":
                    x = checkpoint(block, x, cos, sin, documents, group, use_reentrant=False,
                                   context_fn=checkpoint_contexts)
                else:
                    x = block(x, cos, sin, documents, group)
        x = self.norm_f(x)
        if targets is not None:  # the loss in chunks of tokens: the (B * T, vocab) logits never exist at once
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets, chunk_tokens=self.config.loss_chunk)
        return self.lm_head(x), None  # (B, T, vocab)
