"""Tables and a plot from bench_attention.py CSVs (runs anywhere, no GPU needed).

    python scripts/bench/report.py benchmarks/results/attention_h200_2026-11-29.csv \
        --plot benchmarks/attention_h200.png --readme README.md

Several CSVs may be given, oldest first: for each measurement (provider, shape, mode) the last file that has
it wins, so a partial re-run (e.g. ``--main-grid-only``) updates the points it measured and keeps the rest;
the caption names every file and what it contributed.

Prints markdown tables; with --readme, replaces the text between the README's
``<!-- attention-benchmark:start -->`` and ``<!-- attention-benchmark:end -->`` markers. With --fp8, the table
is FP8 against flashtrain's bf16 path instead (between ``<!-- fp8-benchmark:start -->`` and ``...:end -->``):

    python scripts/bench/report.py benchmarks/results/attention_fp8_h200_2026-11-29.csv --fp8 --readme README.md

``--gpu-time CSV`` (with --fp8) adds each forward's GPU time, bf16 / FP8, from a CSV with the columns provider,
D, N, B, H, causal, fwd_gpu_us (``bench_attention.py --gpu-time-out``'s CUDA-graph replays, or the sum of a call's
kernels): where the FP8 op's host time exceeds it, do_bench times the host, and this column shows what the GPU did.
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the README writer
from readme import replace_section  # noqa: E402

SPEED_PROVIDERS = ["flashtrain", "flashtrain_fp8_fwd", "flashtrain_fp8", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
MEMORY_PROVIDERS = ["flashtrain", "sdpa", "eager"]
START, END = "<!-- attention-benchmark:start -->", "<!-- attention-benchmark:end -->"
FP8_START, FP8_END = "<!-- fp8-benchmark:start -->", "<!-- fp8-benchmark:end -->"


# --gpu-time CSVs' "method" column (none: torch.profiler's kernel times) -> how the caption names it
GPU_TIME_METHODS = {"profiler": "a call's kernels summed (torch.profiler)",
                    "cuda_graph": "one call of a CUDA graph of 10, median of 20 replays",
                    "cuda_graph_settled": ("one call of a CUDA graph of 10, median of 20 replays, each queued behind "
                                           "another, after 2 s of them")}
KEY = ["provider", "dtype", "D", "N", "B", "H", "H_kv", "causal", "mode"]


def load(paths):
    """Rows of all CSVs, the last file's row winning per KEY; column ``source`` names the file."""
    frames = []
    for path in paths:
        df = pd.read_csv(path)
        df["causal"] = df["causal"].astype(str) == "True"
        df["source"] = path
        frames.append(df)
    return pd.concat(frames).drop_duplicates(KEY, keep="last").reset_index(drop=True)


def provenance(df):
    """'file (what it holds), ...' for the caption."""
    parts = []
    for path, rows in df.groupby("source", sort=False):
        what = []
        if rows["mode"].isin(["fwd", "bwd"]).any():
            what.append("speed")
        if (rows["mode"] == "fwd+bwd").any():
            what.append("memory")
        dates = ", ".join(sorted(set(rows["date"])))
        parts.append(f"[`{path}`]({path}) ({' and '.join(what)}, {dates})")
    return "; ".join(parts)


def cell(series):
    """'fwd / bwd' TFLOP/s, or the status (OOM, error) when a provider did not run."""
    parts = []
    for mode in ("fwd", "bwd"):
        row = series[series["mode"] == mode]
        if row.empty:
            parts.append("")
        elif row["status"].iloc[0] == "ok":
            parts.append(f"{row['tflops'].iloc[0]:.0f}")
        else:
            parts.append(str(row["status"].iloc[0]).replace("error: ", ""))
    return " / ".join(parts) if any(parts) else ""


