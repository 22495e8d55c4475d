"""Long-context training savings: the same GPT and tokens per step, trained with each attention backend.

For each attn in (eager, sdpa, flash) and seq in 2k..32k: build the trainer from conf/train.yaml
(gpt2-small, bf16-mixed, 32k tokens per step), train --steps steps, and record the median step time after
--warmup steps, tokens/s, model TFLOP/s, MFU and the peak memory allocated / reserved. An out-of-memory
run is recorded as OOM. Needs a CUDA GPU; writes a CSV.

    python scripts/bench/training.py --out benchmarks/results/training_h200.csv
    python scripts/bench/training.py --report benchmarks/results/training_h200.csv --plot PNG   # any machine

An attn of the form NAME:FP8 sets the FP8 mode too (``flash_fp8:full`` is ``attn=flash_fp8 attn.fp8=full``).
With --tuning-out, the tiles the kernels were autotuned to (per launch key) are written too. With --losses-out,
every step's training loss is written as well (attn, seq, seed, step, loss), for loss curves. --seeds repeats
each run under other seeds (``seed=`` of conf/train.yaml: initial weights and data order): a single curve's final
loss moves by a few percent between runs, so compare attention choices over several seeds:

    python scripts/bench/training.py --attn flash flash_fp8:forward flash_fp8:full --seqs 4096 --steps 300 \
        --seeds 1234 1 2 --out benchmarks/results/fp8_training_h200.csv \
        --losses-out benchmarks/results/fp8_losses_h200.csv
    python scripts/bench/training.py --plot-losses benchmarks/results/fp8_losses_h200.csv --plot PNG

--overrides passes further Hydra overrides to every run (recorded in the CSV), e.g. ``data.builtin=python_stdlib``:
the built-in corpus of ~466 KB is read ~21 times in 300 steps of 32k tokens, so a loss there measures memorising;
no window of the standard library's sources (10-30 MB) is read twice in that time. With several seeds, the loss
summary also compares each run with the first attention's run of the same seed (same initial weights and batches).
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

FIELDS = ["attn", "seq", "seed", "model", "variant", "params_m", "batch", "tokens_per_step", "steps", "first_step_s",
          "step_time_s", "tokens_per_s", "tflops", "mfu", "peak_alloc_gib", "peak_reserved_gib", "status", "overrides",
          *provenance.FIELDS]


def run_one(attn, seq, seed, args, tmp, model="gpt2-small", variant=("", [])):
    import lightning as L
    import torch
    from hydra import compose, initialize_config_dir

    from flashtrain.trainer.callbacks import peak_tflops_for
    from flashtrain.trainer.train import build

    class StepTimer(L.Callback):
        """Each step's time and loss; the peak memory of the steps after warm-up, read at each step's end before
        any other callback (the trainer's ThroughputLogger resets the peaks after its own warm-up)."""

        def __init__(self):
            self.times, self.losses, self.t = [], [], None
            self.peak_alloc = self.peak_reserved = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.synchronize()
            if trainer.global_step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)
            self.losses.append(float(outputs["loss"]))
            if len(self.times) > args.warmup:
                self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated())
                self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())

    name, _, fp8 = attn.partition(":")
    variant_name, variant_overrides = variant
    tokens_per_step = max(args.tokens_per_step, seq)  # at least one sequence a step
    overrides = [f"attn={name}", *([f"attn.fp8={fp8}"] if fp8 else []), f"seq_len={seq}", f"model={model}",
                 f"tokens_per_step={tokens_per_step}",
                 f"trainer.max_steps={args.steps}", "trainer.enable_progress_bar=false", "~logger",
                 "callbacks.checkpoint=null", "trainer.val_check_interval=1000000", f"output_dir={tmp}",
                 "+trainer.enable_model_summary=false", "+trainer.enable_checkpointing=false",
                 *([f"seed={seed}"] if seed is not None else []), *args.overrides, *variant_overrides]
    import flashtrain.conf  # the installed configs: the ones scripts/train.py composes

    with initialize_config_dir(str(Path(flashtrain.conf.__file__).parent), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    datamodule, module, trainer = build(cfg)
    timer = StepTimer()
    trainer.callbacks.insert(0, timer)  # first: it reads the peaks before another callback resets them
    row = dict(attn=attn, seq=seq, seed=cfg.seed, model=model, variant=variant_name,
               params_m=f"{module.model.num_params() / 1e6:.1f}", batch=cfg.data.batch_size,
               tokens_per_step=cfg.data.batch_size * cfg.data.seq_len, steps=args.steps,
               overrides=" ".join([*args.overrides, *variant_overrides]))
    try:
        trainer.fit(module, datamodule=datamodule)
        step = statistics.median(timer.times[args.warmup:])
        tokens_per_s = row["tokens_per_step"] / step
        tflops = tokens_per_s * module.flops_per_token() / 1e12
        peak = peak_tflops_for(torch.device("cuda"), None)
        row.update(first_step_s=f"{timer.times[0]:.2f}", step_time_s=f"{step:.4f}", tokens_per_s=f"{tokens_per_s:.0f}",
                   tflops=f"{tflops:.1f}",
                   mfu=f"{tflops / peak:.3f}" if peak else "",
                   peak_alloc_gib=f"{timer.peak_alloc / 2**30:.2f}",
                   peak_reserved_gib=f"{timer.peak_reserved / 2**30:.2f}", status="ok")
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    row["losses"] = timer.losses
    del trainer, module, datamodule
    gc.collect()
    torch.cuda.empty_cache()
    return row


def bench(args):
    import os

    os.environ.setdefault("WANDB_MODE", "disabled")

    from flashtrain.trainer.config import register_resolvers

    register_resolvers()
    meta = provenance.provenance()
    losses_file = open(args.losses_out, "w", newline="") if args.losses_out else None
    if losses_file:
        csv.writer(losses_file).writerow(["attn", "seq", "seed", "step", "loss", *provenance.FIELDS])
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, restval="", extrasaction="ignore")
        writer.writeheader()
        for model in args.models:
            for variant in args.variants:
                for seq in args.seqs:
                    for seed in args.seeds or [None]:
                        for attn in args.attn:
                            run_row(attn, seq, seed, args, meta, writer, f, losses_file, model, variant)
    if args.tuning_out:
        from flashtrain.kernels import tuning

        tuning.write_tuning_picks(args.tuning_out)


