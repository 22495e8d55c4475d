"""The first call at a new long shape: forward + backward of ``flash_attention`` in a fresh process with an empty
Triton cache (every kernel compiled, every autotuning key tuned), beside the same call once tuned.

Points: bf16, causal, B=1, 4 query heads sharing one KV head (GQA 4:1), head_dim 64, N = 64k, 256k, 1M. Each point
runs in its own process with its own ``TRITON_CACHE_DIR``, so no pick or binary carries over from another point.

    python scripts/bench/first_call.py --out benchmarks/results/first_call.csv
    python scripts/bench/first_call.py --report benchmarks/results/first_call.csv   # the table, on any machine
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from readme import add_report_arguments, reported  # noqa: E402

FIELDS = ["N", "H", "H_kv", "D", "first_s", "tuned_s", *provenance.FIELDS]


def one_point(seq: int, heads: int, heads_kv: int, head_dim: int) -> dict:
    """In this process: seconds of the first forward + backward, then the median of three more."""
    import torch

    from flashtrain import flash_attention

    q = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, heads_kv, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))

    def step():
        torch.cuda.synchronize()
        start = time.perf_counter()
        flash_attention(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    first = step()
    tuned = sorted(step() for _ in range(3))[1]
    return dict(N=seq, H=heads, H_kv=heads_kv, D=head_dim, first_s=f"{first:.1f}", tuned_s=f"{tuned:.2f}")


def tokens(n: int) -> str:
    """65536 -> '64k', 1048576 -> '1M'."""
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}k"


def report(path: str) -> str:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; bf16, causal, "
             f"B=1, {first['H']} query heads, {first['H_kv']} KV head, head_dim {first['D']}; forward + backward in "
             f"a fresh process with an empty Triton cache; raw rows: [`{path}`]({path}).", "",
             "| N | " + " | ".join(tokens(int(r["N"])) for r in rows) + " |", "|---|" + "---|" * len(rows),
             "| first call, s | " + " | ".join(r["first_s"] for r in rows) + " |",
             "| once tuned, s | " + " | ".join(r["tuned_s"] for r in rows) + " |"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_arguments(parser, readme=False)  # the README quotes the figures in its text
    parser.add_argument("--seqs", nargs="+", type=int, default=[65536, 262144, 1048576])
    parser.add_argument("--point", type=int, help=argparse.SUPPRESS)  # internal: measure one N, print JSON
    args = parser.parse_args()
    if args.point:
        print(json.dumps(one_point(args.point, 4, 1, 64)))
        return
    if reported(parser, args, report):
        return
    meta = provenance.provenance()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for seq in args.seqs:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--point", str(seq)], env=env,
                                      capture_output=True, text=True)
            if done.returncode != 0:  # e.g. out of memory: the row says so, and the child's error is shown
                print(done.stderr[-2000:], file=sys.stderr)
                row = dict(N=seq, H=4, H_kv=1, D=64, first_s="error", tuned_s="error", **meta)
            else:
                row = dict(json.loads(done.stdout.strip().splitlines()[-1]), **meta)
            writer.writerow(row)
            f.flush()
            print(row, flush=True)


if __name__ == "__main__":
    main()
