"""``swap_attention`` on an existing model: an ``nn.TransformerEncoder`` trained before and after the swap.

The model is PyTorch's own: ``nn.TransformerEncoderLayer`` (d_model 1024, 16 heads of 64, pre-norm,
batch_first), 4 layers, bf16 parameters, training mode. One training step (forward + backward of a sum
loss) is timed with ``triton.testing.do_bench`` (median) for each sequence length and mask:

  * ``causal``: a causal ``mask`` with ``is_causal=True`` (what a decoder-only stack passes);
  * ``causal+padding``: the same plus ``src_key_padding_mask`` with the last 1/8 of the keys padded
    (nn.MultiheadAttention then merges both into a (B, heads, L, S) float mask for SDPA; flashtrain adds the
    padding to the scores inside its kernels);
  * ``causal+dropout``: the causal mask with attention dropout 0.1 in the layers (in-kernel Philox after
    the swap).

"before" is the model as built (nn.MultiheadAttention -> SDPA, default backend); "after" is the same
module after ``swap_attention(model)``, weights untouched. Peak memory is what one training step
allocates beyond the parameters, gradients and inputs. Writes long-format CSV rows (provider, mode,
metric, x, value, gpu, torch, triton, commit, date). Needs a CUDA GPU.

    python scripts/bench/swap.py --out benchmarks/results/swap_h200.csv
    python scripts/bench/swap.py --report benchmarks/results/swap.csv --plot benchmarks/swap.png   # any machine
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

FIELDS = ["provider", "mode", "metric", "x", "value", *provenance.FIELDS]
MODES = ["causal", "causal+padding", "causal+dropout"]
PROVIDERS = {"before": "nn.MultiheadAttention (SDPA)", "after": "after swap_attention"}


def build_encoder(mode, d_model, heads, layers):
    import torch
    from torch import nn

    dropout = 0.1 if mode == "causal+dropout" else 0.0
    layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=dropout,
                                       batch_first=True, norm_first=True, device="cuda", dtype=torch.bfloat16)
    if dropout:  # dropout on the attention weights only: the residual/FFN dropouts would be the same work
        layer.dropout.p = layer.dropout1.p = layer.dropout2.p = 0.0
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).train()


def measure(model, mode, seq, args):
    """(ms per training step, peak GiB beyond what was allocated before the step), or None on OOM."""
    import torch
    import triton
    from torch import nn

    x = torch.randn(1, seq, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(seq, device="cuda", dtype=torch.bfloat16)
    padding = None
    if mode == "causal+padding":
        padding = torch.zeros(1, seq, dtype=torch.bool, device="cuda")
        padding[:, seq - seq // 8:] = True

    def step():
        out = model(x, mask=mask, is_causal=True, src_key_padding_mask=padding)
        out.float().sum().backward()

    try:
        step()  # compile / autotune / warm up
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=False)
        x.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = triton.testing.do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms)
        return ms, peak
    except torch.OutOfMemoryError:
        return None
    finally:
        del x, mask, padding
        gc.collect()
        torch.cuda.empty_cache()


def bench(args):
    import torch

    from flashtrain import swap_attention

    meta = provenance.provenance()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for mode in args.modes:
            for seq in args.seqs:
                for provider in ("before", "after"):
                    torch.manual_seed(0)
                    model = build_encoder(mode, args.d_model, args.heads, args.layers)
                    if provider == "after":
                        swap_attention(model)
                    result = measure(model, mode, seq, args)
                    del model
                    if result is None:
                        rows = [dict(metric=m, value="OOM") for m in ("ms", "tokens_per_s", "peak_gib")]
                    else:
                        ms, peak = result
                        rows = [dict(metric="ms", value=f"{ms:.3f}"),
                                dict(metric="tokens_per_s", value=f"{seq / ms * 1e3:.0f}"),
                                dict(metric="peak_gib", value=f"{peak:.3f}")]
                    for r in rows:
                        writer.writerow(dict(r, provider=provider, mode=mode, x=seq, **meta))
                    f.flush()
                    print(f"{mode:15s} seq={seq:6d} {provider:6s} "
                          + ("OOM" if result is None else f"{result[0]:8.2f} ms  {result[1]:7.2f} GiB"), flush=True)


def report(path, plot_path=None):
    """Markdown table (and a PNG) from a bench_swap CSV."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    get = {(r["provider"], r["mode"], int(r["x"]), r["metric"]): r["value"] for r in rows}
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    seqs = sorted({int(r["x"]) for r in rows})
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; "
             "nn.TransformerEncoder, 4 pre-norm layers, d_model 1024, 16 heads of 64, bf16, batch 1, one training "
             f"step (forward + backward), median; memory beyond parameters and inputs; raw rows: [`{path}`]({path}).",
             "Each cell: the step after the swap, ms (speed-up over before), and its memory, GiB (share saved).", "",
             "| mask | " + " | ".join(f"{seq // 1024}k" for seq in seqs) + " |", "|---|" + "---|" * len(seqs)]
    for mode in modes:
        cells = []
        for seq in seqs:
            b_ms, a_ms = get.get(("before", mode, seq, "ms")), get.get(("after", mode, seq, "ms"))
            b_gib, a_gib = get.get(("before", mode, seq, "peak_gib")), get.get(("after", mode, seq, "peak_gib"))
            if b_ms is None or a_ms is None or "OOM" in (b_ms, a_ms):
                cells.append(f"before {b_ms}, after {a_ms}" if b_ms and a_ms else "")
                continue
            cells.append(f"{float(a_ms):.1f} ({float(b_ms) / float(a_ms):.2f}x), {float(a_gib):.2f} "
                         f"({1 - float(a_gib) / float(b_gib):.0%})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    if plot_path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for metric, ax, title in (("ms", axes[0], "training step, ms"), ("peak_gib", axes[1], "step memory, GiB")):
            for mode in modes:
                for provider, style in (("before", "--"), ("after", "-")):
                    pts = [(s, get.get((provider, mode, s, metric))) for s in seqs]
                    pts = [(s, float(v)) for s, v in pts if v not in (None, "OOM")]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            label=f"{mode}, {PROVIDERS[provider]}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        fig.suptitle(f"nn.TransformerEncoder before and after swap_attention on {first['gpu']}")
        fig.tight_layout()
        fig.savefig(plot_path, dpi=90)
        text += f"\n\n![swap_attention benchmark]({plot_path})"
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/swap.csv")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--report", metavar="CSV", help="print the table of an existing CSV instead")
    parser.add_argument("--plot", help="with --report: write a PNG")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report, args.plot))
    else:
        bench(args)


if __name__ == "__main__":
    main()
