"""The autotuner's helpers (no kernel runs): its launch-size key, its record of picks, the launch-device decorator."""

import csv

import torch

from flashtrain.kernels import launch, tuning


def test_write_tuning_picks(tmp_path, monkeypatch):
    """The benchmarks' record of what each autotuned launch key ran with: one CSV row per key."""
    key = ("dkdv", 16384, torch.bfloat16, torch.float32, ("HEAD_DIM", 64), ("EVEN_M", True))
    pick = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None)
    monkeypatch.setattr(tuning, "_picks", {key: pick})
    path = tmp_path / "picks.csv"
    assert tuning.write_tuning_picks(str(path)) == 1
    rows = list(csv.DictReader(path.open()))
    assert rows == [dict(kernel="dkdv", key=repr(key[1:]), BLOCK_M="64", BLOCK_N="64", num_warps="4",
                         num_stages="3")]


def test_wave_bucket(monkeypatch):
    """The autotune key for a launch's size: waves of 128-row programs over the SMs, a power of two, at most 8;
    CPU tensors (the interpreter's fixed tiles) all share one."""
    monkeypatch.setattr(tuning, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    got = [tuning.wave_bucket(programs, 128, cuda) for programs in (1, 132, 133, 264, 265, 528, 529, 1056, 1057,
                                                                     10**6)]
    assert got == [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert tuning.wave_bucket(132, 129, cuda) == 2  # 129 rows: two programs a pair
    assert tuning.wave_bucket(10**6, 128, torch.device("cpu")) == 1


def test_on_input_device_passes_calls_through():
    """The launch-device decorator changes nothing on the CPU: same result, same name, calls without tensors."""
    @launch.on_input_device
    def launcher(x, y=1):
        return x + y

    t = torch.ones(2)
    assert torch.equal(launcher(t, y=2), t + 2)
    assert launcher(3) == 4
    assert launcher.__name__ == "launcher"


def test_seq_bucket():
    """Sequence lengths share a pick within a power of two, and every length from SEQ_BUCKET_CAP on shares one."""
    assert [tuning.seq_bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]
    assert tuning.seq_bucket(tuning.SEQ_BUCKET_CAP * 8) == tuning.seq_bucket(tuning.SEQ_BUCKET_CAP)
