"""The README tables of scripts/bench/masks.py and ring.py (CPU): cells, ratios, and the section they replace."""

import argparse
import csv
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
META = dict(gpu="GPU", torch="2", triton="3", commit="abc", date="2026-12-07")


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_masks_table_and_readme_section(tmp_path):
    masks = load("masks")
    point = dict(case="documents", D=128, H=16, H_kv=4, T=16384, L=2048, docs=8)
    rates = {("flashtrain", "fwd"): 500, ("flashtrain", "bwd"): 300, ("flex", "fwd"): 250, ("flex", "bwd"): 200,
             ("flashtrain_dense", "fwd"): 550, ("flashtrain_dense", "bwd"): 400}
    rows = [dict(**point, provider=p, mode=m, ms=1.0, tflops=t, status="ok", **META) for (p, m), t in rates.items()]
    rows.append(dict(**point, provider="torch_varlen", mode="fwd", ms="", tflops="", status="unsupported", **META))
    table = masks.report(write_csv(tmp_path / "masks.csv", rows))
    row = "| documents | 16k | 2048 | 128 | 16 (4) | 500 / 300 | 250 / 200 |  | 550 / 400 | 2.00 / 1.50 | 0.91 / 0.75 |"
    assert row in table.splitlines()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{masks.START}\nold\n{masks.END}\ntail\n")
    parser = argparse.ArgumentParser()
    load("readme").add_report_arguments(parser)
    args = parser.parse_args(["--report", str(tmp_path / "masks.csv"), "--readme", str(readme)])
    assert load("readme").reported(parser, args, masks.report, masks.START, masks.END)
    text = readme.read_text()
    assert "old" not in text and table in text and text.endswith("tail\n")
    with pytest.raises(SystemExit):  # to run, a benchmark needs --out
        load("readme").reported(parser, parser.parse_args([]), masks.report)


def test_ring_table(tmp_path):
    ring = load("ring")
    rows = [dict(H=12, D=64, N=65536, P=p, mode=m, full_ms=1.0, slowest_rank_ms=1.0, efficiency=e, **META)
            for p, m, e in ((2, "fwd", "0.950"), (2, "fwd+bwd", "0.900"), (4, "fwd", "0.800"),
                            (4, "fwd+bwd", "0.700"))]
    table = ring.report(write_csv(tmp_path / "ring.csv", rows)).splitlines()
    assert "| H x D | N | P = 2 | P = 4 |" in table
    assert "| 12 x 64 | 64k | 0.950 / 0.900 | 0.800 / 0.700 |" in table


def test_first_call_table(tmp_path):
    first_call = load("first_call")
    rows = [dict(N=n, H=4, H_kv=1, D=64, first_s=f, tuned_s=t, **META)
            for n, f, t in ((65536, "30.1", "0.05"), (1048576, "41.0", "4.70"))]
    table = first_call.report(write_csv(tmp_path / "first_call.csv", rows)).splitlines()
    assert table[-4:] == ["| N | 64k | 1M |", "|---|---|---|", "| first call, s | 30.1 | 41.0 |",
                          "| once tuned, s | 0.05 | 4.70 |"]
