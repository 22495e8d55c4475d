"""The trainer's command line: ``flashtrain-train [overrides]`` once installed, or ``python scripts/train.py
[overrides]`` from a clone; the same Hydra overrides either way (``attn=flash seq_len=16k``, ``--cfg job``, ``-m``).

Configs come from the installed package (``flashtrain.conf``): ``train`` on a CUDA machine, ``train_cpu`` (a tiny
model for a CPU) elsewhere. Outputs go to Hydra's run directory under ``outputs/``.
"""

from __future__ import annotations

import os

import torch


def _set_environment() -> bool:
    """Choose Triton's interpreter where there is no GPU (before anything imports triton) and offline wandb unless
    WANDB_MODE says otherwise. Returns whether CUDA is available."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    return cuda


def main() -> None:
    cuda = _set_environment()
    import hydra

    from .config import register_resolvers

    register_resolvers()

    @hydra.main(config_path="pkg://flashtrain.conf", config_name="train" if cuda else "train_cpu",
                version_base="1.3")
    def run(cfg) -> None:
        from .train import train

        train(cfg)

    run()


if __name__ == "__main__":
    main()
