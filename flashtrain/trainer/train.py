"""Build the data, model, callbacks, logger and Lightning Trainer from a composed Hydra config, and fit."""

from __future__ import annotations

import logging

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from . import parallel
from .config import parse_tokens
from .data import TextDataModule
from .module import GPTModule

log = logging.getLogger(__name__)


def build(cfg: DictConfig):
    """(datamodule, module, trainer) for ``cfg`` (conf/train.yaml and its groups)."""
    if cfg.trainer.max_steps is None or cfg.trainer.max_steps <= 0:
        raise ValueError(f"trainer.max_steps={cfg.trainer.max_steps}: expected a positive number of steps (the "
                         "training stream is endless, and the learning-rate schedule spans max_steps)")
    _check_precision(cfg)
    _check_masks(cfg)
    data_size, context_size = parallel.check_layout(cfg)
    _report_tokens_per_step(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = TextDataModule(**OmegaConf.to_container(cfg.data, resolve=True), context_parallel=context_size)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg["vocab_size"] = cfg.data.vocab_size  # the model's vocabulary follows the tokenizer
    attn_options = {k: v for k, v in OmegaConf.to_container(cfg.attn, resolve=True).items() if k != "name"}
    module = GPTModule(model=model_cfg, attn=cfg.attn.name, optim=OmegaConf.to_container(cfg.optim, resolve=True),
                       compile=cfg.compile, attn_options=attn_options, context_parallel=context_size)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger,
                          **parallel.strategy_override(cfg, data_size, context_size))
    return datamodule, module, trainer


def _check_precision(cfg: DictConfig) -> None:
    """flashtrain's kernels run on a CPU through Triton's interpreter, which has no bfloat16 arithmetic: refuse a
    bf16 run there before it starts (the op itself would refuse it at the first step)."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and cfg.attn.name.startswith("flash") and "bf16" in str(cfg.trainer.get("precision", "")):
        raise ValueError(f"trainer.precision={cfg.trainer.precision} with attn={cfg.attn.name} on the CPU: Triton's "
                         "interpreter has no bfloat16 arithmetic; use trainer.precision=32-true (or 16-mixed) on a "
                         "CPU, or attn=sdpa")


def _report_tokens_per_step(cfg: DictConfig) -> None:
    """Say so when the batch (a whole number of sequences) does not hold tokens_per_step tokens."""
    asked, seq = parse_tokens(cfg.tokens_per_step), cfg.data.seq_len
    actual = cfg.data.batch_size * seq
    if actual != asked:
        log.warning("tokens_per_step=%s (%d tokens) is not a whole number of seq_len=%d sequences: each step trains "
                    "on %d x %d = %d tokens", cfg.tokens_per_step, asked, seq, cfg.data.batch_size, seq, actual)


def _check_masks(cfg: DictConfig) -> None:
    """The FP8 path has no document masking or windows: refuse the combination before anything is built."""
    masked = cfg.data.get("document_masking") or cfg.model.get("window_size") is not None
    if masked and cfg.attn.name == "flash_fp8":
        raise ValueError(f"attn=flash_fp8 with data.document_masking={cfg.data.get('document_masking')} and "
                         f"model.window_size={cfg.model.get('window_size')}: the FP8 path has neither yet; "
                         "use attn=flash")


def train(cfg: DictConfig):
    datamodule, module, trainer = build(cfg)
    log.info("GPT: %.1fM parameters, attn=%s, seq_len=%d, batch=%d, %.3g FLOPs/token",
             module.model.num_params() / 1e6, cfg.attn.name, cfg.data.seq_len, cfg.data.batch_size,
             module.flops_per_token())
    if trainer.logger is not None:
        trainer.logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    last = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    log.info("last logged metrics: %s", last)
    return trainer
