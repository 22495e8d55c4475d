"""Launch-configuration helpers of flashtrain.kernels.configs (no kernel runs)."""

import csv

import torch

from flashtrain.kernels import configs


def test_write_tuning_picks(tmp_path, monkeypatch):
    """The benchmarks' record of what each autotuned launch key ran with: one CSV row per key."""
    key = ("dkdv", 16384, torch.bfloat16, torch.float32, ("HEAD_DIM", 64), ("EVEN_M", True))
    pick = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None)
    monkeypatch.setattr(configs, "_picks", {key: pick})
    path = tmp_path / "picks.csv"
    assert configs.write_tuning_picks(str(path)) == 1
    rows = list(csv.DictReader(path.open()))
    assert rows == [dict(kernel="dkdv", key=repr(key[1:]), BLOCK_M="64", BLOCK_N="64", num_warps="4",
                         num_stages="3")]


def test_every_dkdv_tile_divides_the_even_multiple():
    """EVEN_M (no row masks in the dK/dV kernel) is decided by seq_q % EVEN_M_MULTIPLE: every BLOCK_M the
    kernel may run with must divide it, or rows past seq_q would be read unmasked."""
    tiles = [c.kwargs["BLOCK_M"] for c in (*configs.DKDV_CANDIDATES, *configs.DKDV_CANDIDATES_WIDE)]
    tiles += [t[0] for t in (configs.INTERPRET_DKDV, configs.INTERPRET_LONG_DKDV, configs.FP64, configs.FP64_WIDE)]
    assert all(configs.EVEN_M_MULTIPLE % m == 0 for m in tiles)
