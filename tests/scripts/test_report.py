"""scripts/bench/report.py's FP8 table (CPU): ratios to bf16, and the forward GPU-time column."""

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "report.py"
spec = importlib.util.spec_from_file_location("report_attention", SCRIPT)
report_attention = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report_attention)

META = dict(dtype="bf16", peak_gib="", status="ok", gpu="GPU", torch="2", triton="3", date="2026-11-30")


def write_csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def speed_rows():
    """bf16 and FP8 rows of one shape: forward 500 / 600 TFLOP/s, backward 400 / 300."""
    shape = dict(D=128, N=4096, B=4, H=16, H_kv=16, causal=True)
    tflops = {("flashtrain", "fwd"): 500, ("flashtrain", "bwd"): 400, ("flashtrain_fp8_fwd", "fwd"): 600,
              ("flashtrain_fp8_fwd", "bwd"): 350, ("flashtrain_fp8", "fwd"): 590, ("flashtrain_fp8", "bwd"): 300}
    return [dict(provider=p, **shape, mode=m, ms=1.0, tflops=t, **META) for (p, m), t in tflops.items()]


def test_fp8_table_with_gpu_time(tmp_path, capsys):
    speed = write_csv(tmp_path / "speed.csv", speed_rows())
    gpu = write_csv(tmp_path / "gpu.csv", [
        dict(provider=p, D=128, N=4096, B=4, H=16, causal=True, fwd_gpu_us=us, fwd_host_us=900.0, gpu="GPU")
        for p, us in (("flashtrain", 511.4), ("flashtrain_fp8_fwd", 584.2))])
    report_attention.main([speed, "--fp8", "--gpu-time", gpu])
    out = capsys.readouterr().out
    assert "| fwd GPU time, bf16 / FP8 (us) |" in out
    assert "| 128 | 4096 | 4 x 16 | yes | 500 | 600 (1.20x) | 400 | 300 (0.75x) | 511 / 584 (0.88x) |" in out
    assert "torch.profiler" in out


def test_fp8_table_with_cuda_graph_times(tmp_path, capsys):
    """bench_attention.py --gpu-time-out's rows (method cuda_graph) are named as CUDA-graph replays."""
    speed = write_csv(tmp_path / "speed.csv", speed_rows())
    gpu = write_csv(tmp_path / "gpu.csv", [
        dict(provider=p, D=128, N=4096, B=4, H=16, H_kv=16, causal=True, fwd_gpu_us=us, method="cuda_graph",
             gpu="GPU") for p, us in (("flashtrain", 520.0), ("flashtrain_fp8_fwd", 400.0))])
    report_attention.main([speed, "--fp8", "--gpu-time", gpu])
    out = capsys.readouterr().out
    assert "CUDA graph" in out and "torch.profiler" not in out
    assert "| 520 / 400 (1.30x) |" in out


def test_fp8_table_without_gpu_time(tmp_path, capsys):
    report_attention.main([write_csv(tmp_path / "speed.csv", speed_rows()), "--fp8"])
    out = capsys.readouterr().out
    assert "GPU time" not in out
    assert "| 128 | 4096 | 4 x 16 | yes | 500 | 600 (1.20x) | 400 | 300 (0.75x) |" in out


def test_gpu_time_needs_fp8(tmp_path):
    with pytest.raises(SystemExit):
        report_attention.main([write_csv(tmp_path / "speed.csv", speed_rows()), "--gpu-time", "x.csv"])


def test_gpu_time_methods_must_agree(tmp_path):
    """A GPU-time CSV of two methods (or an unknown one) is refused: the caption names one."""
    speed = write_csv(tmp_path / "speed.csv", speed_rows())
    gpu = write_csv(tmp_path / "gpu.csv", [
        dict(provider=p, D=128, N=4096, B=4, H=16, H_kv=16, causal=True, fwd_gpu_us=500.0, method=m, gpu="GPU")
        for p, m in (("flashtrain", "cuda_graph"), ("flashtrain_fp8_fwd", "cuda_graph_settled"))])
    with pytest.raises(SystemExit, match="one method expected"):
        report_attention.main([speed, "--fp8", "--gpu-time", gpu])
