"""FP8 building blocks: per-tile e4m3 quantisation and the randomised Hadamard transform, against PyTorch."""

import math

import pytest
import torch

from flashtrain.ops.fp8 import _seq_mean, fp8_quantize, hadamard_transform, random_signs
from flashtrain.kernels.fp8 import quant as fp8_quant
from flashtrain.kernels.fp8.centring import centre, seq_mean
from flashtrain.kernels.fp8.hadamard import hadamard, hadamard_matrix, padded_dim
from flashtrain.kernels.launch import clear_kept
from flashtrain.ops.reference import (centre_ref, fp8_dequantize_ref, fp8_quantize_ref, hadamard_ref, mma_key_order_ref,
                                  pow2_at_least)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, block_n", [((1, 2, 1, 24), 16), ((2, 2, 37, 40), 16), ((1, 1, 129, 64), 32),
                                            ((1, 2, 300, 24), 128)], ids=str)
@pytest.mark.parametrize("amax_to", [448.0, 16.0], ids=["amax_448", "amax_16"])
def test_quantize_matches_reference(shape, block_n, dtype, amax_to, device):
    """Bits and scales of the reference, each tile's largest magnitude in [amax_to / 2, amax_to] (amax_to 16: Q and
    K where the FP8 Hopper forward sums the scores in float16), and the round trip within half an e4m3 step."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-6, 2, shape[-1])).to(device=device, dtype=dtype)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    q, scales = fp8_quantize(x, block_n, amax_to=amax_to)
    ref_q, ref_scales = fp8_quantize_ref(x, block_n, amax_to=amax_to)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # bit-identical, rounding included
    tiles = torch.nn.functional.pad(q.float(), (0, 0, 0, -x.shape[2] % block_n)).unflatten(2, (-1, block_n))
    tile_max = tiles.abs().amax(dim=(-1, -2))
    assert ((tile_max >= amax_to / 2) & (tile_max <= amax_to)).all()  # amax / scale in (amax_to / 2, amax_to], rounded
    # round trip: at most half an e4m3 step (2^-4 relative; 2^-10 absolute on the scaled subnormal grid)
    err = (fp8_dequantize_ref(q, scales, block_n) - x.float()).abs()
    bound = x.float().abs() * 2**-4 + scales.repeat_interleave(block_n, -1)[..., : x.shape[2], None] * 2**-10
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("shape, block_n", [((1, 2, 37, 40), 16), ((1, 1, 70, 128), 64)], ids=str)
def test_rotated_centred_quantise_to_a_smaller_amax(shape, block_n, device):
    """K as the FP8 Hopper forward's float16 scores take it (centred, rotated, amax_to 16): the values of the
    reference quantisation of the Hadamard kernel's rotated, centred K (as in test_rotation_fused_into_quantise:
    the rotation's zeros may carry a sign), and an all-zero head's tiles at scale 1."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=gen) * 2 + torch.randn(shape[-1], generator=gen) * 3).to(device, torch.float16)
    x[0, 0] = 0
    mean, signs = _seq_mean(x), random_signs(padded_dim(shape[-1]), seed=3, device=device)
    q, scales = fp8_quantize(x, block_n, mean=mean, signs=signs, amax_to=16.0)
    ref_q, ref_scales = fp8_quantize_ref(hadamard(x, signs, mean=mean), block_n, amax_to=16.0)
    assert torch.equal(scales, ref_scales) and (scales[0, 0] == 1).all()
    assert torch.equal(q.float(), ref_q.float()) and not q[0, 0].float().any()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, block_n", [((1, 2, 1, 24), 16), ((2, 1, 37, 40), 16), ((1, 2, 129, 64), 64),
                                            ((1, 1, 70, 256), 128)], ids=str)
