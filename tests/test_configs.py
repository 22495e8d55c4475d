"""Launch-configuration helpers of flashtrain.kernels.configs (no kernel runs)."""

import csv

import pytest
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


def test_wave_bucket(monkeypatch):
    """The autotune key for a launch's size: waves of 128-row programs over the SMs, a power of two, at most 8;
    CPU tensors (the interpreter's fixed tiles) all share one."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    got = [configs.wave_bucket(programs, 128, cuda) for programs in (1, 132, 133, 264, 265, 528, 529, 1056, 1057,
                                                                     10**6)]
    assert got == [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert configs.wave_bucket(132, 129, cuda) == 2  # 129 rows: two programs a pair
    assert configs.wave_bucket(10**6, 128, torch.device("cpu")) == 1


def test_every_dkdv_tile_divides_the_even_multiple():
    """EVEN_M (no row masks in the dK/dV kernel) is decided by seq_q % EVEN_M_MULTIPLE: every BLOCK_M the
    kernel may run with must divide it, or rows past seq_q would be read unmasked."""
    tiles = [c.kwargs["BLOCK_M"] for c in (*configs.DKDV_CANDIDATES, *configs.DKDV_CANDIDATES_WIDE)]
    tiles += [t[0] for t in (configs.INTERPRET_DKDV, configs.INTERPRET_LONG_DKDV, configs.FP64, configs.FP64_WIDE)]
    assert all(configs.EVEN_M_MULTIPLE % m == 0 for m in tiles)


def test_hopper_forward_modes():
    assert configs.hopper_forward_mode() == "auto"
    with configs.hopper_forward("never"):
        assert configs.hopper_forward_mode() == "never"
    assert configs.hopper_forward_mode() == "auto"
    with pytest.raises(ValueError, match="'sometimes'"):
        with configs.hopper_forward("sometimes"):
            pass


def test_hopper_forward_configs_cover_their_thresholds():
    """Every head_dim with a Hopper config has a minimum sequence for both masks, and its shared memory fits
    sm_90's 227 KB."""
    for head_dim in configs.HOPPER_FWD_CONFIGS:
        meta = configs.hopper_fwd_meta(head_dim, causal=True)
        assert {(head_dim, False), (head_dim, True)} <= set(configs.HOPPER_FWD_MIN_SEQ)
        assert (meta["STAGES"] * 2 * meta["BLOCK_N"] + meta["CONSUMERS"] * 64) * head_dim * 2 <= 227 * 1024


def test_fp8_hopper_forward_configs_fit_an_sm90():
    """Every head_dim and mask of the FP8 Hopper forward: shared memory (K and V^T rings of e4m3, 64 Q rows per
    softmax warpgroup) within sm_90's 227 KB, registers (the warpgroups and the loader warp) within the SM's 64K,
    two or three warpgroups (64 rows each, inside one 128-row Q scale tile), BLOCK_N dividing the K/V tile, one
    F16_SCORES for both masks (the quantisation decides Q's and K's magnitude from head_dim alone), and a minimum
    sequence for both masks."""
    for head_dim in configs.FP8_HOPPER_FWD_CONFIGS:
        assert {(head_dim, False), (head_dim, True)} <= set(configs.FP8_HOPPER_FWD_MIN_SEQ)
        full, causal = (configs.fp8_hopper_fwd_meta(head_dim, c) for c in (False, True))
        assert full["F16_SCORES"] == causal["F16_SCORES"]
        for meta in (full, causal):
            assert meta["CONSUMERS"] in (2, 3)
            assert (meta["STAGES"] * 2 * meta["BLOCK_N"] + meta["CONSUMERS"] * 64) * head_dim <= 227 * 1024
            assert meta["CONSUMERS"] * 128 * meta["CONSUMER_REGS"] + 32 * meta["LOADER_REGS"] <= 65536
            assert configs.FP8_FWD[head_dim][1] % meta["BLOCK_N"] == 0  # the GPU's K/V tile


def test_hopper_backward_modes():
    assert configs.hopper_backward_mode() == "auto"
    with configs.hopper_backward("always"):
        assert configs.hopper_backward_mode() == "always"
        assert configs.hopper_forward_mode() == "auto"  # the two switches are apart
    assert configs.hopper_backward_mode() == "auto"
    with pytest.raises(ValueError, match="hopper_backward mode='sometimes'"):
        with configs.hopper_backward("sometimes"):
            pass


def test_hopper_backward_configs_fit_an_sm90():
    """Every head_dim with a Hopper backward config: shared memory (K of 128 keys, V of 2 x 64, two dS^T buffers
    of 128 x 64, the Q / dO ring) within sm_90's 227 KB, registers (two warpgroups and the loader warp) within
    the SM's 64K; both masks have a minimum sequence."""
    assert set(configs.HOPPER_BWD_MIN_SEQ) == {False, True}
    for head_dim in configs.HOPPER_BWD_CONFIGS:
        meta = configs.hopper_bwd_meta(head_dim)
        smem = (128 * head_dim + 128 * head_dim + 2 * 128 * 64 + meta["STAGES"] * 2 * 64 * head_dim) * 2
        assert smem <= 227 * 1024
        assert 2 * 128 * meta["CONSUMER_REGS"] + 32 * meta["LOADER_REGS"] <= 65536


