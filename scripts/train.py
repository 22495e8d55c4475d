"""Train the GPT: `python scripts/train.py [attn=flash|sdpa|eager] [seq_len=16k] [model=...] [trainer.*=...]`.

Configs live in conf/ (train.yaml; on a machine without CUDA, train_cpu.yaml, which only makes train.yaml
small enough for a CPU). Outputs (checkpoints, logs, wandb run) go to Hydra's run directory.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs the interpreter
os.environ.setdefault("WANDB_MODE", "offline")

import hydra  # noqa: E402

from flashtrain.config import register_resolvers  # noqa: E402
from flashtrain.train import train  # noqa: E402

register_resolvers()


@hydra.main(config_path="../conf", config_name="train" if torch.cuda.is_available() else "train_cpu",
            version_base="1.3")
def main(cfg):
    train(cfg)


if __name__ == "__main__":
    main()
