"""Masked attention benchmark: packed documents and sliding windows, flashtrain beside FlexAttention (BlockMask)
and PyTorch's own varlen attention, side by side in one run.

Points (bf16, causal): documents of about L tokens packed into T tokens (lengths drawn uniformly in [L/2, 3L/2]
from a fixed seed, the last cut to fit), and a sliding window of W keys (``window_size=(W, 0)``) over one sequence
of T tokens; head_dim 128 (16 heads, and GQA 16:4) and 64 (32 heads). Beside each, flashtrain's own dense causal
attention at the document's (window's) length on the same number of tokens, the rate the masked kernels should
reach. TFLOP/s count only the kept work: forward 4*H*D per visible (query, key) pair, backward 2.5x.

Providers: flashtrain (``flash_attention_varlen`` / ``window_size``), flex (``flex_attention`` compiled, with a
BlockMask from a document or window mask_mod), torch_varlen (``torch.nn.attention.varlen.varlen_attn`` where this
torch has it; documents only without GQA support), flashtrain_dense (dense causal at the document length).

    python scripts/bench/masks.py --out benchmarks/results/masks.csv
    python scripts/bench/masks.py --report benchmarks/results/masks.csv --readme README.md   # any machine
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import random
import sys
import time

import torch

from flashtrain import flash_attention, flash_attention_varlen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from attention import time_directions, warm_up_gpu  # noqa: E402
from readme import add_report_arguments, reported  # noqa: E402

FIELDS = ["case", "provider", "D", "H", "H_kv", "T", "L", "docs", "mode", "ms", "tflops", "status",
          *provenance.FIELDS]
PROVIDERS = ["flashtrain", "flex", "torch_varlen", "flashtrain_dense"]


def document_lengths(total: int, mean: int, seed: int = 0) -> list[int]:
    """Lengths in [mean/2, 3*mean/2] summing to ``total`` (the last one cut)."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(mean // 2, 3 * mean // 2), total - sum(lengths)))
    return lengths


def kept_pairs(case: str, lengths: list[int], window: int) -> int:
    """Visible (query, key) pairs: causal within each document, or the causal window over one sequence."""
    if case == "documents":
        return sum(n * (n + 1) // 2 for n in lengths)
    total = lengths[0]
    full = min(window, total)  # query i sees min(i, window) + 1 keys
    return sum(range(1, full + 1)) + (total - full) * (window + 1)


def make_fn(provider, case, lengths, window, heads, heads_kv):
    """fn(q, k, v) -> out on (1, H, T, D) tensors, or None where the provider has no such mask."""
    total = sum(lengths)
    gqa = heads != heads_kv
    if provider == "flashtrain" and case == "documents":
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)

        def packed(q, k, v):  # (1, H, T, D) -> (T, H, D) views, as a model's projections give them
            out = flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                         longest, longest, causal=True)
            return out.transpose(0, 1)[None]
        return packed
    if provider == "flashtrain":
        return lambda q, k, v: flash_attention(q, k, v, causal=True, window_size=(window, 0))
    if provider == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        if case == "documents":
            doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                          torch.tensor(lengths, device="cuda"))

            def mask_mod(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        block_mask = create_block_mask(mask_mod, None, None, total, total)
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if provider == "torch_varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        params = inspect.signature(varlen_attn).parameters
        if gqa and "enable_gqa" not in params:
            return None
        if case == "documents":
            seqs = lengths
        elif "window_size" in params:
            seqs = [total]
        else:
            return None
        cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        kwargs = dict(window_size=(window if case == "window" else -1, 0)) if "window_size" in params else \
            dict(is_causal=True)
        if gqa:
            kwargs["enable_gqa"] = True

        def torch_packed(q, k, v):
            out = varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, max(seqs),
                              max(seqs), **kwargs)
            return out.transpose(0, 1)[None]
        return torch_packed
    raise ValueError(f"unknown provider {provider!r}")


def points(quick: bool):
    """(case, total T, length L (document mean or window), head_dim, heads, heads_kv)."""
    shapes = [(128, 16, 16), (128, 16, 4), (64, 32, 32)]
    cases = [("documents", 16384, 2048), ("documents", 16384, 512), ("documents", 65536, 4096),
             ("window", 16384, 4096), ("window", 65536, 4096)]
    if quick:
        return [(c, t, n, *shapes[0]) for c, t, n in cases[:1] + cases[3:4]]
    return [(c, t, n, *s) for s in shapes for c, t, n in cases]


START, END = "<!-- masks-benchmark:start -->", "<!-- masks-benchmark:end -->"