def test_dequantize_matches_reference(shape, block_n, dtype, device):
    """The dequantisation kernel (fp8="forward"'s backward reads Q and K through it) against
    ``fp8_dequantize_ref`` rounded to the dtype, bit for bit: every finite e4m3 value, power-of-two scales from
    2^-40 to 2^20 (float16's subnormals and its overflow included), strided q, outputs poisoned."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, seq, head_dim = shape
    byte = torch.randint(0, 256, (batch, seq, heads, head_dim), generator=gen, dtype=torch.uint8)
    byte[(byte & 0x7F) == 0x7F] = 0  # e4m3's NaN
    q = byte.view(torch.float8_e4m3fn).to(device).transpose(1, 2)  # strided
    n_tiles = -(-seq // block_n)
    scales = torch.exp2(torch.randint(-40, 21, (batch, heads, n_tiles), generator=gen).float()).to(device)
    out = fp8_quant.fp8_dequantize(q, scales, block_n, dtype)
    assert out.dtype == dtype and out.shape == shape and out.is_contiguous()
    ref = fp8_dequantize_ref(q, scales, block_n).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), ref.contiguous().view(bits))
    with pytest.raises(ValueError, match="scales of shape"):
        fp8_quant.fp8_dequantize(q, scales[..., :-1], block_n, dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype, out_dtype", [
    (torch.float64, None), (torch.float32, None), (torch.float16, None), (torch.float32, torch.float16),
    # the interpreter rounds to bfloat16 otherwise than round-to-nearest-even: bf16 outputs on the GPU
    pytest.param(torch.bfloat16, None, marks=pytest.mark.gpu),
    pytest.param(torch.float32, torch.bfloat16, marks=pytest.mark.gpu)], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 1, 24), (2, 1, 37, 40), (1, 2, 129, 64), (1, 1, 70, 256)], ids=str)
def test_centre_matches_reference(shape, dtype, out_dtype, device):
    """The centring kernel (dK in the FP8 backwards) against ``centre_ref``, bit for bit: fp32 (fp64) arithmetic,
    one rounding to the output dtype; strided input, outputs poisoned; a wrong mean raises."""
    gen = torch.Generator().manual_seed(6)
    batch, heads, seq, head_dim = shape
    x = (torch.randn(batch, seq, heads, head_dim, generator=gen) * 3 + 1).to(device, dtype).transpose(1, 2)
    mean = torch.randn(batch, heads, head_dim, generator=gen).to(device)
    out = centre(x, mean, out_dtype)
    assert out.dtype == (out_dtype or dtype) and out.shape == shape and out.is_contiguous()
    ref = centre_ref(x, mean, out_dtype)
    assert torch.equal(out, ref) and not out.isnan().any()
    with pytest.raises(ValueError, match="mean must be float32"):
        centre(x, mean.double(), out_dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape, step", [((1, 1, 1, 24), 1), ((2, 3, 37, 40), 1), ((1, 2, 129, 64), 2),
                                         ((2, 1, 70, 256), 16), ((1, 1, 5, 8), 7)], ids=str)
def test_seq_mean_matches_reference(shape, step, dtype, device):
    """K smoothing's mean of every step-th key (one kernel) against float64's mean of those rows: within fp32's
    summation error; strided input (heads and sequence swapped), more rows than a program's 32 a column, columns
    split over programs (256), a step past the last row (5 rows, step 7: row 0 alone); output poisoned."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, seq, head_dim = shape
    x = (torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64) * 3 + 1).to(device, dtype)
    x = x.transpose(1, 2)
    out = seq_mean(x, step)
    assert out.dtype == torch.float32 and out.shape == (batch, heads, head_dim) and out.is_contiguous()
    ref = x[:, :, ::step].double().mean(dim=2)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="step=0"):
        seq_mean(x, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pow2_at_least_is_exact(dtype, device):
    """The references' scale rounding: every power of two of the dtype's range is its own (CUDA's float64 log2 of
    2^-126 lay above -126, so a log2 and a ceil gave 2^-125 and the reference disagreed with the kernel), the next
    value above one goes to the power above, and inf and NaN stay."""
    info = torch.finfo(dtype)
    lowest, highest = (math.frexp(info.smallest_normal * info.eps)[1] - 1, math.frexp(info.max)[1] - 1)
    exponents = torch.arange(lowest, highest + 1, device=device)  # subnormals included
    powers = torch.ldexp(torch.ones(exponents.shape, dtype=dtype, device=device), exponents)
    assert torch.equal(pow2_at_least(powers), powers)
    above = torch.nextafter(powers[:-1], torch.tensor(float("inf"), dtype=dtype, device=device))
    assert torch.equal(pow2_at_least(above), powers[1:])
    inf, nan = pow2_at_least(torch.tensor([float("inf"), float("nan")], dtype=dtype, device=device))
    assert inf == float("inf") and nan.isnan()


@pytest.mark.parametrize("magnitude", [1e-30, 1e-37, 1e-40, 1e-44], ids=str)
def test_quantize_tiles_below_fp32_normal_range(magnitude, device):
    """A tile whose amax / 448 is below fp32's smallest normal (2^-126) gets that scale (a smaller or zero one made
    1 / scale infinite and the tile NaN): bits and scales of the reference, finite, and zero where x / 2^-126 is
    below e4m3's smallest subnormal."""
    x = torch.randn(1, 1, 64, 32, generator=torch.Generator().manual_seed(2)).to(device) * magnitude
    q, scales = fp8_quantize(x, 32)
    ref_q, ref_scales = fp8_quantize_ref(x, 32)
    assert torch.equal(scales, ref_scales) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.isfinite(q.float()).all() and (scales >= 2.0**-126).all()
    if magnitude < 1e-36:
        assert torch.equal(scales, torch.full_like(scales, 2.0**-126))


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=str)
@pytest.mark.parametrize("shape, block_n", [((1, 2, 1, 24), 16), ((2, 1, 37, 40), 16), ((1, 2, 129, 64), 32),
                                            ((1, 1, 70, 256), 64)], ids=str)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
