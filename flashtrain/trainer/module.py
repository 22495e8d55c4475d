"""LightningModule around the GPT: next-token loss, AdamW with linear warmup and cosine decay."""

from __future__ import annotations

import math

import lightning as L
import torch

from . import backends, parallel
from .model import GPT, GPTConfig, SequenceShard, layer_windows


def mean_visible_keys(seq: int, window: int | None) -> float:
    """Keys a causal query sees on average over ``seq`` positions: (seq + 1) / 2, or fewer under a window of
    ``window`` keys before it (position i sees min(i, window) + 1)."""
    if window is None or window >= seq - 1:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * (window + 1)) / seq


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from 0 to 1, then cosine from 1 down to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """``model``: GPTConfig fields; ``attn``: a name from ``attention_backends`` and ``attn_options`` its options
    (e.g. {"fp8": "forward"}); ``optim``: AdamW settings (lr, betas, weight_decay, warmup_steps,
    min_lr_ratio); ``compile``: wrap the GPT in torch.compile; ``context_parallel``: the ranks that split each
    sequence (``flashtrain.trainer.parallel``; batches are then this rank's shards)."""

    def __init__(self, model: dict, attn: str, optim: dict, compile: bool = False, attn_options: dict | None = None,
                 context_parallel: int = 1):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(**model), backends.get(attn, **(attn_options or {})))
        self.forward_fn = torch.compile(self.model) if compile else self.model
        self.context_parallel = int(context_parallel)
        self.context_group = None  # set in configure_model from the device mesh
        self._sharded = False

    def configure_model(self):
        """Under Lightning's ModelParallelStrategy (a device mesh): FSDP2 over every rank, and the context-parallel
        group; nothing otherwise. Lightning calls this once per fit; the model is sharded once."""
        mesh = self.device_mesh
        if mesh is None or self._sharded:
            return
        parallel.shard_model(self.model, mesh)
        self.context_group = parallel.context_group(mesh)
        self._sharded = True

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x parameters (weights, forward + backward) plus attention, 12 x head_dim x
        heads x the keys a query sees on average, per layer: (seq + 1) / 2 causal, fewer in a sliding window.
        Document masking is not counted (it depends on the batch): MFU then counts each window's full causal work."""
        c = self.model.config
        keys = sum(mean_visible_keys(c.seq_len, window) for window in layer_windows(c))
        return 6 * self.model.num_params() + 12 * c.n_embd * keys

    def forward(self, idx, targets=None, documents=None, shard=None):
        return self.forward_fn(idx, targets, documents, shard)

    def step_loss(self, batch: dict):
        """The mean next-token loss of a batch from ``data.collate``: (B, T) inputs, the shifted targets, and the
        inputs' documents when document masking is on; or, with context parallelism, the mean over this rank's
        shard (B, T / P) of them, at their global positions."""
        if "inputs" not in batch:
            tokens = batch["tokens"]
            return self(tokens[:, :-1], tokens[:, 1:], batch.get("documents"))[1]
        if self.context_group is None:
            raise RuntimeError(f"context_parallel={self.context_parallel}: a sharded batch needs the context-parallel "
                               "process group, which configure_model takes from ModelParallelStrategy's device mesh")
        shard = SequenceShard(batch["positions"], self.context_group, self.context_parallel)
        return self(batch["inputs"], batch["targets"], None, shard)[1]

    def training_step(self, batch, batch_idx):
        loss = self.step_loss(batch)
        # sharded: each rank's loss covers 1/P of the tokens; equal shards, so the mean over ranks is the step's mean
        self.log("train/loss", loss, prog_bar=True, on_step=True, sync_dist=self.context_parallel > 1)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.step_loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        o = self.hparams.optim
        decay = [p for p in self.parameters() if p.dim() >= 2]  # matrices and embeddings
        no_decay = [p for p in self.parameters() if p.dim() < 2]  # norms and biases
        groups = [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
        # foreach, not fused: Lightning refuses gradient clipping with a fused optimizer under AMP
        optimizer = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), foreach=True)
        max_steps = max(1, self.trainer.max_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, o["warmup_steps"], max_steps, o["min_lr_ratio"]))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
