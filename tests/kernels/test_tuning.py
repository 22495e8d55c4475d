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


def test_proxy_rows(monkeypatch):
    """A long launch tunes on a proxy with its keys: the shortest power of two from SEQ_BUCKET_CAP rows in its wave
    bucket; short launches (and proxies no shorter than half the launch) tune on themselves."""
    monkeypatch.setattr(tuning, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert tuning.proxy_rows(4, tuning.TUNE_PROXY_ABOVE, cuda) is None
    rows = tuning.proxy_rows(4, 2**20, cuda)  # 1M tokens, 4 heads: 32k rows a head fill 7.8 (bucket 8) waves
    assert rows == 32768
    assert tuning.wave_bucket(4, rows, cuda) == tuning.wave_bucket(4, 2**20, cuda) == 8
    assert tuning.wave_bucket(4, rows // 2, cuda) < 8 and tuning.seq_bucket(rows) == tuning.seq_bucket(2**20)
    assert tuning.proxy_rows(1, 2**20, cuda) == 2**17
    assert tuning.proxy_rows(1, 2**18 - 1, cuda) is None  # no shorter than half: tune on the launch


def test_a_launch_tunes_on_its_proxy_and_runs_with_the_pick(monkeypatch):
    """On a key's first launch the autotuner runs the proxy's arguments; the launch itself then runs once with the
    pick, which later launches of the key reuse without tuning."""
    monkeypatch.setattr(tuning, "_picks", {})
    calls = []

    class Tuned:
        best_config = type("Config", (), {"all_kwargs": lambda self: {"BLOCK_M": 64}})()

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("tune", grid({"BLOCK_M": 64}), args))

    monkeypatch.setattr(tuning, "launch_kernel", lambda kernel, grid, *args, **kw: calls.append(("run", grid, args)))
    real_args = (torch.zeros(4), 1 << 20, 16384, 8)
    proxy = lambda: (lambda m: (65536 // m["BLOCK_M"],), (torch.zeros(2), 65536, 16384, 8))  # noqa: E731
    for _ in range(2):
        tuning.launch_tuned("fwd", Tuned(), None, lambda m: ((1 << 20) // m["BLOCK_M"],), real_args, None, proxy,
                            HEAD_DIM=64)
    assert [(c[0], c[1]) for c in calls] == [("tune", (1024,)), ("run", (16384,)), ("run", (16384,))]
    assert calls[0][2][1] == 65536 and calls[1][2][1] == 1 << 20
