"""The provenance columns every benchmark CSV carries: the GPU, torch, triton, the code's commit and the date."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

FIELDS = ["gpu", "torch", "triton", "commit", "date"]


def commit() -> str:
    """The commit the code came from: $FLASHTRAIN_COMMIT where set (a copy of the tree without .git), else git's
    HEAD with "+changes" when tracked files differ from it, else "unknown"."""
    if os.environ.get("FLASHTRAIN_COMMIT"):
        return os.environ["FLASHTRAIN_COMMIT"]
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def provenance() -> dict:
    """This process's values of FIELDS (the GPU's name, or the CPU's where there is none)."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit(),
                date=datetime.date.today().isoformat())
