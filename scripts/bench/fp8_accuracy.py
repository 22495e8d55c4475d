"""FP8 attention accuracy on FlashAttention-3's benchmark: RMSE against float64 attention.

Inputs: N(0, 1) with 0.1% of entries from N(0, 100), q, k, v of (1, heads, seq, head_dim), non-causal. With
--key-mean M, every key also gets M * u, one N(0, 1) vector u per head (a component all keys share, as trained
models' keys have). Rows: the per-tensor FP8 baseline and block scales without / with Hadamard, simulated in
float64 (``flashtrain.ops.reference.fp8_attention_ref`` with the kernel's tiles), the last also with K smoothing; the
FP8 kernels (``fp8="forward"``) with block scales alone, with the rotation, and with the rotation and K
smoothing (the default); and the 16-bit kernel. Inputs are bfloat16 on a GPU and float16 on the CPU (Triton's
interpreter has no bfloat16 arithmetic), where the kernels run through the interpreter: keep --seq small there.
Writes long-format CSV rows (provider, dtype, D, N, key_mean, metric, value, gpu, torch, triton, commit, date).

    python scripts/bench/fp8_accuracy.py --out X.csv                                   # GPU
    python scripts/bench/fp8_accuracy.py --seq 1024 --head-dims 64 128 --key-mean 0 3  # CPU: the README's table
    python scripts/bench/fp8_accuracy.py --report benchmarks/results/fp8_accuracy.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (flashtrain imports it)


from flashtrain.kernels.fp8 import tiles as fp8_tiles  # noqa: E402

from flashtrain import flash_attention  # noqa: E402
from flashtrain.ops.fp8 import _rotation_signs  # noqa: E402
from flashtrain.ops.reference import attention_ref, fp8_attention_ref  # noqa: E402
from flashtrain.testing import outlier_data  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

FIELDS = ["provider", "dtype", "D", "N", "key_mean", "metric", "value", *provenance.FIELDS]


def rmse_rows(head_dim, seq, heads, device, dtype, key_mean=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (outlier_data((1, heads, seq, head_dim), gen, dtype).to(device) for _ in range(3))
    if key_mean:
        k = (k.float() + key_mean * torch.randn(1, heads, 1, head_dim, generator=gen).to(device)).to(dtype)
    exact = attention_ref(q, k, v)[0].double()
    cfg = fp8_tiles.fp8_config(seq, head_dim)
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


# the report's columns: (provider, heading), in the order of the scheme's parts
COLUMNS = [("sim_per_tensor", "FP8 per-tensor (simulated)"), ("kernel_fp8_block", "block scales"),
           ("kernel_fp8_block_hadamard", "+ Hadamard"),
           ("kernel_fp8_block_hadamard_smooth_k", "+ K smoothing (default)")]


def report(path: str) -> str:
    """A markdown table of a CSV of this script: RMSE per head_dim and key mean, one column per scheme, and the
    16-bit kernel's."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    value = {(r["provider"], r["D"], r["key_mean"]): float(r["value"]) for r in rows}
    first = rows[0]
    keys = list(dict.fromkeys((r["D"], r["key_mean"]) for r in rows))
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; N = {first['N']}, "
             f"{first['dtype']} inputs; RMSE against float64 attention; raw rows: [`{path}`]({path}).", "",
             "| head_dim | keys | " + " | ".join(h for _, h in COLUMNS) + f" | {first['dtype']} kernel |",
             "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for d, key_mean in keys:
        keys_text = "benchmark" if float(key_mean) == 0 else f"+ {float(key_mean):g}x a shared component"
        cells = [f"{value[(p, d, key_mean)]:.2e}" for p, _ in COLUMNS]
        cells.append(f"{value[('kernel_' + first['dtype'], d, key_mean)]:.1e}")
        lines.append(f"| {d} | {keys_text} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/fp8_accuracy.csv")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--key-mean", type=float, nargs="+", default=[0.0],
                        help="sizes of a component all keys share (one set of rows each)")
    parser.add_argument("--report", metavar="CSV", help="print the table of an existing CSV instead")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    meta = provenance.provenance()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for key_mean in args.key_mean:
            for head_dim in args.head_dims:
                for name, value in rmse_rows(head_dim, args.seq, args.heads, device, dtype, key_mean):
                    writer.writerow(dict(provider=name, dtype=str(dtype).removeprefix("torch."), D=head_dim,
                                         N=args.seq, key_mean=key_mean, metric="rmse", value=f"{value:.4e}", **meta))
                    print(f"key_mean={key_mean} D={head_dim:3d} {name:34s} {value:.3e}", flush=True)


if __name__ == "__main__":
    main()
