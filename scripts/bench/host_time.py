"""Host time per call of flash_attention: kernels launched directly against launched through Triton's JIT.

A GPU host's speed drifts by more than the difference measured here (two processes' figures 100-460 us apart either
way on one H200 host), so both launch paths are timed in one process, in alternating
rounds (``flashtrain.kernels.launch.DIRECT`` switched between rounds): each round times ``--calls`` queued calls
(no synchronisation between them, so the host's time, not the GPU's, unless the GPU is the slower), and the paired
difference of each round pair is reported with the medians.

Writes long-format CSV rows (provider: direct | jit, mode: fwd | fwd+bwd, fp8, D, N, B, H, causal, round,
metric: host_us, value, gpu, torch, triton, commit, date) to --out and prints a summary. Needs a CUDA GPU.

    python scripts/bench/host_time.py --out benchmarks/results/host_time.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch
import triton
from flashtrain.kernels import launch

from flashtrain import flash_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

FIELDS = ["provider", "mode", "fp8", "D", "N", "B", "H", "causal", "round", "metric", "value", *provenance.FIELDS]
# (B, H, N, D): short sequences, where a call's host time exceeds its GPU time, and the FP8 table's 4k point whose
# FP8 rows were host-bound (README)
SHAPES = [(1, 16, 1024, 64), (1, 16, 1024, 128), (1, 8, 1024, 256), (4, 16, 4096, 128)]


def round_us(fn, calls: int) -> float:
    """Host microseconds a call over ``calls`` queued calls (synchronised before and after the round)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def cases(shape, causal: bool, fp8):
    """(mode, fn) pairs for one point: the forward without autograd, and forward + backward."""
    batch, heads, seq, head_dim = shape
    q, k, v, do = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            flash_attention(q, k, v, causal=causal, fp8=fp8)

    def forward_backward():
        flash_attention(*leaves, causal=causal, fp8=fp8).backward(do)

    yield "fwd", forward
    if fp8 != "forward":  # its backward is bf16's
        yield "fwd+bwd", forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV file to write")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per launch path (alternating)")
    parser.add_argument("--calls", type=int, default=100, help="queued calls per round (a quarter at 4k)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench/host_time.py needs a CUDA GPU")
    if not launch.DIRECT:
        raise SystemExit(f"direct launches are off here (triton {triton.__version__}): nothing to compare")
    meta = provenance.provenance()
    with open(args.out, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        writer.writeheader()
        for shape in SHAPES:
            batch, heads, seq, head_dim = shape
            for causal in (False, True):
                for fp8 in (None, "forward", "full"):
                    for mode, fn in cases(shape, causal, fp8):
                        for direct in (False, True, True):  # compile, autotune, then a direct launch of each key
                            launch.DIRECT = direct
                            fn()
                        times = {"direct": [], "jit": []}
                        for rnd in range(args.rounds):
                            for provider in ("jit", "direct") if rnd % 2 else ("direct", "jit"):
                                launch.DIRECT = provider == "direct"
                                us = round_us(fn, args.calls if batch * seq <= 1024 else max(1, args.calls // 4))
                                times[provider].append(us)
                                writer.writerow(dict(provider=provider, mode=mode, fp8=str(fp8), D=head_dim, N=seq,
                                                     B=batch, H=heads, causal=causal, round=rnd, metric="host_us",
                                                     value=round(us, 2), **meta))
                        launch.DIRECT = True
                        diffs = [d - j for d, j in zip(times["direct"], times["jit"])]
                        print(f"D={head_dim:3d} N={seq:5d} B={batch} H={heads:2d} causal={causal!s:5} "
                              f"fp8={fp8!s:7} {mode:7s} jit {statistics.median(times['jit']):8.1f} us  direct "
                              f"{statistics.median(times['direct']):8.1f} us  paired difference median "
                              f"{statistics.median(diffs):+7.1f} (min {min(diffs):+7.1f}, max {max(diffs):+7.1f})",
                              flush=True)


if __name__ == "__main__":
    main()
