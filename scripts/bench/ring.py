"""Ring attention's compute on one GPU: each rank's partial attentions and merges run in turn, and the ring's
compute efficiency is the full-sequence flash time divided by P times the slowest rank's time (1.0: the ring adds
no compute and balances perfectly; communication is not in it: the runs on several GPUs measure that).

Points: bf16, causal, B=1, 12 heads of 64 (gpt2-small) and 16 heads of 128, N 32k-128k, P = 2, 4, 8; forward and
forward + backward. Medians of ``triton.testing.do_bench`` after one untimed call.

    python scripts/bench/ring.py --out benchmarks/results/ring.csv
    python scripts/bench/ring.py --report benchmarks/results/ring.csv --readme README.md   # any machine
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import triton

from flashtrain.distributed.layout import shard_sequence_for
from flashtrain.distributed.ring import rank_backward, rank_forward
from flashtrain.ops.attention import backward_kernels, forward_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from readme import add_report_arguments, reported  # noqa: E402

FIELDS = ["H", "D", "N", "P", "mode", "full_ms", "slowest_rank_ms", "efficiency", *provenance.FIELDS]


def bench(fn, reps_ms: int) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=reps_ms // 4, rep=reps_ms, return_mode="median")


def points(heads: int, head_dim: int, seq: int, sizes: list[int], reps_ms: int) -> list[dict]:
    """Forward and forward + backward rows of (H, D, N) at each P in ``sizes`` (the full-sequence time once)."""
    scale = head_dim ** -0.5
    q, k, v, dout = (torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = forward_kernels(q, k, v, True, scale, None, 0.0, 0)
    full = {"fwd": bench(lambda: forward_kernels(q, k, v, True, scale, None, 0.0, 0), reps_ms),
            "fwd+bwd": bench(lambda: (forward_kernels(q, k, v, True, scale, None, 0.0, 0),
                                      backward_kernels(dout, q, k, v, out, lse, None, True, scale)), reps_ms)}
    rows = []
    for size in sizes:
        shards = [[shard_sequence_for(t, 2, r, size) for t in (q, k, v, dout)] for r in range(size)]

        def kv_of(j):
            return shards[j][1], shards[j][2]

        ranks = {"fwd": [], "fwd+bwd": []}
        for r in range(size):
            q_r, _, _, dout_r = shards[r]
            out_r, lse_r = rank_forward(q_r, kv_of, r, size, True, scale)
            ranks["fwd"].append(bench(lambda: rank_forward(q_r, kv_of, r, size, True, scale), reps_ms))
            ranks["fwd+bwd"].append(bench(lambda: (rank_forward(q_r, kv_of, r, size, True, scale),
                                                   rank_backward(dout_r, q_r, out_r, lse_r, kv_of, r, size, True,
                                                                 scale)), reps_ms))
        rows += [dict(H=heads, D=head_dim, N=seq, P=size, mode=mode, full_ms=f"{full[mode]:.3f}",
                      slowest_rank_ms=f"{max(ranks[mode]):.3f}",
                      efficiency=f"{full[mode] / (size * max(ranks[mode])):.3f}") for mode in ("fwd", "fwd+bwd")]
    return rows


START, END = "<!-- ring-benchmark:start -->", "<!-- ring-benchmark:end -->"


def report(path: str) -> str:
    """The README's table: compute efficiency forward / forward + backward, one row per (H, D, N), one column per P."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    sizes = sorted({int(r["P"]) for r in rows})
    cell = {(r["H"], r["D"], r["N"], int(r["P"]), r["mode"]): r["efficiency"] for r in rows}
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; bf16, causal, B=1; "
             "compute efficiency forward / forward + backward (full-sequence time over P x the slowest rank's); "
             f"raw rows: [`{path}`]({path}).", "",
             "| H x D | N | " + " | ".join(f"P = {p}" for p in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for heads, head_dim, seq in dict.fromkeys((r["H"], r["D"], r["N"]) for r in rows):
        cells = [" / ".join(cell.get((heads, head_dim, seq, p, mode), "") for mode in ("fwd", "fwd+bwd"))
                 for p in sizes]
        lines.append(f"| {heads} x {head_dim} | {int(seq) // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_arguments(parser)
    parser.add_argument("--seqs", nargs="+", type=int, default=[32768, 65536, 131072])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--reps-ms", type=int, default=200)
    args = parser.parse_args()
    if reported(parser, args, report, START, END):
        return
    meta = provenance.provenance()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for heads, head_dim in ((12, 64), (16, 128)):
            for seq in args.seqs:
                for row in points(heads, head_dim, seq, args.sizes, args.reps_ms):
                    writer.writerow(dict(row, **meta))
                    f.flush()
                    print(row, flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
