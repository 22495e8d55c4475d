"""scripts/bench/scaling.py (CPU): the rows it plans, the metrics it reads, the efficiencies and tables, and one
context-parallel row of two gloo processes run end to end through the interpreter."""

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "scaling.py"
spec = importlib.util.spec_from_file_location("bench_scaling", SCRIPT)
bench_scaling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_scaling)


def args_for(*argv):
    return bench_scaling.arguments(["--dp-devices", "1", "2", "--cp-models", "gpt2-small", "--cp-seqs", "262144",
                                    "--cp-sizes", "1", "4", *argv])


def test_plan_and_command(tmp_path):
    rows = bench_scaling.plan(args_for())
    assert [(r["mode"], r["strategy"], r["devices"], r["context_parallel"], r["attn"]) for r in rows] == [
        ("dp", "ddp", 1, 1, "flash"), ("dp", "ddp", 2, 1, "flash"), ("dp", "fsdp", 1, 1, "flash"),
        ("dp", "fsdp", 2, 1, "flash"), ("cp", "auto", 1, 1, "flash"), ("cp", "model_parallel", 4, 4, "flash"),
        ("cp", "auto", 1, 1, "sdpa"), ("cp", "model_parallel", 4, 4, "sdpa")]
    assert rows[1]["tokens_per_step"] == 16384 and rows[-1]["tokens_per_step"] == 262144  # one sequence a group
    cmd = bench_scaling.command(rows[-1], args_for(), tmp_path)
    for option in ("attn=sdpa", "model=gpt2-small", "seq_len=262144", "tokens_per_step=262144", "trainer.devices=4",
                   "trainer.strategy=model_parallel", "context_parallel=4", "+callbacks.throughput.warmup_steps=2"):
        assert option in cmd


def test_metrics_efficiency_and_report(tmp_path):
    logs = tmp_path / "csv" / "version_0"
    logs.mkdir(parents=True)
    with open(logs / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "perf/tokens_per_s", "perf/step_time_s", "perf/tflops",
                                               "perf/mfu", "perf/peak_mem_allocated_gib", "train/loss"])
        writer.writeheader()
        writer.writerow({"step": 0, "train/loss": 5.0})
        for step, tokens, peak in ((1, 900.0, ""), (2, 1000.0, "3.0"), (3, 1200.0, "3.5"), (4, 1100.0, "3.2")):
            writer.writerow({"step": step, "perf/tokens_per_s": tokens, "perf/step_time_s": 1.0, "perf/tflops": 10.0,
                             "perf/mfu": 0.4, "perf/peak_mem_allocated_gib": peak})
    metrics = bench_scaling.read_metrics(tmp_path, warmup=2)
    assert metrics["tokens_per_s"] == 1100.0 and metrics["peak_alloc_gib"] == 3.5  # steps 2-4: median, max
    with pytest.raises(ValueError, match="no perf/tokens_per_s logged after step 9"):
        bench_scaling.read_metrics(tmp_path, warmup=9)

    rows = [dict(mode="dp", strategy="ddp", devices=1, context_parallel=1, model="m", seq=16, status="ok",
                 tokens_per_s_per_gpu=1000.0, peak_alloc_gib=3.0),
            dict(mode="dp", strategy="ddp", devices=8, context_parallel=1, model="m", seq=16, status="ok",
                 tokens_per_s_per_gpu=920.0, peak_alloc_gib=3.0),
            dict(mode="cp", strategy="auto", devices=1, context_parallel=1, model="m", seq=64, status="OOM"),
            dict(mode="cp", strategy="model_parallel", devices=2, context_parallel=2, model="m", seq=64,
                 status="ok", tokens_per_s_per_gpu=500.0, peak_alloc_gib=40.0),
            dict(mode="cp", strategy="auto", devices=1, context_parallel=1, model="m", seq=64, attn="sdpa",
                 status="ok", tokens_per_s_per_gpu=400.0, peak_alloc_gib=60.0),
            dict(mode="cp", strategy="model_parallel", devices=2, context_parallel=2, model="m", seq=64,
                 attn="sdpa", status="ok", tokens_per_s_per_gpu=300.0, peak_alloc_gib=40.0)]
    for r in rows:
        r.setdefault("attn", "flash")
    bench_scaling.add_efficiency(rows)
    assert rows[1]["efficiency"] == pytest.approx(0.92)
    assert "efficiency" not in rows[3]  # its one-GPU row ran out of memory
    assert rows[5]["efficiency"] == pytest.approx(0.75)  # against PyTorch's own one-GPU row
    path = tmp_path / "scaling.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench_scaling.FIELDS, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(bench_scaling.fmt(dict(r, gpu="GPU", torch="2", triton="3", date="d")) for r in rows)
    table = bench_scaling.report(str(path))
    assert "| ddp | m | 16 | 1,000 (1.00, 3.0) | 920 (0.92, 3.0) |" in table
    assert "| flash | m | 64 | OOM | 500 (40.0) |" in table
    assert "| sdpa | m | 64 | 400 (1.00, 60.0) | 300 (0.75, 40.0) |" in table


def test_warmup_below_steps():
    with pytest.raises(SystemExit):
        args_for("--steps", "2", "--warmup", "2")


def test_status_of_a_failed_row():
    assert bench_scaling.status_of(0, "") == "ok"
    assert bench_scaling.status_of(1, "torch.OutOfMemoryError: CUDA out of memory.") == "OOM"
    assert bench_scaling.status_of(1, "ValueError: seq_len") == "error"


@pytest.mark.interpreter
def test_a_context_parallel_row_end_to_end(tmp_path):
    """Two gloo processes split one sequence, with flashtrain's ring (through the interpreter) and with PyTorch's:
    each row is ok and counts the sequence's tokens once (three timed steps: the medians of tokens/s and of the step
    time come from the same step, so their product is the step's tokens)."""
    out = tmp_path / "scaling.csv"
    bench_scaling.main(["--out", str(out), "--dp-devices", "--cp-models", "tiny", "--cp-seqs", "64", "--cp-sizes",
                        "2", "--cp-attn", "flash", "sdpa", "--steps", "4", "--warmup", "1", "--overrides"])
    rows = list(csv.DictReader(open(out)))
    assert [(r["mode"], r["attn"], r["devices"], r["context_parallel"], r["status"]) for r in rows] == [
        ("cp", "flash", "2", "2", "ok"), ("cp", "sdpa", "2", "2", "ok")]
    for row in rows:
        assert float(row["tokens_per_s"]) * float(row["step_time_s"]) == pytest.approx(64, rel=0.02)