def test_quantize_do_and_delta(shape, block_n, dtype, with_dlse, device):
    """The FP8 backward's pass over dO: the bytes and scales of ``fp8_quantize(do, block_n, empty_tile_scale=0.0,
    with_transposed=True)``, and delta = rowsum(dO8 * O) - dlse against float64 (dO8 dequantised) within fp32
    rounding; strided inputs, an all-zero tile, outputs poisoned."""
    from flashtrain.kernels.fp8.bwd import quantize_do_and_delta
    gen = torch.Generator().manual_seed(4)
    batch, heads, seq, head_dim = shape
    do, out = ((torch.randn(batch, seq, heads, head_dim, generator=gen) * 1e-3).to(device, dtype).transpose(1, 2)
               for _ in range(2))
    do[:, :, :block_n] = 0.0  # the first tile all zeros: scale 0
    dlse = torch.randn(batch, heads, seq, generator=gen).to(device) if with_dlse else None
    do8, scales, do8_t, delta = quantize_do_and_delta(do, out, dlse, block_n)
    ref8, ref_scales, ref8_t = fp8_quantize(do, block_n, empty_tile_scale=0.0, with_transposed=True)
    assert torch.equal(scales, ref_scales) and torch.equal(do8.view(torch.uint8), ref8.view(torch.uint8))
    assert do8_t.shape == ref8_t.shape and torch.equal(do8_t.view(torch.uint8), ref8_t.view(torch.uint8))
    dequantised = fp8_dequantize_ref(do8, scales.clamp_min(2.0**-126), block_n).double()  # scale 0: zeros anyway
    exact = (dequantised * out.double()).sum(-1) - (dlse.double() if with_dlse else 0.0)
    bound = 1e-6 * ((dequantised * out.double()).abs().sum(-1) + (dlse.double().abs() if with_dlse else 0.0))
    assert delta.dtype == torch.float32 and ((delta.double() - exact).abs() <= bound + 1e-30).all()


