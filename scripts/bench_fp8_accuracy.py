"""FP8 attention accuracy on FlashAttention-3's benchmark: RMSE against float64 attention.

Inputs: N(0, 1) with 0.1% of entries from N(0, 100), q, k, v of (1, heads, seq, head_dim), non-causal. With
--key-mean M, every key also gets M * u, one N(0, 1) vector u per head (a component all keys share, as trained
models' keys have). Rows: the per-tensor FP8 baseline and block scales without / with Hadamard, simulated in
float64 (``flashtrain.reference.fp8_attention_ref`` with the kernel's tiles), the last also with K smoothing; the
FP8 kernels (``fp8="forward"``) with block scales alone, with the rotation, and with the rotation and K
smoothing (the default); and the 16-bit kernel. Inputs are bfloat16 on a GPU and float16 on the CPU (Triton's
interpreter has no bfloat16 arithmetic), where the kernels run through the interpreter: keep --seq small there.
Writes long-format CSV rows (provider, dtype, D, N, metric, value, device, torch, triton, date).

    python scripts/bench_fp8_accuracy.py --out benchmarks/results/fp8_accuracy_h200.csv          # GPU
    TRITON_INTERPRET=1 python scripts/bench_fp8_accuracy.py --seq 1024 --head-dims 64 128 --out X.csv  # CPU
    python scripts/bench_fp8_accuracy.py --key-mean 3 --out Y.csv                                    # shared key part
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (flashtrain imports it)

import triton  # noqa: E402

from flashtrain import flash_attention  # noqa: E402
from flashtrain.fp8 import _rotation_signs  # noqa: E402
from flashtrain.kernels import configs  # noqa: E402
from flashtrain.reference import attention_ref, fp8_attention_ref  # noqa: E402
from flashtrain.testing import outlier_data  # noqa: E402

FIELDS = ["provider", "dtype", "D", "N", "key_mean", "metric", "value", "device", "torch", "triton", "date"]


def rmse_rows(head_dim, seq, heads, device, dtype, key_mean=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (outlier_data((1, heads, seq, head_dim), gen, dtype).to(device) for _ in range(3))
    if key_mean:
        k = (k.float() + key_mean * torch.randn(1, heads, 1, head_dim, generator=gen).to(device)).to(dtype)
    exact = attention_ref(q, k, v)[0].double()
    cfg = configs.fp8_config(seq, head_dim)
    signs = _rotation_signs(head_dim, q.device)
    candidates = {
        "sim_per_tensor": lambda: fp8_attention_ref(q, k, v, scheme="tensor"),
        "sim_block": lambda: fp8_attention_ref(q, k, v, scheme="block", block_m=cfg["BLOCK_M"],
                                               block_n=cfg["BLOCK_N"]),
        "sim_block_hadamard": lambda: fp8_attention_ref(q, k, v, scheme="block+hadamard", block_m=cfg["BLOCK_M"],
                                                        block_n=cfg["BLOCK_N"], signs=signs),
        "sim_block_hadamard_smooth_k": lambda: fp8_attention_ref(q, k, v, scheme="block+hadamard",
                                                                 block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                                                                 signs=signs, smooth_k=True),
        "kernel_fp8_block": lambda: flash_attention(q, k, v, fp8="forward", hadamard=False, smooth_k=False),
        "kernel_fp8_block_hadamard": lambda: flash_attention(q, k, v, fp8="forward", smooth_k=False),
        "kernel_fp8_block_hadamard_smooth_k": lambda: flash_attention(q, k, v, fp8="forward"),
        f"kernel_{str(dtype).removeprefix('torch.')}": lambda: flash_attention(q, k, v),
    }
    for name, fn in candidates.items():
        yield name, ((fn().double() - exact) ** 2).mean().sqrt().item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/fp8_accuracy.csv")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--key-mean", type=float, default=0.0, help="size of a component all keys share")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)", torch=torch.__version__,
                triton=triton.__version__, date=datetime.date.today().isoformat())
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for head_dim in args.head_dims:
            for name, value in rmse_rows(head_dim, args.seq, args.heads, device, dtype, args.key_mean):
                writer.writerow(dict(provider=name, dtype=str(dtype).removeprefix("torch."), D=head_dim, N=args.seq,
                                     key_mean=args.key_mean, metric="rmse", value=f"{value:.4e}", **meta))
                print(f"D={head_dim:3d} {name:28s} {value:.3e}", flush=True)


if __name__ == "__main__":
    main()