def test_hopper_forward_rules_on_the_host():
    """What ``hopper_forward_applies`` decides without a GPU: CPU tensors never take the Hopper kernel, and
    the TMA rules on strides and alignment."""
    from flashtrain.kernels.attention_fwd import _tma_addressable, hopper_forward_applies

    q = torch.randn(1, 2, 8192, 64, dtype=torch.bfloat16)
    with configs.hopper_forward("always"):
        assert not hopper_forward_applies(q, q, q, True, 0.125, None, 0.0)
    assert _tma_addressable(q)
    assert _tma_addressable(torch.randn(1, 300, 2, 64).to(torch.bfloat16).transpose(1, 2))
    assert not _tma_addressable(q.transpose(2, 3))  # head_dim not the unit-stride dim
    assert not _tma_addressable(torch.randn(1, 2, 300, 72, dtype=torch.bfloat16)[..., 4:68])  # 8-byte offset
    assert not _tma_addressable(torch.randn(1, 2, 300, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte rows


def test_on_input_device_passes_calls_through():
    """The launch-device decorator changes nothing on the CPU: same result, same name, calls without tensors."""
    @configs.on_input_device
    def launcher(x, y=1):
        return x + y

    t = torch.ones(2)
    assert torch.equal(launcher(t, y=2), t + 2)
    assert launcher(3) == 4
    assert launcher.__name__ == "launcher"


def test_causal_sections(monkeypatch):
    """Launch sections of a causal kernel: of at least one program per SM, more pairs while the rows they stream
    (the forward's and dQ's K and V, dK/dV's Q and dO) fit CAUSAL_SECTION_KV_BYTES, a power of two pairs; at least
    1 section; 1 without a mask; the override wins."""
    gpu = torch.device("cuda")  # only its type is read: the SM count is stubbed
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    monkeypatch.setattr(configs, "CAUSAL_SECTIONS", None)
    sections = configs.causal_sections
    assert sections(False, 32, 32, 1, 4096, 512, gpu) == 1
    # FP8 at head_dim 256, (4, 8, 4096): 32 programs a pair -> 5 pairs for 132 SMs (2 MiB of K and V a pair -> 4),
    # rounded up to 8: 4 sections
    assert sections(True, 32, 32, 1, 4096, 512, gpu) == 4
    # 16-bit at head_dim 128, (1, 16, 16384), 192-row programs: 86 a pair -> 2; 8 MiB a pair -> 1
    assert sections(True, 16, 86, 1, 16384, 512, gpu) == 8
    # FP8 at 128, (4, 16, 4096): 22 a pair -> 6; 1 MiB a pair -> 8; with 4 query heads a KV head -> 32
    assert sections(True, 64, 22, 1, 4096, 256, gpu) == 8
    assert sections(True, 64, 22, 4, 4096, 256, gpu) == 2
    assert sections(True, 4, 22, 1, 4096, 256, gpu) == 1  # never fewer than one
    assert sections(True, 15, 32, 1, 4096, 512, gpu) == 1  # 15 pairs by 8: one section of 15
    assert sections(True, 24, 32, 1, 4096, 512, gpu) == 3
    assert sections(True, 4, 1, 1, 1 << 30, 256, torch.device("cpu")) == 4  # one SM: a pair a section
    # bf16 dK/dV at 128, (4, 16, 4096), 128-key blocks: 32 a pair -> 5; Q and dO with LSE and delta, 520 bytes a
    # query row: 2 pairs in 8 MiB -> 8 a section
    assert sections(True, 64, 32, 1, 4096, 520, gpu) == 8
    # with 4 query heads a KV head, a pair streams 4 heads' rows: 16 KV pairs of 32 -> 8 a section
    assert sections(True, 16, 32, 1, 4096, 4 * 520, gpu) == 2
    monkeypatch.setattr(configs, "CAUSAL_SECTIONS", 3)
    assert sections(True, 64, 22, 1, 4096, 256, gpu) == 3 and sections(True, 2, 22, 1, 4096, 256, gpu) == 2


def test_largest_tile():
    """The tile the causal sections are counted in: the largest the tuner may pick for the head_dim, per kernel."""
    assert [configs.largest_tile(kernel, 128) for kernel in ("fwd", "dkdv", "dq")] == [128, 128, 128]
    assert [configs.largest_tile(kernel, 256) for kernel in ("fwd", "dkdv", "dq")] == [128, 64, 64]
    assert configs.largest_tile("dkdv", 64) == max(c.kwargs["BLOCK_N"] for c in configs.DKDV_CANDIDATES)