def run_row(attn, seq, seed, args, meta, writer, f, losses_file, model="gpt2-small", variant=("", [])):
    """One run: its CSV row, its losses (if asked), a line on stdout."""
    row = dict(run_one(attn, seq, seed, args, Path(args.tmp) / f"{attn}-{seq}", model, variant), **meta)
    writer.writerow(row)
    f.flush()
    if losses_file:
        label = f"{attn}@{variant[0]}" if variant[0] else attn  # one curve per (attn, variant)
        csv.writer(losses_file).writerows([label, seq, row["seed"], step, f"{loss:.5f}",
                                           *(meta[k] for k in provenance.FIELDS)]
                                          for step, loss in enumerate(row["losses"]))
        losses_file.flush()
    print(f"{attn:6s} seq={seq:6d} seed={row['seed']} {row['status']:4s} tok/s={row.get('tokens_per_s', '')} "
          f"step={row.get('step_time_s', '')}s peak={row.get('peak_alloc_gib', '')} GiB", flush=True)


def per_step(rows: list[dict]) -> str:
    """The caption's tokens per step: one figure, or one sequence a step where each run's step is its sequence."""
    if all(r["tokens_per_step"] == r["seq"] for r in rows):
        return "one sequence a step"
    steps = sorted({int(r["tokens_per_step"]) for r in rows})
    return f"{steps[0]} tokens per step" if len(steps) == 1 else f"{steps[0]}-{steps[-1]} tokens per step"


