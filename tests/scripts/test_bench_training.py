"""scripts/bench/training.py's reports (CPU): loss summaries over seeds, and the speed table."""

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "training.py"
spec = importlib.util.spec_from_file_location("bench_training", SCRIPT)
bench_training = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_training)


def loss_rows(finals: dict, steps: int = 30, seeds=True) -> list[dict]:
    """Rows of a --losses-out CSV whose last 20 steps have mean ``finals[(attn, seed)]``."""
    rows = []
    for (attn, seed), final in finals.items():
        for step in range(steps):
            row = dict(attn=attn, seq="4096", step=str(step), loss=str(final if step >= steps - 20 else 5.0),
                       gpu="GPU", date="2026-11-29")
            if seeds:
                row["seed"] = str(seed)
            rows.append(row)
    return rows


def test_loss_summary_over_seeds():
    finals = {("flash", 1): 0.6, ("flash", 2): 0.8, ("flash_fp8:full", 1): 0.72, ("flash_fp8:full", 2): 0.75}
    lines = bench_training.summarise_losses(bench_training.loss_curves(loss_rows(finals)))
    assert "flash seq 4096 seed 2: mean loss over the last 20 steps 0.8000" in lines
    assert "flash seq 4096: mean of 2 seeds 0.7000 (range 0.6000-0.8000), +0.0% against the first" in lines
    assert "flash_fp8:full seq 4096: mean of 2 seeds 0.7350 (range 0.7200-0.7500), +5.0% against the first" in lines
    # paired by seed: +20% (seed 1) and -6.25% (seed 2)
    assert lines[-1] == "flash_fp8:full seq 4096 against flash, same seed: +6.88% (range -6.25% to +20.00%, 2 seeds)"


def test_loss_summary_leaves_out_runs_that_turned_non_finite():
    finals = {("flash", 1): 0.6, ("flash", 2): 0.8, ("flash", 3): 0.7, ("flash_fp8:full", 1): 0.66,
              ("flash_fp8:full", 2): 0.76, ("flash_fp8:full", 3): 0.7}
    rows = loss_rows(finals)
    for row in rows:
        if row["attn"] == "flash_fp8:full" and row["seed"] == "2" and int(row["step"]) >= 25:
            row["loss"] = "nan"
    lines = bench_training.summarise_losses(bench_training.loss_curves(rows))
    assert "flash_fp8:full seq 4096 seed 2: non-finite loss from step 25 (left out below)" in lines
    assert "flash_fp8:full seq 4096: mean of 2 seeds 0.6800 (range 0.6600-0.7000), -2.9% against the first" in lines
    assert lines[-1] == "flash_fp8:full seq 4096 against flash, same seed: +5.00% (range +0.00% to +10.00%, 2 seeds)"


def test_loss_summary_of_files_without_seeds():
    rows = loss_rows({("flash", None): 0.675, ("flash_fp8:forward", None): 0.687}, seeds=False)
    rows = rows[:30][::-1] + rows[30:]  # steps out of order in the file come back sorted
    curves = bench_training.loss_curves(rows)
    assert [step for step, _ in curves["flash", "4096", ""]] == list(range(30))
    assert bench_training.summarise_losses(curves) == [
        "flash seq 4096: mean loss over the last 20 steps 0.6750",
        "flash_fp8:forward seq 4096: mean loss over the last 20 steps 0.6870"]