def test_quantize_zero_tiles_and_tails(device):
    x = torch.zeros(1, 1, 40, 16, device=device)
    x[0, 0, 35, 3] = 7.0  # only the last (tail) tile of 8 rows is non-zero
    q, scales = fp8_quantize(x, 16)
    assert torch.equal(scales[0, 0], torch.tensor([1.0, 1.0, 7.0 / 448], device=device))
    assert torch.isfinite(q.float()).all() and q.float()[0, 0, :32].abs().sum() == 0
    assert q.float()[0, 0, 35, 3] * scales[0, 0, 2] == 7.0
    # the FP8 backward's Q and dO: empty tiles report scale 0, the bytes and other scales unchanged
    q0, scales0 = fp8_quantize(x, 16, empty_tile_scale=0.0)
    assert torch.equal(scales0[0, 0], torch.tensor([0.0, 0.0, 7.0 / 448], device=device))
    assert torch.equal(q0.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("chunk_elements", [16384, 512], ids=["whole_tiles", "chunked_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape, block_n", [((2, 2, 37, 40), 16), ((1, 2, 129, 64), 64), ((1, 1, 70, 256), 32)],
                         ids=str)
def test_centring_fused_into_quantise_and_rotate_bit_for_bit(shape, block_n, dtype, chunk_elements, device,
                                                             monkeypatch):
    """K smoothing's centring inside fp8_quantize gives the bits of centring as its own op (``centre_ref``) first,
    also when the quantisation reads a tile in chunks of rows (twice: for its amax, then to quantise); inside the
    Hadamard kernel's forward, the bits of the rotated rows minus the rotated mean, in fp32 (fp64), rounded once."""
    monkeypatch.setattr(fp8_quant, "QUANT_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 2 + torch.randn(shape[-1], generator=gen) * 3).to(device, dtype)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    mean = _seq_mean(x)
    centred = centre_ref(x, mean)
    if dtype != torch.float64:  # e4m3 quantisation takes 16/32-bit inputs
        q, scales = fp8_quantize(x, block_n, mean=mean)
        ref_q, ref_scales = fp8_quantize(centred, block_n)
        assert torch.equal(scales, ref_scales) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    signs = random_signs(padded_dim(shape[-1]), seed=3, device=device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rotated_mean = hadamard(mean.to(acc)[:, :, None], signs)
    assert torch.equal(hadamard(x, signs, mean=mean), (hadamard(x, signs, out_dtype=acc) - rotated_mean).to(dtype))


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, head_dim", [((2, 2, 37, 64), 40), ((1, 2, 129, 32), 24), ((1, 1, 70, 256), 256)],
                         ids=str)
def test_inverse_transform_centres_in_fp32(shape, head_dim, dtype, device):
    """The inverse transform with a mean (dK's centring in fp8="forward"'s backward): y - mean in fp32, the
    transform, one rounding; the bits of the inverse of the fp32 difference, and within the output's rounding of
    centring the exact inverse (the centring commutes with the rotation)."""
    gen = torch.Generator().manual_seed(7)
    y = (torch.randn(shape, generator=gen) + torch.randn(shape[-1], generator=gen) * 2).to(device, dtype)
    signs = random_signs(shape[-1], seed=3, device=device)
    mean = _seq_mean(y)
    out = hadamard(y, signs, inverse=True, out_dim=head_dim, mean=mean)
    assert out.dtype == dtype and out.shape == (*shape[:3], head_dim) and not out.isnan().any()
    ref = hadamard(y.float() - mean[:, :, None], signs, inverse=True, out_dim=head_dim, out_dtype=dtype)
    assert torch.equal(out, ref)
    h = hadamard_matrix(shape[-1], device=device)
    exact = (y.double() @ h / shape[-1] ** 0.5 * signs.double())[..., :head_dim]
    exact = exact - exact.mean(dim=2, keepdim=True)
    assert ((out.double() - exact).abs() <= exact.abs() * torch.finfo(dtype).eps + 1e-6).all()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("method, chunk_elements", [("default", 16384), ("default", 512), ("butterfly", 16384)],
                         ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("centre", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, block_n", [((1, 2, 37, 40), 16), ((2, 1, 129, 24), 64), ((1, 1, 70, 128), 64),
                                            ((1, 1, 33, 256), 16),
                                            # width 256 by halves, the second half partly padding
                                            ((1, 1, 40, 200), 16),
                                            # the launches of whole 128-row tiles (fp32 at width 256: the butterfly)
                                            pytest.param((1, 1, 300, 128), 128, marks=pytest.mark.gpu),
                                            pytest.param((1, 1, 300, 256), 128, marks=pytest.mark.gpu)], ids=str)
def test_rotation_fused_into_quantise(shape, block_n, dtype, centre, transposed, method, chunk_elements, device,
                                      monkeypatch):
    """fp8_quantize(x, signs=...) against the Hadamard kernel followed by fp8_quantize, for each way of applying
    the rotation (the default: a matmul up to width 128, two half-width matmuls at 256; the butterfly),
    whole tiles and tiles read in chunks: the same scales, and the same e4m3 values except where the rotation's
    fp32 sums round differently (fp32 inputs, whose sums fp32 cannot always hold exactly), by one e4m3 step. The
    transposed layout holds the same values, keys contiguous, rows 16-byte aligned (TMA)."""
    if method != "default":
        monkeypatch.setattr(fp8_quant, "rotate_method", lambda dim: method)
    monkeypatch.setattr(fp8_quant, "ROTATE_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=gen) * 2 + torch.randn(shape[-1], generator=gen) * 3).to(device, dtype)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    mean = _seq_mean(x) if centre else None
    signs = random_signs(padded_dim(shape[-1]), seed=3, device=device)
    q, scales = fp8_quantize(x, block_n, mean=mean, signs=signs, transposed=transposed)
    ref_q, ref_scales = fp8_quantize(hadamard(x, signs, mean=mean), block_n)
    if transposed:
        assert q.shape == (*shape[:2], signs.numel(), shape[2]) and q.stride(3) == 1 and q.stride(2) % 16 == 0
        q = q.transpose(2, 3)
    assert torch.equal(scales, ref_scales)
    a, b = q.float(), ref_q.float()
    differ = a != b
    assert differ.float().mean() <= 1e-3 and ((a - b).abs() <= a.abs().maximum(b.abs()) / 8).all()
    if dtype == torch.float16 and device == "cpu":
        assert not differ.any()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("form", ["Q", "K", "K_both_layouts"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("tiles", [1, 8], ids=lambda t: f"{t}_tiles")
@pytest.mark.parametrize("head_dim", [64, 256])
def test_rotated_quantise_tiles_per_program(head_dim, tiles, dtype, form, device, monkeypatch):
    """Rotating quantisations take several tiles a program (4, or 8 on large inputs, ``fp8_quantize``; the matmul
    method up to width 128, halves at 256): the bytes do not depend on how many, with a last program of fewer
    tiles (13 a head here; 1 of 4 by default), nor on whether a tile is stored one step late (OVERLAP: 16-bit
    inputs) or in its own step (32-bit ones), for the forward's Q (rotated) and K (centred too; at 256 with the
    rotated mean given to the kernel, ``_mean_halves``) and the FP8 backward's K in both layouts."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(1, 2, 200, head_dim, generator=gen) * 2 + torch.randn(head_dim, generator=gen)).to(device, dtype)
    centre, both = form != "Q", form == "K_both_layouts"
    kwargs = dict(mean=_seq_mean(x) if centre else None, signs=random_signs(head_dim, seed=3, device=device),
                  empty_tile_scale=0.0 if both else 1.0, with_transposed=both)
    monkeypatch.setattr(fp8_quant, "ROTATE_TILES_PER_PROGRAM", 1)
    monkeypatch.setitem(fp8_quant.HALVES_LAUNCH, "TILES", 1)
    clear_kept()
    ref = fp8_quantize(x, 16, **kwargs)
    monkeypatch.setattr(fp8_quant, "ROTATE_TILES_PER_PROGRAM", tiles)
    monkeypatch.setitem(fp8_quant.HALVES_LAUNCH, "TILES", tiles)
    clear_kept()  # the reference's plan was made with the constants before these
    launch = fp8_quant.quant_launch(16, head_dim, True, dtype.itemsize, second_copy=both)
    if launch["METHOD"] != "butterfly":  # 32-bit inputs at 256 take the butterfly, one tile a program
        assert launch["METHOD"] == ("halves" if head_dim == 256 else "matmul") and launch["TILES"] == tiles
        assert launch["OVERLAP"] == (tiles > 1 and dtype == torch.float16)
    out = fp8_quantize(x, 16, **kwargs)
    plan = fp8_quant._quantize_plan(tuple(x.shape), x.stride(), x.dtype, x.device, 16, centre, (head_dim, ),
                                    False, kwargs["empty_tile_scale"], False, both, fp8_quant.E4M3_MAX)
    if plan is not None:  # None: 32-bit inputs in both layouts, quantised by two calls
        assert plan.launch.constexprs["TILES"] == launch["TILES"]  # the launch that ran is these constants' one
    for a, b in zip(out, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_quantize_keeps_non_finite_values_non_finite(rotate, device):
    """A NaN stays NaN (its tile's other values keep the scale of its finite ones) and an infinite value becomes NaN
    (its tile's scale is infinite, the rest 0), as ``fp8_quantize_ref`` says: a clamp that dropped NaNs used to
    quantise them to finite values, and the FP8 op then returned finite outputs where the 16-bit path returns NaN.
    Rotated, the NaN or infinity spreads over its row first (the Hadamard transform's sums)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 40, 32, generator=gen).to(device, torch.float16)
    x[0, 0, 3, 5], x[0, 1, 20, 1] = float("nan"), float("inf")
    signs = random_signs(32, seed=3, device=device) if rotate else None
    q, scales = fp8_quantize(x, 16, signs=signs)
    ref_q, ref_scales = fp8_quantize_ref(x if signs is None else hadamard(x, signs), 16)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.float().isnan(), ref_q.float().isnan()) and q.float().isnan().any()
    assert torch.equal(q.float().nan_to_num(), ref_q.float().nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_rotated_quantise_of_wide_dtypes_in_whole_tiles(head_dim, dtype, device):
    """32/64-bit inputs rotated in 128-row tiles launch (the butterfly where the matmuls' shared memory would not
    fit an SM) and match the Hadamard kernel followed by the quantisation: scales equal, e4m3 values within one
    step where the rotation's sums round differently."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 2, 300, head_dim, generator=gen) * 2).to(device, dtype)
    mean = _seq_mean(x)
    signs = random_signs(head_dim, seed=3, device=device)
    q, scales = fp8_quantize(x, 128, mean=mean, signs=signs)
    ref_q, ref_scales = fp8_quantize(hadamard(x, signs, mean=mean), 128)
    assert torch.equal(scales, ref_scales)
    a, b = q.float(), ref_q.float()
    assert (a != b).float().mean() <= 1e-3 and ((a - b).abs() <= a.abs().maximum(b.abs()) / 8).all()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("shape, block_n", [((1, 2, 37, 40), 32), ((2, 1, 129, 24), 64), ((1, 1, 1, 16), 32),
                                            ((1, 1, 64, 8), 32)], ids=str)
def test_quantize_in_mma_key_order(shape, block_n, device):
    """V^T for the FP8 Hopper forward: the transposed quantisation's bytes and scales, each group of 32 keys
    permuted as ``mma_key_order_ref`` says, padded to a multiple of 32 keys with zeros (outputs poisoned)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen).to(device, torch.float16)
    plain, plain_scales = fp8_quantize(x, block_n, transposed=True)
    q, scales = fp8_quantize(x, block_n, transposed=True, mma_key_order=True)
    seq = shape[2]
    padded = -(-seq // 32) * 32
    assert q.shape == (*shape[:2], shape[3], padded) and q.stride(3) == 1 and q.stride(2) % 16 == 0
    assert torch.equal(scales, plain_scales)
    at = mma_key_order_ref(seq).to(device)
    assert torch.equal(q[..., at].view(torch.uint8), plain.view(torch.uint8))
    padding = torch.ones(padded, dtype=torch.bool, device=device)
    padding[at] = False
    assert (q[..., padding].view(torch.uint8) == 0).all()
    assert sorted(mma_key_order_ref(64).tolist()) == list(range(64))  # a permutation within groups of 32


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("chunk_elements", [16384, 512], ids=["whole_tiles", "chunked_tiles"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, block_n", [((1, 2, 37, 40), 16), ((2, 1, 129, 64), 64), ((1, 1, 70, 128), 32),
                                            ((1, 1, 1, 24), 16), ((1, 1, 40, 200), 16)], ids=str)
def test_quantize_with_transposed_copy(shape, block_n, dtype, rotate, chunk_elements, device, monkeypatch):
    """The FP8 backward's one launch for both layouts of Q, K and dO: the row-major bytes, the transposed copy's
    bytes and the scales are those of two separate launches (outputs poisoned), centred and rotated as K is."""
    monkeypatch.setattr(fp8_quant, "QUANT_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(fp8_quant, "ROTATE_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=gen) * 2 + torch.randn(shape[-1], generator=gen) * 3).to(device, dtype)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    kwargs = dict(mean=_seq_mean(x), signs=random_signs(padded_dim(shape[-1]), seed=3, device=device) if rotate
                  else None, empty_tile_scale=0.0)
    q, scales, q_t = fp8_quantize(x, block_n, with_transposed=True, **kwargs)
    ref_q, ref_scales = fp8_quantize(x, block_n, **kwargs)
    ref_t = fp8_quantize(x, block_n, transposed=True, **kwargs)[0]
    assert torch.equal(scales, ref_scales)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert q_t.shape == ref_t.shape and q_t.stride() == ref_t.stride()
    assert torch.equal(q_t.view(torch.uint8), ref_t.view(torch.uint8))


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="block_n=24"):
        fp8_quantize(torch.randn(1, 1, 4, 8), 24)
    x = torch.randn(1, 2, 4, 24)
    with pytest.raises(ValueError, match=r"fp8_quantize: mean must be float32 of shape \(1, 2, 24\)"):
        fp8_quantize(x, 16, mean=torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match=r"fp8_quantize: empty_tile_scale=0.5; expected 1.0 or 0.0"):
        fp8_quantize(x, 16, empty_tile_scale=0.5)
    with pytest.raises(ValueError, match=r"with_transposed=True .* got transposed=True, mma_key_order=False"):
        fp8_quantize(x, 16, transposed=True, with_transposed=True)
    with pytest.raises(ValueError, match=r"mma_key_order=True needs transposed=True and block_n a multiple of 32; "
                                         r"got transposed=False, block_n=32"):
        fp8_quantize(x, 32, mma_key_order=True)
    with pytest.raises(ValueError, match=r"got transposed=True, block_n=16"):
        fp8_quantize(x, 16, transposed=True, mma_key_order=True)
    with pytest.raises(ValueError, match=r"fp8_quantize: amax_to=10.0; expected 448.0 or a power of two from 1 to 256"):
        fp8_quantize(x, 16, amax_to=10.0)
    with pytest.raises(ValueError, match=r"fp8_quantize: signs has shape \(24,\); expected \(32,\)"):
        fp8_quantize(x, 16, signs=torch.ones(24))
    with pytest.raises(ValueError, match=r"hadamard: mean must be float32 of shape \(1, 2, 24\)"):
        hadamard(x, torch.ones(32), mean=torch.zeros(1, 2, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"mean needs a \(B, H, N, D\) x; got x of shape \(2, 4, 24\)"):
        hadamard(x[0], torch.ones(32), mean=torch.zeros(1, 2, 24))


@pytest.mark.parametrize("head_dim", [1, 24, 64, 100, 256])
def test_hadamard_matches_reference_and_is_orthogonal(head_dim, device):
    signs = random_signs(head_dim, seed=head_dim, device=device)
    x = torch.randn(3, 5, head_dim, dtype=torch.float64, device=device)
    y = hadamard_transform(x, signs)
    torch.testing.assert_close(y, hadamard_ref(x, signs), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)  # orthogonal
    back = hadamard(y, signs, inverse=True, out_dim=head_dim)
    torch.testing.assert_close(back, x, rtol=1e-12, atol=1e-12)  # inverse
    y32 = y.float()  # out_dtype: one rounding of the fp32 sums, the bits of the fp32 result cast
    assert torch.equal(hadamard(y32, signs, inverse=True, out_dim=head_dim, out_dtype=torch.float16),
                       hadamard(y32, signs, inverse=True, out_dim=head_dim).half())


def test_hadamard_keeps_scores_and_spreads_outliers(device):
    signs = random_signs(64, seed=1, device=device)
    q, k = torch.randn(2, 9, 64, dtype=torch.float64, device=device), torch.randn(2, 11, 64, dtype=torch.float64, device=device)
    q[..., 5] *= 100  # an outlier channel
    qh, kh = hadamard_transform(q, signs), hadamard_transform(k, signs)
    torch.testing.assert_close(qh @ kh.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-10, atol=1e-9)
    assert qh.abs().amax() < q.abs().amax() / 4  # the outlier's energy is spread over all 64 channels


def test_hadamard_gradcheck(device):
    signs = random_signs(40, seed=2, device=device)
    x = torch.randn(2, 3, 40, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: hadamard_transform(x, signs), (x,), fast_mode=True)


def test_simulated_fp8_attention_error_ordering():
    """FlashAttention-3's accuracy benchmark (N(0, 1) with 0.1% outliers of std 10), simulated in float64:
    per-block scales beat one scale per tensor, and the Hadamard rotation beats both."""
    from flashtrain.ops.reference import attention_ref, fp8_attention_ref
    from flashtrain.testing import outlier_data

    gen = torch.Generator().manual_seed(0)
    q, k, v = (outlier_data((1, 2, 512, 64), gen) for _ in range(3))
    ref = attention_ref(q, k, v, causal=True)[0]
    rmse = {scheme: ((fp8_attention_ref(q, k, v, causal=True, scheme=scheme, signs=random_signs(64)) - ref) ** 2)
            .mean().sqrt().item() for scheme in ("tensor", "block", "block+hadamard")}
    assert rmse["block+hadamard"] < rmse["block"] < rmse["tensor"], rmse
    assert rmse["block+hadamard"] < 0.75 * rmse["tensor"], rmse


@pytest.mark.parametrize("scale", [128**-0.5, 64**-0.5, 0.3, 1e-3, 2.0])
def test_f16_softmax_scale(scale):
    """The scale the FP8 Hopper forward's float16 scores apply: float16-exact once times log2(e) in float32 (as
    the kernel receives it), within 2^-11 of the scale asked for, and a fixed point (the backward passes it in
    again)."""
    from flashtrain.kernels.fp8.fwd import LOG2E, f16_softmax_scale
    rounded = f16_softmax_scale(scale)
    qk = torch.tensor(rounded * LOG2E, dtype=torch.float32)
    assert torch.equal(qk.half().float(), qk)
    assert abs(rounded / scale - 1) <= 2**-11
    assert f16_softmax_scale(rounded) == rounded