def speed_table(df, seqs=None):
    """TFLOP/s fwd / bwd per provider, a row per shape; ``seqs``: only these N (the README's subset of the grid)."""
    speed = df[df["mode"].isin(["fwd", "bwd"])]
    if seqs:
        speed = speed[speed["N"].isin(seqs)]
    providers = [p for p in SPEED_PROVIDERS if p in set(speed["provider"])]
    lines = ["| D | N | B x H (H_kv) | causal | " + " | ".join(providers) + " |",
             "|---|---|---|---|" + "---|" * len(providers)]
    keys = speed[["D", "N", "B", "H", "H_kv", "causal"]].drop_duplicates()
    for _, key in keys.sort_values(["H_kv", "D", "N", "causal"], ascending=[False, True, True, True]).iterrows():
        sel = speed[(speed[["D", "N", "B", "H", "H_kv", "causal"]] == key.values).all(axis=1)]
        heads = f"{key.H}" if key.H == key.H_kv else f"{key.H} ({key.H_kv})"
        cells = [cell(sel[sel["provider"] == p]) for p in providers]
        lines.append(f"| {key.D} | {key.N} | {key.B} x {heads} | {'yes' if key.causal else 'no'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(df):
    """The fwd+bwd peaks in one sentence: 'GiB at N = a / b: provider x / y; ...' (the plot has them too)."""
    mem = df[df["mode"] == "fwd+bwd"]
    seqs = sorted(mem["N"].unique())
    parts = []
    for p in MEMORY_PROVIDERS:
        cells = []
        for seq in seqs:
            row = mem[(mem["N"] == seq) & (mem["provider"] == p)]
            cells.append("-" if row.empty else (f"{row['peak_gib'].iloc[0]:.2f}" if row["status"].iloc[0] == "ok"
                                                else row["status"].iloc[0]))
        parts.append(f"{p} {' / '.join(cells)}")
    return f"GiB at N = {' / '.join(map(str, seqs))}: " + "; ".join(parts) + "."


def flex_note(df):
    """Where Flex was timed (it recompiles per shape, so a run may time it on some sequence lengths only)."""
    flex = df[(df["provider"] == "flex") & (df["mode"] == "fwd")]
    if flex.empty:
        return "Flex was not timed."
    seqs = ", ".join(f"{n // 1024}k" for n in sorted(flex["N"].unique()))
    return f"Flex (compiled once per shape) was timed at N = {seqs}, head_dim up to 128."


def fp8_table(df, gpu_time=None):
    """FP8 against flashtrain's bf16 path, same run: forward (fp8="forward"/"full" share it) and the backward
    of "full"; ratios to bf16 in parentheses. ``gpu_time``: a DataFrame of forward GPU times (``--gpu-time``), for
    a column "fwd GPU time, bf16 / FP8 (us)"."""
    speed = df[df["mode"].isin(["fwd", "bwd"]) & (df["status"] == "ok")]
    header = "| D | N | B x H (H_kv) | causal | bf16 fwd | FP8 fwd | bf16 bwd | FP8 bwd (\"full\") |"
    rule = "|---|---|---|---|---|---|---|---|"
    if gpu_time is not None:
        header, rule = header + " fwd GPU time, bf16 / FP8 (us) |", rule + "---|"
    lines = [header, rule]
    keys = speed[["D", "N", "B", "H", "H_kv", "causal"]].drop_duplicates()
    for _, key in keys.sort_values(["H_kv", "D", "N", "causal"], ascending=[False, True, True, True]).iterrows():
        sel = speed[(speed[["D", "N", "B", "H", "H_kv", "causal"]] == key.values).all(axis=1)]

        def tflops(provider, mode):
            row = sel[(sel["provider"] == provider) & (sel["mode"] == mode)]
            return None if row.empty else float(row["tflops"].iloc[0])

        fwd16, bwd16 = tflops("flashtrain", "fwd"), tflops("flashtrain", "bwd")
        fwd8, bwd8 = tflops("flashtrain_fp8_fwd", "fwd"), tflops("flashtrain_fp8", "bwd")
        if None in (fwd16, bwd16, fwd8, bwd8):
            continue
        heads = f"{key.H}" if key.H == key.H_kv else f"{key.H} ({key.H_kv})"
        line = (f"| {key.D} | {key.N} | {key.B} x {heads} | {'yes' if key.causal else 'no'} | {fwd16:.0f} | "
                f"{fwd8:.0f} ({fwd8 / fwd16:.2f}x) | {bwd16:.0f} | {bwd8:.0f} ({bwd8 / bwd16:.2f}x) |")
        if gpu_time is not None:
            line += f" {_gpu_times(gpu_time, key)} |"
        lines.append(line)
    return "\n".join(lines)


def _gpu_times(gpu_time, key) -> str:
    """'bf16 / FP8 (bf16 / FP8 x)' forward GPU times (us) of one table row's shape, or '-' where the CSV lacks one."""
    same = ((gpu_time["D"] == key.D) & (gpu_time["N"] == key.N) & (gpu_time["B"] == key.B)
            & (gpu_time["H"] == key.H) & (gpu_time["causal"] == key.causal))
    times = [gpu_time[same & (gpu_time["provider"] == provider)]["fwd_gpu_us"]
             for provider in ("flashtrain", "flashtrain_fp8_fwd")]
    if any(t.empty for t in times):
        return "-"
    bf16, fp8 = times[0].iloc[0], times[1].iloc[0]
    return f"{bf16:.0f} / {fp8:.0f} ({bf16 / fp8:.2f}x)"


def plot(df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = df[(df["mode"].isin(["fwd", "bwd"])) & (df["H"] * df["D"] == 2048) & (df["B"] * df["N"] == 16384)
              & (df["H"] == df["H_kv"]) & (df["status"] == "ok")]
    fig, axes = plt.subplots(2, 5, figsize=(24, 8.5))
    for col, (head_dim, causal) in enumerate([(64, False), (64, True), (128, False), (128, True)]):
        for r, mode in enumerate(("fwd", "bwd")):
            ax = axes[r, col]
            sel = main[(main["D"] == head_dim) & (main["causal"] == causal) & (main["mode"] == mode)]
            for provider in SPEED_PROVIDERS:
                p = sel[sel["provider"] == provider].sort_values("N")
                if not p.empty:
                    ax.plot(p["N"], p["tflops"], marker="o", label=provider, lw=2.5 if provider == "flashtrain" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, head_dim {head_dim}, {'causal' if causal else 'full'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    mem = df[(df["mode"] == "fwd+bwd") & (df["status"] == "ok")]
    ax = axes[0, 4]
    for provider in MEMORY_PROVIDERS:
        p = mem[mem["provider"] == provider].sort_values("N")
        ax.plot(p["N"], p["peak_gib"], marker="o", label=provider)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("extra memory, fwd+bwd\n(B=1, H=16, D=128, causal)")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axes[1, 4].axis("off")
    first = df.iloc[0]
    dates = sorted(set(pd.concat([main["date"], mem["date"]]).astype(str)))  # the files merged may span days
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    fig.suptitle(f"bf16 attention on {first.gpu}, torch {first.torch}, triton {first.triton}, {when} "
                 "(batch x seq = 16k tokens, heads x head_dim = 2048)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="bench_attention CSVs, oldest first")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--readme", help="refresh this README's benchmark section")
    parser.add_argument("--fp8", action="store_true", help="the FP8 table (flashtrain_fp8* against flashtrain)")
    parser.add_argument("--seqs", type=lambda s: [int(n) for n in s.split(",")],
                        help="only these sequence lengths in the speed table, e.g. 1024,4096,16384,32768")
    parser.add_argument("--gpu-time", help="with --fp8: a CSV of forward GPU times (provider, D, N, B, H, causal, "
                                           "fwd_gpu_us) for an extra column")
    args = parser.parse_args(argv)
    if args.gpu_time and not args.fp8:
        parser.error("--gpu-time goes with --fp8")
    df = load(args.csv)
    first = df.iloc[0]
    source = (f"{first.gpu}, torch {first.torch}, triton {first.triton}; raw rows: {provenance(df)}. TFLOP/s "
              "(forward FLOPs 4*B*H*N*N*D, half when causal; backward 2.5x), medians of `triton.testing.do_bench`.")
    if args.fp8:
        gpu_time = None
        if args.gpu_time:
            gpu_time = pd.read_csv(args.gpu_time)
            gpu_time["causal"] = gpu_time["causal"].astype(str) == "True"
            methods = set(gpu_time["method"]) if "method" in gpu_time else {"profiler"}
            if len(methods) != 1 or not methods <= GPU_TIME_METHODS.keys():
                raise SystemExit(f"{args.gpu_time}: one method expected, one of {sorted(GPU_TIME_METHODS)}; "
                                 f"got {sorted(methods)}")
            how = GPU_TIME_METHODS[methods.pop()]
            source += (f" Forward GPU time: {how}, from [`{args.gpu_time}`]({args.gpu_time}); where the FP8 op's host"
                       " time exceeds it, do_bench times the host.")
        text = (source + " FP8 with the Hadamard rotation and K smoothing (the defaults).\n\n"
                + fp8_table(df, gpu_time))
        print(text)
        if args.readme:
            replace_section(args.readme, FP8_START, FP8_END, text)
        return
    text = (source + " Forward / backward. " + flex_note(df) + " `RuntimeError`: SDPA's efficient backend needs "
            "as many KV heads as query heads (no GQA)."
            + (f" N = {', '.join(map(str, args.seqs))} of the grid; the CSV has every point." if args.seqs else "")
            + "\n\n" + speed_table(df, args.seqs)
            + "\n\nPeak memory of forward + backward beyond the inputs (B=1, H=16, D=128, causal, bf16), "
            + memory_table(df))
    print(text)
    if args.plot:
        plot(df, args.plot)
        text += f"\n\n![attention benchmark]({args.plot})"
    if args.readme:
        replace_section(args.readme, START, END, text)


if __name__ == "__main__":
    main()