def test_report_table(tmp_path):
    path = tmp_path / "training.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench_training.FIELDS, restval="")
        writer.writeheader()
        common = dict(model="gpt2-small", params_m="85.2", tokens_per_step="32768", gpu="GPU", torch="2", triton="3",
                      date="2026-11-29")
        writer.writerow(dict(attn="eager", seq=4096, seed=1, status="OOM", **common))
        for seed, tokens in ((1, 1000), (2, 999)):  # several seeds: the table shows the first
            writer.writerow(dict(attn="flash", seq=4096, seed=seed, status="ok", tokens_per_s=tokens,
                                 peak_alloc_gib="13.04", **common))
        writer.writerow(dict(attn="flash", seq=4096, seed=1, status="ok", tokens_per_s=2000, peak_alloc_gib="9.5",
                             **{**common, "model": "gpt2-small-h128"}))
        writer.writerow(dict(attn="flash", seq=4096, seed=1, status="ok", tokens_per_s=900, peak_alloc_gib="14.0",
                             variant="bpe", **common))
    table = bench_training.report(str(path))
    assert "| model | seq | eager | flash |" in table
    assert "| gpt2-small | 4096 | OOM | 1,000 (13.0) |" in table  # several seeds: the first
    assert "| gpt2-small-h128 | 4096 |  | 2,000 (9.5) |" in table  # a row per model, in the order run
    assert "| gpt2-small bpe | 4096 |  | 900 (14.0) |" in table  # a variant is a row of its own
    assert "32768 tokens per step" in table
    with open(path, "a", newline="") as f:  # the MFU form: a cell with an MFU ends with it
        csv.DictWriter(f, fieldnames=bench_training.FIELDS, restval="").writerow(
            dict(attn="flash", seq=8192, seed=1, status="ok", tokens_per_s=500, peak_alloc_gib="20.0", mfu="0.412",
                 model="gpt2-small", params_m="85.2", tokens_per_step="32768", gpu="GPU", torch="2", triton="3",
                 date="2026-11-29"))
    assert "| gpt2-small | 8192 |  | 500 (20.0, 0.41) |" in bench_training.report(str(path), mfu=True)


def test_report_of_several_gpus_with_reserved(tmp_path):
    """Rows of two GPUs: the GPU in each row's label and both machines in the caption; --reserved shows the peak
    allocated / reserved, and a blank peak (not recorded) as '-'."""
    path = tmp_path / "long_context.csv"
    common = dict(attn="flash", seed=1, status="ok", model="gpt2-small", params_m="85.2", torch="2", triton="3",
                  date="2026-12-07")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench_training.FIELDS, restval="")
        writer.writeheader()
        writer.writerow(dict(seq=65536, tokens_per_step=65536, tokens_per_s=84516, peak_alloc_gib="6.71",
                             peak_reserved_gib="7.46", gpu="NVIDIA H200", **common))
        writer.writerow(dict(seq=262144, tokens_per_step=262144, tokens_per_s=24741, peak_alloc_gib="",
                             peak_reserved_gib="18.16", variant="offload", gpu="NVIDIA H100 80GB HBM3", **common))
    table = bench_training.report(str(path), reserved=True)
    assert "NVIDIA H200, torch 2, triton 3, 2026-12-07; NVIDIA H100 80GB HBM3, torch 2" in table
    assert "| gpt2-small, H200 | 65536 | 84,516 (6.7 / 7.5) |" in table
    assert "| gpt2-small offload, H100 | 262144 | 24,741 (- / 18.2) |" in table
    assert "| gpt2-small | 65536 | 84,516 (6.7) |" not in bench_training.report(str(path))  # the GPU stays in labels


def test_caption_of_one_sequence_a_step():
    rows = [dict(seq=s, tokens_per_step=s) for s in ("65536", "262144")]
    assert bench_training.per_step(rows) == "one sequence a step"
    assert bench_training.per_step([dict(seq="4096", tokens_per_step="32768")]) == "32768 tokens per step"


def test_variants_parse():
    assert bench_training.parse_variant("bpe=data.tokenizer=bpe,data.vocab_size=32768") == (
        "bpe", ["data.tokenizer=bpe", "data.vocab_size=32768"])
    assert bench_training.parse_variant("byte=") == ("byte", [])


@pytest.mark.parametrize("argv", [["--seeds", "1", "x"], ["--seeds"]])
def test_seeds_are_integers(argv):
    with pytest.raises(SystemExit):
        bench_training.main(["--report", "unused.csv", *argv])
