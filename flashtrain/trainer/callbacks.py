"""Throughput and memory logging for the trainer.

Not Lightning's ``ThroughputMonitor``: its MFU needs its own table of device peak FLOP/s, which does not
know the NVIDIA H200 and cannot be overridden from a config; this callback takes the peak from
``PEAK_TFLOPS`` or the config, and logs memory, step time and learning rate next to the throughput.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from .data import input_tokens

# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {
    "NVIDIA H200": 989.4,
    "NVIDIA H100 80GB HBM3": 989.4,
    "NVIDIA H100": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA L4": 121.0,
}


def peak_tflops_for(device: torch.device, override: float | None) -> float | None:
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return PEAK_TFLOPS.get(name)


class ThroughputLogger(L.Callback):
    """Every ``log_every_n_steps`` optimizer steps, log over the steps since the last log:
    perf/tokens_per_s (all processes, each token once), perf/tflops (per GPU), perf/mfu, perf/step_time_s, perf/lr,
    and on CUDA perf/peak_mem_allocated_gib and perf/peak_mem_reserved_gib (peaks since ``warmup_steps``).

    FLOPs per token come from the LightningModule's ``flops_per_token()``.
    """

    def __init__(self, log_every_n_steps: int = 10, warmup_steps: int = 3, peak_tflops: float | None = None):
        self.every, self.warmup, self.peak_override = log_every_n_steps, warmup_steps, peak_tflops
        self._t0 = None
        self._step0 = 0

    def _sync(self, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._step0 or step % self.every and step != self.warmup:
            return
        self._sync(pl_module)
        now = time.perf_counter()
        if step == self.warmup and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)  # memory peaks after warm-up
        if self._t0 is not None and step > self._step0:
            steps = step - self._step0
            step_time = (now - self._t0) / steps
            # this process's input tokens x every process: a context-parallel shard is 1/P of its sequences, so
            # each token counts once
            tokens_per_step = input_tokens(batch) * trainer.accumulate_grad_batches * trainer.world_size
            tokens_per_s = tokens_per_step / step_time
            tflops = tokens_per_s * pl_module.flops_per_token() / trainer.world_size / 1e12  # per device
            metrics = {"perf/tokens_per_s": tokens_per_s, "perf/step_time_s": step_time, "perf/tflops": tflops,
                       "perf/lr": trainer.optimizers[0].param_groups[0]["lr"]}
            peak = peak_tflops_for(pl_module.device, self.peak_override)
            if peak:
                metrics["perf/mfu"] = tflops / peak
            if pl_module.device.type == "cuda" and step > self.warmup:
                metrics["perf/peak_mem_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
                metrics["perf/peak_mem_reserved_gib"] = torch.cuda.max_memory_reserved(pl_module.device) / 2**30
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self._t0, self._step0 = now, step

    def on_train_start(self, trainer, pl_module):
        self._t0, self._step0 = None, trainer.global_step