def short_gpu(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100': the row label's GPU where one file holds several."""
    return name.removeprefix("NVIDIA ").split()[0] if name else ""


def caption_machines(rows: list[dict]) -> str:
    """'GPU, torch T, triton V, date' for each (GPU, torch, triton, date) in the rows, in the order run."""
    machines = dict.fromkeys((r["gpu"], r["torch"], r["triton"], r["date"]) for r in rows)
    return "; ".join(f"{g}, torch {t}, triton {v}, {d}" for g, t, v, d in machines)


def report(path, plot_path=None, mfu=False, reserved=False, overlay=False):
    """A markdown table (tokens/s and peak GiB per attention, with ``mfu`` the MFU too, with ``reserved`` the peak
    allocated / reserved; a row per model and sequence length, with the GPU where the file holds several) and a PNG
    (a row of panels per model, or with ``overlay`` one row) from a bench/training.py CSV. A blank peak shows as
    '-'."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    several_gpus = len({r["gpu"] for r in rows}) > 1
    for r in rows:  # a variant (vocabulary, masks) is a model of its own in the table and the plot, so is a GPU
        r["model"] = f"{r.get('model', '')} {r['variant']}".strip() if r.get("variant") else r.get("model", "")
        if several_gpus:
            r["model"] += f", {short_gpu(r['gpu'])}"
    models = list(dict.fromkeys(r.get("model", "") for r in rows))
    attns = list(dict.fromkeys(r["attn"] for r in rows))  # in the order they were run
    get: dict = {}
    for r in rows:  # with several seeds, the first seed's run (tokens/s and memory do not depend on it)
        get.setdefault((r.get("model", ""), r["attn"], int(r["seq"])), r)
    gib = lambda value: f"{float(value):.1f}" if value else "-"  # noqa: E731
    memory = "peak GiB allocated / reserved" if reserved else "peak GiB"
    lines = [f"{caption_machines(rows)}; bf16-mixed, {per_step(rows)}, median step after warm-up; tokens/s "
             f"({memory}{', MFU' if mfu else ''}); raw rows: [`{path}`]({path}).", "",
             "| model | seq | " + " | ".join(attns) + " |", "|---|---|" + "---|" * len(attns)]
    for model in models:
        for seq in sorted({int(r["seq"]) for r in rows if r.get("model", "") == model}):
            cells = []
            for a in attns:
                r = get.get((model, a, seq))
                if r is None:
                    cells.append("")
                elif r["status"] != "ok":
                    cells.append(r["status"])
                else:
                    peak = gib(r["peak_alloc_gib"]) + (f" / {gib(r['peak_reserved_gib'])}" if reserved else "")
                    extra = f", {float(r['mfu']):.2f}" if mfu and r.get("mfu") else ""
                    cells.append(f"{int(r['tokens_per_s']):,} ({peak}{extra})")
            lines.append(f"| {model} | {seq} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    if plot_path:
        _plot(rows, models, plot_path, "peak_reserved_gib" if reserved else "peak_alloc_gib", overlay)
        text += f"\n\n![training benchmark]({plot_path})"
    return text


def _plot(rows: list[dict], models: list[str], plot_path: str, memory: str = "peak_alloc_gib",
          overlay: bool = False) -> None:
    """Throughput and peak memory (the ``memory`` column) against sequence length: a row of two panels per model,
    or with ``overlay`` one row with a line per (model, attention)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = [[m] for m in models] if not overlay else [models]
    attns = list(dict.fromkeys(r["attn"] for r in rows))  # overlaid: a colour per attention, a line style per model
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.5 * len(groups) + 0.5), squeeze=False)
    for (ax_t, ax_m), group in zip(axes, groups):
        for i, model in enumerate(group):
            mine = [r for r in rows if r.get("model", "") == model]
            for a in dict.fromkeys(r["attn"] for r in mine):
                ok = sorted((r for r in mine if r["attn"] == a and r["status"] == "ok"), key=lambda r: int(r["seq"]))
                style = dict(label=a, marker="o")
                if overlay:
                    style = dict(label=f"{model}: {a}", color=f"C{attns.index(a)}", ls=("-", "--", ":", "-.")[i % 4],
                                 marker="osD^v"[i % 5])
                ax_t.plot([int(r["seq"]) for r in ok], [float(r["tokens_per_s"]) for r in ok], **style)
                mem = [(int(r["seq"]), float(r[memory])) for r in ok if r[memory]]
                ax_m.plot([x for x, _ in mem], [m for _, m in mem], **style)
        kind = "reserved" if memory == "peak_reserved_gib" else "allocated"
        name = "" if overlay else f"{group[0]}: "
        for ax, title in ((ax_t, "training throughput, tokens/s"), (ax_m, f"peak memory {kind}, GiB")):
            ax.set_xscale("log", base=2)
            if overlay:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("sequence length")
            ax.set_title(f"{name}{title}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    gpus = ", ".join(dict.fromkeys(r["gpu"] for r in rows))
    fig.suptitle(f"training on {gpus} ({per_step(rows)}; missing points: out of memory or not run)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(plot_path, dpi=90)


def loss_curves(rows: list[dict]) -> dict:
    """{(attn, seq, seed): [(step, loss), ...] sorted by step} from the rows of a --losses-out CSV (files written
    before --seeds have no seed column: seed '' and one run per (attn, seq))."""
    curves: dict = {}
    for r in rows:
        curves.setdefault((r["attn"], r["seq"], r.get("seed", "")), []).append((int(r["step"]), float(r["loss"])))
    return {key: sorted(points) for key, points in curves.items()}


def summarise_losses(curves: dict, tail: int = 20) -> list[str]:
    """One line per run: its mean loss over the last ``tail`` steps; and per (attn, seq) run under several seeds,
    the mean of those over the seeds, their range, and the change against the first (attn, seq)'s mean; then,
    paired, each run against the run of the first attn at its seq with the same seed (same initial weights and
    batches): the mean and range over the seeds of the relative change. A run whose loss turned non-finite is
    reported with the step where it did, and left out of the means."""
    finals: dict = {}  # (attn, seq) -> {seed: mean loss of the run's last steps}
    lines = []
    for (attn, seq, seed), points in curves.items():
        run = f"{attn} seq {seq}{f' seed {seed}' if seed else ''}"
        bad = next((step for step, loss in points if not math.isfinite(loss)), None)
        if bad is not None:
            lines.append(f"{run}: non-finite loss from step {bad} (left out below)")
            continue
        last = [loss for _, loss in points[-tail:]]
        final = finals.setdefault((attn, seq), {})[seed] = sum(last) / len(last)
        lines.append(f"{run}: mean loss over the last {len(last)} steps {final:.4f}")
    if not finals:
        return lines
    baseline = statistics.mean(next(iter(finals.values())).values())
    for (attn, seq), runs in finals.items():
        if len(runs) > 1:
            values = list(runs.values())
            mean = statistics.mean(values)
            lines.append(f"{attn} seq {seq}: mean of {len(values)} seeds {mean:.4f} (range {min(values):.4f}-"
                         f"{max(values):.4f}), {mean / baseline - 1:+.1%} against the first")
    first_attn: dict = {}
    for attn, seq in finals:
        first_attn.setdefault(seq, attn)
    for (attn, seq), runs in finals.items():
        first = finals[first_attn[seq], seq]
        changes = [final / first[seed] - 1 for seed, final in runs.items() if seed in first]
        if attn != first_attn[seq] and len(changes) > 1:
            lines.append(f"{attn} seq {seq} against {first_attn[seq]}, same seed: {statistics.mean(changes):+.2%} "
                         f"(range {min(changes):+.2%} to {max(changes):+.2%}, {len(changes)} seeds)")
    return lines


def plot_losses(path, plot_path):
    """Training loss against step from a --losses-out CSV, one colour per (attn, seq) (one line per seed);
    returns ``summarise_losses``' lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = list(csv.DictReader(f))
    curves = loss_curves(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours: dict = {}
    for (attn, seq, _), points in curves.items():
        first = (attn, seq) not in colours  # one legend entry per (attn, seq)
        colour = colours.setdefault((attn, seq), f"C{len(colours)}")
        ax.plot([p[0] for p in points], [p[1] for p in points], color=colour, lw=1.0,
                label=f"{attn}, seq {seq}" if first else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    runs = len(curves) // len(colours)
    seeds = f" ({runs} seeds per colour)" if runs > 1 else ""
    dates = sorted({r["date"] for r in rows})  # a CSV may join runs of several days
    fig.suptitle(f"training loss, {rows[0]['gpu']}, {' and '.join(dates)}{seeds}")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=90)
    return "\n".join(summarise_losses(curves))


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'bpe=data.tokenizer=bpe,data.vocab_size=32768' -> ('bpe', ['data.tokenizer=bpe', 'data.vocab_size=32768'])."""
    name, _, overrides = text.partition("=")
    return name, [o for o in overrides.split(",") if o]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/training.csv")
    parser.add_argument("--attn", nargs="+", default=["eager", "sdpa", "flash"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--models", "--model", nargs="+", default=["gpt2-small"])
    parser.add_argument("--variants", nargs="+", type=parse_variant, default=[("", [])],
                        help="named override sets, each run for every point: NAME=KEY=VALUE,KEY=VALUE (NAME= for "
                             "none), e.g. byte= bpe=data.tokenizer=bpe,data.vocab_size=32768")
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seeds", nargs="+", type=int,
                        help="run each (attn, seq) once per seed (default: the config's)")
    parser.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for every run, e.g. "
                        "data.builtin=python_stdlib")
    parser.add_argument("--tmp", default="/tmp/flashtrain-bench")
    parser.add_argument("--report", metavar="CSV", help="print the table of an existing CSV instead")
    parser.add_argument("--plot", help="with --report or --plot-losses: write a PNG")
    parser.add_argument("--mfu", action="store_true", help="with --report: each cell's MFU too")
    parser.add_argument("--reserved", action="store_true",
                        help="with --report: the peak reserved beside the allocated (and plotted instead)")
    parser.add_argument("--overlay", action="store_true",
                        help="with --report --plot: every model in one pair of panels")
    parser.add_argument("--losses-out", help="also write every step's training loss here")
    parser.add_argument("--tuning-out", help="also write the kernels' autotuned configs (what the runs used)")
    parser.add_argument("--plot-losses", metavar="CSV", help="plot a --losses-out CSV to --plot instead")
    args = parser.parse_args(argv)
    if args.plot_losses:
        print(plot_losses(args.plot_losses, args.plot or "losses.png"))
    elif args.report:
        print(report(args.report, args.plot, args.mfu, args.reserved, args.overlay))
    else:
        bench(args)


if __name__ == "__main__":
    main()