def report(path: str) -> str:
    """The README's table from a results CSV: TFLOP/s fwd / bwd per provider, and flashtrain's ratios to Flex and
    to its own dense causal rate at the document (window) length."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    rate = {(r["case"], r["T"], r["L"], r["D"], r["H"], r["H_kv"], r["provider"], r["mode"]): r for r in rows}
    points = list(dict.fromkeys((r["case"], r["T"], r["L"], r["D"], r["H"], r["H_kv"]) for r in rows))

    def tflops(point, provider, mode):
        r = rate.get((*point, provider, mode))
        return None if r is None or r["status"] != "ok" else float(r["tflops"])

    def pair(point, provider):
        f, b = tflops(point, provider, "fwd"), tflops(point, provider, "bwd")
        return "" if f is None else f"{f:.0f} / {b:.0f}"

    def ratio(point, other):
        cells = []
        for mode in ("fwd", "bwd"):
            ours, theirs = tflops(point, "flashtrain", mode), tflops(point, other, mode)
            cells.append("" if ours is None or not theirs else f"{ours / theirs:.2f}")
        return " / ".join(cells)

    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; bf16, causal; "
             "TFLOP/s forward / backward counting only the kept pairs; raw rows: "
             f"[`{path}`]({path}). Documents: lengths uniform in [L/2, 3L/2]; window: `window_size=(L, 0)`. "
             "dense: flashtrain's dense causal attention at length L on the same tokens.", "",
             "| mask | T | L | D | H (H_kv) | flashtrain | flex | torch varlen | dense | vs flex | vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in points:
        case, total, length, head_dim, heads, heads_kv = point
        lines.append(f"| {case} | {int(total) // 1024}k | {length} | {head_dim} | {heads} ({heads_kv}) | "
                     f"{pair(point, 'flashtrain')} | {pair(point, 'flex')} | {pair(point, 'torch_varlen')} | "
                     f"{pair(point, 'flashtrain_dense')} | {ratio(point, 'flex')} | "
                     f"{ratio(point, 'flashtrain_dense')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_arguments(parser)
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--quick", action="store_true", help="two points, for a smoke run")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first SKIP points (measured already)")
    args = parser.parse_args()
    if reported(parser, args, report, START, END):
        return
    providers = args.providers.split(",")
    meta = provenance.provenance()
    warm_up_gpu(3.0)
    start = time.time()
    with open(args.out, "w", newline="") as f:  # rows are written as they come: a cut-off run keeps its points
        writer = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        writer.writeheader()
        for point in points(args.quick)[args.skip:]:
            for provider in providers:
                rows = bench_point(point, provider, meta)
                writer.writerows(rows)
                f.flush()
                case, total, length, head_dim, heads, heads_kv = point
                summary = " ".join(f"{r['mode']} {r.get('tflops') or r['status']}" for r in rows)
                print(f"[{time.time() - start:5.0f}s] {case:9s} T={total:5d} L={length:4d} D={head_dim} "
                      f"H={heads}/{heads_kv} {provider:16s} {summary}", flush=True)


def bench_point(point, provider, meta) -> list[dict]:
    """The fwd and bwd rows of one provider at one point ([] where the provider has no such mask)."""
    case, total, length, head_dim, heads, heads_kv = point
    lengths = document_lengths(total, length) if case == "documents" else [total]
    window = length if case == "window" else -1
    row = dict(case=case, provider=provider, D=head_dim, H=heads, H_kv=heads_kv, T=total, L=length,
               docs=len(lengths), **meta)
    torch.manual_seed(0)
    try:
        if provider == "flashtrain_dense":  # dense causal at the document (window) length, the same tokens
            batch = total // length
            q, k, v = (torch.randn(batch, h, length, head_dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for h in (heads, heads_kv, heads_kv))
            times = time_directions(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v)
            flops = 2 * batch * length * (length + 1) * heads * head_dim
        else:
            fn = make_fn(provider, case, lengths, window, heads, heads_kv)
            if fn is None:
                return []
            q, k, v = (torch.randn(1, h, total, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for h in (heads, heads_kv, heads_kv))
            times = time_directions(fn, q, k, v)
            flops = 4 * kept_pairs(case, lengths, window) * heads * head_dim
        return [dict(row, mode=mode, ms=f"{ms:.4f}", tflops=f"{flops * (2.5 if mode == 'bwd' else 1) / ms / 1e9:.1f}",
                     status="ok") for mode, ms in times.items()]
    except Exception as exc:  # a provider that cannot run a point is a result
        torch.cuda.empty_cache()
        status = "OOM" if isinstance(exc, torch.OutOfMemoryError) else f"error: {type(exc).__name__}: {exc}"
        return [dict(row, mode=mode, status=status[:200]) for mode in ("fwd", "bwd")]


if __name__ == "__main__":
    main()
