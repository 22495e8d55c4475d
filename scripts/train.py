"""Train the GPT: ``python scripts/train.py [attn=flash|sdpa|...] [seq_len=16k] [model=...] [trainer.*=...]``.

The same command as ``flashtrain-train`` (``flashtrain.trainer.cli``): configs from conf/ (installed as
``flashtrain.conf``), ``train.yaml`` on a GPU and ``train_cpu.yaml`` on a machine without one.
"""

from flashtrain.trainer.cli import main

if __name__ == "__main__":
    main()
