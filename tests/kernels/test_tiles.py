"""The fixed tiles and configurations of every kernel family fit the hardware and agree with each other."""

from flashtrain.kernels.attention import tiles as attention_tiles
from flashtrain.kernels.fp8 import tiles as fp8_tiles
from flashtrain.kernels.hopper import tiles as hopper_tiles
from flashtrain.ops import dispatch


def test_every_dkdv_tile_divides_the_even_multiple():
    """EVEN_M (no row masks in the dK/dV kernel) is decided by seq_q % EVEN_M_MULTIPLE: every BLOCK_M the
    kernel may run with must divide it, or rows past seq_q would be read unmasked."""
    tiles = [c.kwargs["BLOCK_M"] for c in (*attention_tiles.DKDV_CANDIDATES, *attention_tiles.DKDV_CANDIDATES_WIDE,
                                           *attention_tiles.DKDV_SPLIT_CANDIDATES_WIDE)]
    tiles += [t[0] for t in (attention_tiles.INTERPRET_DKDV, attention_tiles.INTERPRET_LONG_DKDV, attention_tiles.FP64,
                             attention_tiles.FP64_WIDE)]
    assert all(attention_tiles.EVEN_M_MULTIPLE % m == 0 for m in tiles)


def test_largest_tile():
    """The tile the causal sections are counted in: the largest the tuner may pick for the head_dim, per kernel."""
    assert [attention_tiles.largest_tile(kernel, 128) for kernel in ("fwd", "dkdv", "dq")] == [128, 128, 128]
    assert [attention_tiles.largest_tile(kernel, 256) for kernel in ("fwd", "dkdv", "dq")] == [128, 64, 64]
    assert attention_tiles.largest_tile("dkdv", 64) == max(c.kwargs["BLOCK_N"]
                                                           for c in attention_tiles.DKDV_CANDIDATES)
    assert [attention_tiles.largest_tile("dkdv_split", d) for d in (128, 256)] == [128, 128]


def test_hopper_forward_configs_cover_their_thresholds():
    """Every head_dim with a Hopper config has a minimum sequence for both masks, and its shared memory fits
    sm_90's 227 KB."""
    for head_dim in hopper_tiles.HOPPER_FWD_CONFIGS:
        meta = hopper_tiles.hopper_fwd_meta(head_dim, causal=True)
        assert {(head_dim, False), (head_dim, True)} <= set(dispatch.HOPPER_FWD_MIN_SEQ[dispatch.SM90])
        assert (meta["STAGES"] * 2 * meta["BLOCK_N"] + meta["CONSUMERS"] * 64) * head_dim * 2 <= 227 * 1024


def test_fp8_hopper_forward_configs_fit_an_sm90():
    """Every head_dim and mask of the FP8 Hopper forward: shared memory (K and V^T rings of e4m3, 64 Q rows per
    softmax warpgroup) within sm_90's 227 KB, registers (the warpgroups and the loader warp) within the SM's 64K,
    two or three warpgroups (64 rows each, inside one 128-row Q scale tile), BLOCK_N dividing the K/V tile, one
    F16_SCORES for both masks (the quantisation decides Q's and K's magnitude from head_dim alone), and a minimum
    sequence for both masks."""
    for head_dim in hopper_tiles.FP8_HOPPER_FWD_CONFIGS:
        assert {(head_dim, False), (head_dim, True)} <= set(dispatch.FP8_HOPPER_FWD_MIN_SEQ[dispatch.SM90])
        full, causal = (hopper_tiles.fp8_hopper_fwd_meta(head_dim, c) for c in (False, True))
        assert full["F16_SCORES"] == causal["F16_SCORES"]
        for meta in (full, causal):
            assert meta["CONSUMERS"] in (2, 3)
            assert (meta["STAGES"] * 2 * meta["BLOCK_N"] + meta["CONSUMERS"] * 64) * head_dim <= 227 * 1024
            assert meta["CONSUMERS"] * 128 * meta["CONSUMER_REGS"] + 32 * meta["LOADER_REGS"] <= 65536
            assert fp8_tiles.FP8_FWD[head_dim][1] % meta["BLOCK_N"] == 0  # the GPU's K/V tile


def test_hopper_backward_configs_fit_an_sm90():
    """Every head_dim with a Hopper backward config: shared memory (K of 128 keys, V of 2 x 64, two dS^T buffers
    of 128 x 64, the Q / dO ring) within sm_90's 227 KB, registers (two warpgroups and the loader warp) within
    the SM's 64K; both masks have a minimum sequence."""
    assert set(dispatch.HOPPER_BWD_MIN_SEQ[dispatch.SM90]) == {False, True}
    for head_dim in hopper_tiles.HOPPER_BWD_CONFIGS:
        meta = hopper_tiles.hopper_bwd_meta(head_dim)
        smem = (128 * head_dim + 128 * head_dim + 2 * 128 * 64 + meta["STAGES"] * 2 * 64 * head_dim) * 2
        assert smem <= 227 * 1024
        assert 2 * 128 * meta["CONSUMER_REGS"] + 32 * meta["LOADER_REGS"] <= 65536
