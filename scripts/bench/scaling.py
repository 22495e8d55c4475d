"""The trainer on several GPUs: data parallelism (DDP, FSDP) and context parallelism (ring attention).

Each row is one ``scripts/train.py`` run in a fresh process group (``trainer.devices=W``, a strategy,
``context_parallel=P``) for ``--steps`` steps with the CSV logger; the row takes the trainer's ThroughputLogger
figures from the steps after ``--warmup``: tokens/s (every rank's tokens, each once), TFLOP/s and MFU per GPU, and
rank 0's peak memory.

- Data parallel (``--dp-*``): a fixed number of tokens per rank and step (weak scaling), W = 1, 2, 4, 8 GPUs under
  each strategy. Efficiency: tokens/s per GPU over the same strategy's one-GPU row.
- Context parallel (``--cp-*``): one sequence split over P = W ranks (``context_parallel=P``, Lightning's
  ModelParallelStrategy), ring attention for each of ``--cp-attn``: flashtrain's (flash) and PyTorch's over SDPA's
  flash kernel (sdpa); P = 1 is the one-GPU kernel. Efficiency: tokens/s per GPU over the P = 1 row of the same
  attention, model and length (blank where that row ran out of memory).

    python scripts/bench/scaling.py --out benchmarks/results/scaling.csv          # a host with 8 GPUs
    python scripts/bench/scaling.py --report benchmarks/results/scaling.csv       # any machine
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIELDS = ["mode", "strategy", "devices", "context_parallel", "model", "seq", "attn", "tokens_per_step", "steps",
          "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_alloc_gib",
          "peak_reserved_gib", "efficiency", "status", "overrides", *provenance.FIELDS]


def plan(args) -> list[dict]:
    """The rows to run, in order: data parallel, then context parallel."""
    # tokens_per_step is per data-parallel replica: a context-parallel group trains one sequence a step
    rows = [dict(mode="dp", strategy=s, devices=w, context_parallel=1, model=args.dp_model, seq=args.dp_seq,
                 attn=args.attn, tokens_per_step=args.dp_tokens_per_rank)
            for s in args.dp_strategies for w in args.dp_devices]
    rows += [dict(mode="cp", strategy="model_parallel" if p > 1 else "auto", devices=p, context_parallel=p,
                  model=m, seq=n, attn=a, tokens_per_step=n)
             for m in args.cp_models for n in args.cp_seqs for a in args.cp_attn for p in args.cp_sizes]
    return rows


def command(row: dict, args, out_dir: Path) -> list[str]:
    """The scripts/train.py command line of a row."""
    return [sys.executable, str(REPO / "scripts" / "train.py"), f"attn={row['attn']}", f"model={row['model']}",
            f"seq_len={row['seq']}", f"tokens_per_step={row['tokens_per_step']}", f"trainer.devices={row['devices']}",
            f"trainer.strategy={row['strategy']}", f"context_parallel={row['context_parallel']}",
            f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000000",
            f"+callbacks.throughput.warmup_steps={args.warmup}", "callbacks.checkpoint=null", "logger=csv",
            "trainer.enable_progress_bar=false", f"output_dir={out_dir}", f"hydra.run.dir={out_dir}",
            *args.overrides]


def read_metrics(out_dir: Path, warmup: int) -> dict:
    """The ThroughputLogger's figures from a run's metrics.csv: medians over the steps after ``warmup``, the
    largest peak memory."""
    files = sorted(out_dir.glob("**/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {out_dir}")
    with open(files[-1]) as f:
        perf = [r for r in csv.DictReader(f) if r.get("perf/tokens_per_s") and int(r["step"]) >= warmup]
    if not perf:
        raise ValueError(f"{files[-1]}: no perf/tokens_per_s logged after step {warmup}")

    def median(key):
        values = [float(r[key]) for r in perf if r.get(key)]
        return statistics.median(values) if values else None

    def peak(key):
        values = [float(r[key]) for r in perf if r.get(key)]
        return max(values) if values else None

    return dict(step_time_s=median("perf/step_time_s"), tokens_per_s=median("perf/tokens_per_s"),
                tflops_per_gpu=median("perf/tflops"), mfu=median("perf/mfu"),
                peak_alloc_gib=peak("perf/peak_mem_allocated_gib"),
                peak_reserved_gib=peak("perf/peak_mem_reserved_gib"))


def status_of(returncode: int, stderr: str) -> str:
    """'ok', 'OOM' (a CUDA out-of-memory error in any rank), or 'error' (its stderr is printed)."""
    if returncode == 0:
        return "ok"
    return "OOM" if "OutOfMemoryError" in stderr or "CUDA out of memory" in stderr else "error"


def run_row(row: dict, args) -> dict:
    """Run one planned row in a fresh process group; the row with its status and, when ok, its figures."""
    row = dict(row, steps=args.steps, overrides=" ".join(args.overrides))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = subprocess.run(command(row, args, Path(tmp)), cwd=tmp, capture_output=True, text=True,
                                    timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return dict(row, status="timeout")
        row["status"] = status_of(result.returncode, result.stderr)
        if row["status"] == "ok":
            row.update(read_metrics(Path(tmp), args.warmup))
            row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / row["devices"]
        elif row["status"] == "error":
            print(result.stderr[-3000:], file=sys.stderr)
    return row


def _baseline_key(row: dict) -> tuple:
    """What a row's one-GPU baseline shares with it: the mode, the strategy (data parallel) or the attention
    (context parallel), the model and length."""
    return row["mode"], row["strategy"] if row["mode"] == "dp" else row["attn"], row["model"], int(row["seq"])


def add_efficiency(rows: list[dict]) -> None:
    """Each ok row's tokens/s per GPU over its one-GPU baseline's: the same strategy's W = 1 row (data parallel),
    the P = 1 row of the same attention, model and length (context parallel)."""
    base = {_baseline_key(r): r for r in rows if r["status"] == "ok" and int(r["devices"]) == 1}
    for r in rows:
        b = base.get(_baseline_key(r))
        if r["status"] == "ok" and b is not None:
            r["efficiency"] = float(r["tokens_per_s_per_gpu"]) / float(b["tokens_per_s_per_gpu"])


def fmt(row: dict) -> dict:
    """The row as the CSV writes it (figures rounded)."""
    digits = dict(step_time_s=4, tokens_per_s=0, tokens_per_s_per_gpu=0, tflops_per_gpu=1, mfu=3, peak_alloc_gib=2,
                  peak_reserved_gib=2, efficiency=3)
    return {k: (f"{v:.{digits[k]}f}" if k in digits and isinstance(v, float) else v) for k, v in row.items()}


def bench(args) -> None:
    meta = provenance.provenance()
    rows = []
    for row in plan(args):
        rows.append(run_row(row, args))
        r = rows[-1]
        print(f"{r['mode']} {r['strategy']:14s} W={r['devices']} P={r['context_parallel']} {r['model']} "
              f"seq={r['seq']} {r['status']} tok/s={r.get('tokens_per_s')}", flush=True)
    add_efficiency(rows)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(fmt(dict(r, **meta)) for r in rows)


def report(path: str) -> str:
    """Markdown tables: data parallel (a row per strategy, a column per W), context parallel (a row per attention,
    model and length, a column per P); each cell tokens/s per GPU (efficiency, peak GiB)."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return f"{path}: no rows"
    first = rows[0]
    lines = [f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, {first['date']}; "
             "tokens/s per GPU (scaling efficiency, peak GiB allocated on rank 0); raw rows: "
             f"[`{path}`]({path})."]

    def cell(r):
        if r["status"] != "ok":
            return r["status"]
        eff = f"{float(r['efficiency']):.2f}, " if r.get("efficiency") else ""
        mem = f"{float(r['peak_alloc_gib']):.1f}" if r.get("peak_alloc_gib") else "-"
        return f"{float(r['tokens_per_s_per_gpu']):,.0f} ({eff}{mem})"

    for mode, key, label in (("dp", "devices", "GPUs"), ("cp", "context_parallel", "P")):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        sizes = sorted({int(r[key]) for r in mine})
        head = "strategy | model | seq" if mode == "dp" else "attn | model | seq"
        lines += ["", f"| {head} | " + " | ".join(f"{label} = {s}" for s in sizes) + " |",
                  "|" + "---|" * (head.count("|") + 1 + len(sizes))]
        for group in dict.fromkeys(map(_baseline_key, mine)):  # a table row per baseline: the sizes beside it
            cells = []
            for s in sizes:
                r = next((r for r in mine if _baseline_key(r) == group and int(r[key]) == s), None)
                cells.append("" if r is None else cell(r))
            _, strategy_or_attn, model, seq = group
            name = f"{strategy_or_attn} | {model} | {seq}"
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/scaling.csv")
    parser.add_argument("--report", metavar="CSV", help="print the markdown tables of a CSV and exit")
    parser.add_argument("--attn", default="flash", help="the data-parallel rows' attention")
    parser.add_argument("--dp-model", default="gpt2-medium")
    parser.add_argument("--dp-seq", type=int, default=16384)
    parser.add_argument("--dp-tokens-per-rank", type=int, default=16384, help="tokens per rank and step")
    parser.add_argument("--dp-devices", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--dp-strategies", nargs="*", default=["ddp", "fsdp"])
    parser.add_argument("--cp-models", nargs="*", default=["gpt2-small", "gpt2-medium"])
    parser.add_argument("--cp-seqs", nargs="*", type=int, default=[262144, 1048576])
    parser.add_argument("--cp-sizes", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--cp-attn", nargs="*", default=["flash", "sdpa"],
                        help="context-parallel rows for each: flash (flashtrain's ring), sdpa (PyTorch's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a row may take")
    parser.add_argument("--overrides", nargs="*", default=["data.builtin=python_stdlib",
                                                           "model.activation_checkpointing=selective",
                                                           "model.activation_offload=true"],
                        help="more Hydra overrides for every row (recorded in the CSV); the default offload lets the "
                             "one-GPU row at 1M fit an 80 GB GPU")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}: no step would be timed")
    return args


def main(argv=None):
    args = arguments(argv)
    if args.report:
        print(report(args.report))
    else:
        bench(args)


if __name__ == "__main__":
    main()
