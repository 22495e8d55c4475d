"""flash_attention(..., fp8="forward"): the FP8 forward kernel against float64 attention and against the float64
simulation of the same FP8 scheme (flashtrain.ops.reference.fp8_attention_ref), on CPU through the interpreter
(FP8 dots run there) and on CUDA when present."""

import math
import re
import types

import pytest
import torch

from flashtrain import flash_attention
from flashtrain.ops.fp8 import _rotation_signs
from flashtrain.ops import dispatch
from flashtrain.kernels.fp8 import tiles as fp8_tiles
from flashtrain.kernels.hopper import tiles as hopper_tiles
from flashtrain.kernels import masking
from flashtrain.ops import reference
from flashtrain.ops.reference import attention_ref, fp8_attention_bwd_ref, fp8_attention_ref
from flashtrain.testing import outlier_data, rel_error

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim): odd lengths, head dims that are not powers of two
# (the rotation pads Q and K to 64), GQA, seq_q != seq_k both ways
SHAPES = [(1, 2, 1, 37, 45, 40), (2, 2, 2, 17, 17, 24), (1, 2, 2, 129, 37, 64), (1, 1, 1, 1, 1, 16)]
# the backward's kernels also take unmasked paths where the lengths are multiples of their tiles (32 in the
# interpreter): seq_q < seq_k and seq_q > seq_k
EVEN_SHAPES = [(1, 2, 1, 64, 96, 40), (1, 2, 2, 96, 64, 32)]


def make(shape, device, dtype=torch.float16, requires_grad=False, seed=0):
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(batch, h, n, head_dim, generator=gen) for h, n in
               ((heads_q, seq_q), (heads_kv, seq_k), (heads_kv, seq_k))]
    return [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in tensors]


def reuse_geometry(device):
    """(head_dim, rows per Q scale tile) of inputs whose fp8="full" backward reads the forward's FP8 Q and K
    (``fp8._backward_reads_forward_tiles``): head_dim 40 in the interpreter (tiles of 32 rows below 256 tokens), 128
    on the GPU (tiles of 128; not at 24 or 40, where the forward's tiles are 64 keys)."""
    head_dim = 40 if device == "cpu" else 128
    return head_dim, fp8_tiles.fp8_bwd_tiles(64, head_dim)["SCALE_M"]


def simulated(q, k, v, causal, hadamard, smooth_k=True):
    """The float64 simulation with the kernel's tiles and rotation signs."""
    cfg = fp8_tiles.fp8_config(max(q.shape[2], k.shape[2]), q.shape[-1])
    signs = _rotation_signs(q.shape[-1], q.device) if hadamard else None
    return fp8_attention_ref(q, k, v, causal=causal, scheme="block+hadamard" if hadamard else "block",
                             block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], signs=signs, smooth_k=smooth_k)


# the default (Hadamard rotation and K smoothing) and neither
SCHEMES = pytest.mark.parametrize("hadamard, smooth_k", [(True, True), (False, False)], ids=["default", "plain"])


@pytest.mark.usefixtures("poison_allocations")
@SCHEMES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_error_is_the_schemes_error(shape, causal, hadamard, smooth_k, device):
    """Error against exact attention within 10% (+1e-3) of the simulated scheme's, and close to the simulation."""
    q, k, v = make(shape, device)
    out = flash_attention(q, k, v, causal=causal, fp8="forward", hadamard=hadamard, smooth_k=smooth_k)
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    exact = attention_ref(q, k, v, causal=causal)[0].double()  # float64 math on the fp16 inputs
    sim = simulated(q, k, v, causal, hadamard, smooth_k)
    err, sim_err = rel_error(out, exact), rel_error(sim, exact)
    assert err <= 1.1 * sim_err + 1e-3, (err, sim_err)
    assert rel_error(out, sim) <= max(sim_err, 1e-3), (rel_error(out, sim), sim_err)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_outlier_benchmark(head_dim, device):
    """FlashAttention-3's accuracy benchmark (N(0, 1) with 0.1% outliers from N(0, 100)): the kernel with block
    scales + Hadamard (the default) is clearly below the per-tensor FP8 baseline, and the rotation lowers its
    error. (Block scales alone are not below the baseline: with power-of-two scales a tile's largest value,
    the outlier, is rounded, where the per-tensor baseline's amax / 448 stores it exactly.)"""
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (outlier_data((1, 2, 256, head_dim), gen, torch.float16).to(device) for _ in range(3))
    exact = attention_ref(q, k, v)[0].double()

    def rmse(x):
        return ((x.double() - exact) ** 2).mean().sqrt().item()

    baseline = rmse(fp8_attention_ref(q, k, v, scheme="tensor"))
    rotated = rmse(flash_attention(q, k, v, fp8="forward", smooth_k=False))
    plain = rmse(flash_attention(q, k, v, fp8="forward", hadamard=False, smooth_k=False))
    default = rmse(flash_attention(q, k, v, fp8="forward"))  # K smoothing: no shared component here to remove
    assert rotated < plain and rotated < 0.9 * baseline and default < 0.9 * baseline, (rotated, plain, default,
                                                                                       baseline)


@pytest.mark.parametrize("smoothing_keys", [256, 16], ids=["every_key", "every_8th_key"])
def test_smoothing_keys_with_a_shared_component(smoothing_keys, device, monkeypatch):
    """Keys that share a component (as trained models' keys do: a per-channel mean over the sequence): the
    forward's error and fp8="full"'s dQ error grow with it unless K is smoothed (smooth_k, the default), and
    the returned LSE, corrected back, stays exact attention's up to the FP8 error, gradient included. With the
    mean of all 128 keys, and of every 8th (``fp8_tiles.SMOOTHING_KEYS`` 16, as 4096 keys take every 16th)."""
    monkeypatch.setattr(fp8_tiles, "SMOOTHING_KEYS", smoothing_keys)
    monkeypatch.setattr(reference, "SMOOTHING_KEYS", smoothing_keys)  # the reference restates it
    q, k, v = make((1, 2, 2, 128, 128, 64), device, dtype=torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    k = (k + 3 * torch.randn(1, 2, 1, 64, generator=gen).to(device)).half().requires_grad_()
    q, v = q.half().requires_grad_(), v.half().requires_grad_()
    dout = make((1, 2, 2, 128, 128, 64), device, seed=5)[0]
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    dq_ref = torch.autograd.grad(out_ref, q, dout, retain_graph=True)[0]
    dlse_ref = torch.autograd.grad(lse_ref.sum(), (q, k))
    errors = {}
    for smooth_k in (True, False):
        out = flash_attention(q, k, v, causal=True, fp8="forward", smooth_k=smooth_k)
        out_full = flash_attention(q, k, v, causal=True, fp8="full", smooth_k=smooth_k)
        dq_full = torch.autograd.grad(out_full, q, dout)[0]
        errors[smooth_k] = rel_error(out, out_ref), rel_error(dq_full, dq_ref)
    (out_err, dq_err), (out_err_plain, dq_err_plain) = errors[True], errors[False]
    assert out_err < 0.7 * out_err_plain and dq_err < 0.5 * dq_err_plain, errors
    for mode in ("forward", "full"):
        out, lse = flash_attention(q, k, v, causal=True, fp8=mode, return_lse=True)
        assert (lse.double() - lse_ref).abs().max() < 0.1, mode  # 0.04 measured; uncorrected it would be off by ~3
        dlse = torch.autograd.grad(lse.sum(), (q, k))  # dk: through the kernels and through the correction
        errors = rel_error(dlse[0], dlse_ref[0]), rel_error(dlse[1], dlse_ref[1])
        assert errors[0] < 5e-2 and errors[1] < 0.1, (mode, errors)  # 0.4%, 3.7% measured ("forward")


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_mode_gradients(causal, device):
    """fp8="forward": the 16-bit backward on the forward's (dequantised) scores, so the gradients are exact
    attention's up to the FP8 error of the scores, the output and the LSE (a few percent at most)."""
    q, k, v = make((1, 4, 2, 37, 53, 40), device, requires_grad=True)
    out = flash_attention(q, k, v, causal=causal, fp8="forward")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attention_ref(q, k, v, causal=causal)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == r.dtype and torch.isfinite(g).all(), name
        assert rel_error(g, r) < 5e-2, (name, rel_error(g, r))


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("smooth_k, hadamard", [(True, True), (False, False), (True, False)],
                         ids=["smooth_rotated", "plain", "smooth_unrotated"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_full_backward_reads_the_forwards_fp8(causal, smooth_k, hadamard, device, monkeypatch):
    """fp8="full"'s backward takes the forward's FP8 Q and K (both layouts) where the forward quantised them in its
    tiles: the gradients are bit-identical to those of the backward quantising Q and K itself (the same kernel
    with the same arguments), and the forward's output to fp8="forward"'s (Q's all-zero tile, scale 0 for the
    backward, gives the same scores as scale 1). GQA, a ragged tail, an all-zero Q tile, head_dim 40 (128 on the
    GPU: ``reuse_geometry``)."""
    from flashtrain.ops import fp8 as fp8_module

    head_dim, tile = reuse_geometry(device)
    q, k, v = make((1, 2, 1, tile + 38, tile + 51, head_dim), device, requires_grad=True)
    q = q.detach().clone()
    q[:, :, :tile] = 0  # one all-zero Q tile
    q.requires_grad_()
    dout = torch.randn_like(q)
    kwargs = dict(causal=causal, smooth_k=smooth_k, hadamard=hadamard)
    reads = []
    real = fp8_module._backward_reads_forward_tiles
    monkeypatch.setattr(fp8_module, "_backward_reads_forward_tiles", lambda *a: reads.append(real(*a)) or reads[-1])
    out = flash_attention(q, k, v, fp8="full", **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert reads == [True]
    monkeypatch.setattr(fp8_module, "_backward_reads_forward_tiles", lambda *a: False)
    out_again = flash_attention(q, k, v, fp8="full", **kwargs)
    grads_again = torch.autograd.grad(out_again, (q, k, v), dout)
    assert torch.equal(out, out_again) and torch.equal(out, flash_attention(q, k, v, fp8="forward", **kwargs))
    for name, g, h in zip(("dq", "dk", "dv"), grads, grads_again):
        assert torch.isfinite(g).all() and torch.equal(g, h), name


@pytest.mark.parametrize("mode", ["forward", "full"])
def test_gradient_through_the_lse_alone(mode, device):
    """Only the LSE used: eager mode sends the backward no output gradient (None, not a zero tensor for each output
    without a gradient), and the gradients are those with an explicit zero output gradient."""
    q, k, v = make((1, 2, 1, 37, 45, 24), device, requires_grad=True)
    out, lse = flash_attention(q, k, v, causal=True, fp8=mode, return_lse=True)
    alone = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    out, lse = flash_attention(q, k, v, causal=True, fp8=mode, return_lse=True)
    with_zero = torch.autograd.grad((lse.sum(), out), (q, k, v), (None, torch.zeros_like(out)))
    assert alone[2] is None or torch.equal(alone[2], torch.zeros_like(v))
    for a, b in zip(alone[:2], with_zero[:2]):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("mode, tol", [("forward", 2e-3), ("full", 1e-2)])
def test_backward_recomputes_the_forwards_probabilities(mode, tol, device):
    """The backward's P is the forward's: its rows sum to one under the forward's LSE. Read through dV = P^T dO:
    the key sum of dV is sum_i c_i dO_i, with c_i the row sums, so it must equal the row sum of dO. Scores 8x
    sharper than N(0, 1) inputs give (where P recomputed from the unquantised Q and K, the first version of
    fp8="forward", had row sums of 0.3-2.3 and a 6% deviation here, and gpt2-small training diverged)."""
    q, k, v = make((1, 2, 2, 96, 96, 64), device, requires_grad=True)
    q = (q.detach() * 8).requires_grad_()
    dout = (torch.rand(1, 2, 96, 1) * torch.randn(64)).to(device=device, dtype=q.dtype)  # rows w_i * u, w_i > 0
    out = flash_attention(q, k, v, causal=True, fp8=mode)
    dv = torch.autograd.grad(out, v, dout)[0]
    assert rel_error(dv.double().sum(2), dout.double().sum(2)) < tol


@pytest.mark.parametrize("mode, saved_fp8", [("forward", 2), ("full", 4)])
def test_forward_mode_saves_the_fp8_q_and_k(mode, saved_fp8, device):
    """Both modes keep the forward's quantised Q and K for their backward, not Q and K: fp8="forward" in one
    layout (one byte per element), "full" in both where its backward's tiles are the forward's
    (``reuse_geometry``: as many bytes as Q and K)."""
    q, k, v = make((1, 2, 2, 40, 40, reuse_geometry(device)[0]), device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = flash_attention(q, k, v, causal=True, fp8=mode)
    assert sum(t.dtype == torch.float8_e4m3fn for t in saved) == saved_fp8
    assert not any(t is q or t is k for t in saved)
    torch.autograd.grad(out.sum(), (q, k, v))  # and the backward runs from them


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_full_backward_on_q_and_k_quantised_to_16(causal, device):
    """The FP8 backward kernels on Q and K quantised to FP8_SCORES_AMAX (what the FP8 Hopper forward hands
    fp8="full"'s backward at head_dim 128, where it sums the scores in float16; only the GPU takes that path
    through the op): gradients equal the float64 simulation with scores_amax=16, as test_full_backward's with
    448 (within 2e-2 on CUDA, whose tensor cores sum FP8 products in ~14 bits: test_full_backward). GQA, a ragged
    tail, an all-zero Q tile, head_dim 40, the rotation."""
    from flashtrain.kernels.fp8.bwd import attention_fp8_bwd
    from flashtrain.kernels.attention.fwd import LOG2E
    from flashtrain.kernels.fp8.quant import quantize_scores_operands

    rows = fp8_tiles.fp8_bwd_tiles(64, 40)["SCALE_M"]  # rows per Q scale tile: 32 in the interpreter, 128 on the GPU
    shape = (1, 4, 2, rows + 38, rows + 51, 40)
    q, k, v = make(shape, device)
    q[:, :, :rows] = 0
    dout = make(shape, device, seed=1)[0]
    out, lse = flash_attention(q, k, v, causal=causal, fp8="forward", smooth_k=False, return_lse=True)
    signs = _rotation_signs(40, q.device)
    tiles = fp8_tiles.fp8_bwd_tiles(shape[4], signs.numel())
    amax = hopper_tiles.FP8_SCORES_AMAX
    quantized = quantize_scores_operands(q, k, tiles["SCALE_M"], tiles["SCALE_N"], signs, amax_to=amax,
                                         both_layouts=True)
    assert quantized[1][:, :, 0].eq(0).all()  # the all-zero tile's scale: 0, as the backward's units need
    dq, dk, dv, _ = attention_fp8_bwd(dout, q.new_empty(0), k.new_empty(0), v, out, lse.float() * LOG2E, None,
                                      causal, 40 ** -0.5, signs, quantized=quantized)
    sim = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=tiles, causal=causal, signs=signs, scores_amax=amax)
    tol = 2e-2 if device == "cuda" else 2e-3
    for name, g, s_ in zip(("dq", "dk", "dv"), (dq, dk, dv), sim):
        assert torch.isfinite(g).all() and rel_error(g, s_) < tol, (name, rel_error(g, s_))


def test_full_backward_reuses_the_forwards_key_mean(device, monkeypatch):
    """K smoothing's mean of the keys is taken once for a forward and "full" backward: the backward centres K
    with the forward's (an output of the op), the same bits as taking it again."""
    from flashtrain.ops import fp8
    q, k, v = make((1, 2, 1, 37, 45, 40), device, requires_grad=True)
    dout = make((1, 2, 2, 37, 45, 40), device, seed=1)[0]
    ref = torch.autograd.grad(flash_attention(q, k, v, fp8="full"), (q, k, v), dout)
    calls = []
    real = fp8._smoothing_mean
    monkeypatch.setattr(fp8, "_smoothing_mean", lambda x: calls.append(x.data_ptr()) or real(x))
    grads = torch.autograd.grad(flash_attention(q, k, v, fp8="full"), (q, k, v), dout)
    assert calls == [k.data_ptr()]
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))


@pytest.mark.usefixtures("poison_allocations")
@SCHEMES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES + EVEN_SHAPES, ids=str)
def test_full_backward(shape, causal, hadamard, smooth_k, device):
    """fp8="full": gradients equal the float64 simulation of the same FP8 backward (given the kernel forward's
    output and LSE) up to fp32 accumulation order and the fp16 rounding of the result (2e-3 in the
    interpreter), and exact attention's gradients within 0.1 (FP8: 4-7% relative error measured on these shapes).

    On the GPU the bound against the simulation is 2e-2: Hopper's FP8 MMAs accumulate with a mantissa of about
    14 bits, not fp32's 24, so the recomputed scores and dP differ from the float64 simulation by ~1e-4
    relative (a 64 / 128-term FP8 dot is 7.6e-5 / 1.3e-4 RMS from exact on the H200), and some of P's and dS's
    e4m3 roundings go the other way (each a step of up to 6%). Measured on the H200: up to 1.1e-2 on these tiny
    shapes."""
    q, k, v = make(shape, device, requires_grad=True)
    dout = make(shape, device, seed=1)[0]
    out, lse = flash_attention(q, k, v, causal=causal, fp8="full", hadamard=hadamard, smooth_k=smooth_k,
                               return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    signs = _rotation_signs(q.shape[-1], q.device) if hadamard else None
    tiles = fp8_tiles.fp8_bwd_tiles(max(q.shape[2], k.shape[2]), q.shape[-1] if signs is None else signs.numel())
    sim = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=tiles, causal=causal, signs=signs, smooth_k=smooth_k)
    ref = attention_ref(q, k, v, causal=causal)[0]
    exact = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, s, e in zip(("dq", "dk", "dv"), grads, sim, exact):
        assert g.dtype == q.dtype and g.shape == e.shape and torch.isfinite(g).all(), name
        assert rel_error(g, s) < (2e-2 if device == "cuda" else 2e-3), (name, rel_error(g, s))
        assert rel_error(g, e) < 0.1, (name, rel_error(g, e))


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_full_backward_with_large_q_tiles(causal, device):
    """Q of magnitude 1000 (tile scales of 8 and 16): dK's quantisation factor q_scale / unit overflowed where the
    unit sat at its floor (2^-126), and a zero dS row (a key no query of the tile sees: causal) times infinity
    was NaN, a NaN dK row on the GPU. The interpreter's e4m3 conversion turns NaN into +-384, so there numpy is
    asked to raise where a NaN is made. Gradients finite and equal to the float64 simulation as in
    test_full_backward. float32 inputs; K scaled by 1/1000, so that the scores are those of N(0, 1) inputs (the
    GPU's FP8 sums keep ~14 bits, test_full_backward: with scores 1000x larger their error grows 1000x, dQ 0.11
    from the simulation on the H200)."""
    import numpy as np

    shape = (1, 2, 1, 70, 83, 40)
    q, k, v = make(shape, device, dtype=torch.float32)
    q = (q * 1000).requires_grad_()
    k = (k / 1000).requires_grad_()
    v.requires_grad_()
    dout = make(shape, device, dtype=torch.float32, seed=1)[0]
    out, lse = flash_attention(q, k, v, causal=causal, fp8="full", hadamard=False, smooth_k=False, return_lse=True)
    with np.errstate(invalid="raise"):
        grads = torch.autograd.grad(out, (q, k, v), dout)
    sim = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=fp8_tiles.fp8_bwd_tiles(83, 40), causal=causal)
    for name, g, s_ in zip(("dq", "dk", "dv"), grads, sim):
        assert torch.isfinite(g).all() and rel_error(g, s_) < (2e-2 if device == "cuda" else 2e-3), name


def full_backward_and_references(q, k, v, dout, causal):
    """fp8="full" (default rotation and smoothing): the gradients of q, k, v for dout, the float64 simulation's of
    the same scheme, and exact attention's."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, causal=causal, fp8="full", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    signs = _rotation_signs(q.shape[-1], q.device)
    tiles = fp8_tiles.fp8_bwd_tiles(max(q.shape[2], k.shape[2]), signs.numel())
    sim = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=tiles, causal=causal, signs=signs, smooth_k=True)
    exact = torch.autograd.grad(attention_ref(q, k, v, causal=causal)[0], (q, k, v), dout)
    return grads, sim, exact


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_full_backward_with_empty_and_scaled_tiles(causal, device):
    """The dK/dV kernel keeps dK and dV in running units of the tiles' scales: an all-zero dO or Q tile (scale 0)
    must not become the unit (with scale 1, as the forward's quantisation reports it, dV of these small gradients
    would round to zero), and a tile 1000x smaller than the others stays finite and exact where zero. Gradients
    against the float64 simulation and exact attention as in test_full_backward; float32 inputs, so that the
    small gradients are not lost to fp16's subnormals."""
    shape = (1, 2, 1, 96, 128, 40)
    q, k, v = make(shape, device, dtype=torch.float32)
    dout = make(shape, device, dtype=torch.float32, seed=1)[0] * 1e-3  # small gradients: tile scales well below 1
    q[:, :, 32:64] = 0.0  # the interpreter's scale tiles are 32 rows
    dout[:, :, :32] = 0.0
    dout[:, :, 64:] *= 1e-3
    grads, sim, exact = full_backward_and_references(q, k, v, dout, causal)
    for name, g, s, e in zip(("dq", "dk", "dv"), grads, sim, exact):
        assert torch.isfinite(g).all(), name
        assert rel_error(g, s) < (2e-2 if device == "cuda" else 2e-3), (name, rel_error(g, s))
        assert rel_error(g, e) < 0.1, (name, rel_error(g, e))
    assert torch.equal(grads[0][:, :, :32], torch.zeros_like(grads[0][:, :, :32]))  # dO = 0 there: dS = 0


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("sharpness, dout_scale", [(8.0, 1e-7), (1.0, 1e-36)], ids=["sharp", "tiny_dout"])
def test_full_backward_with_scales_below_fp32_normal_range(sharpness, dout_scale, device):
    """Where P is tiny (keys far below their queries' max score) and the gradient small, as in training (dO ~1e-7),
    a key's dS over a query tile falls below ~5e-36: its scale times q_scale was then below fp32's normal range,
    1 / unit infinite, and the whole dK NaN (gpt2-small-h128 at step 134 of 300 on the H200). Every scale is now at least 2^-126: gradients finite, and against the float64
    simulation and exact attention as in test_full_backward. float32 inputs (fp16 would flush the gradients)."""
    shape = (1, 2, 1, 128, 128, 64)
    q, k, v = make(shape, device, dtype=torch.float32)
    q, k = q * sharpness, k * sharpness  # scores ~64x N(0, 1)'s at 8: most probabilities far below 2^-100
    dout = make(shape, device, dtype=torch.float32, seed=1)[0] * dout_scale
    grads, sim, exact = full_backward_and_references(q, k, v, dout, causal=True)
    for name, g, s, e in zip(("dq", "dk", "dv"), grads, sim, exact):
        assert torch.isfinite(g).all(), name
        assert rel_error(g, s) < (2e-2 if device == "cuda" else 2e-3), name  # (float64 norms: no underflow)
        if sharpness == 1.0:  # at 8x the FP8 scores' rounding dominates (the forward's error is ~0.3 there)
            assert rel_error(g, e) < 0.1, name


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("magnitude", [1e-21, 1e-30, 1e-37], ids=str)
def test_scores_scale_below_fp32_range(magnitude, causal, device):
    """Q and K both of this magnitude: their tile scales' product with the softmax scale underflows fp32, and a
    masked score (-inf; the ragged tail, the causal mask) times that 0 was NaN, so was the whole output. The
    scores' scale is now at least 2^-126 (the scores stay below 2^-100: the same probabilities). Output and
    gradients finite; the output as close to exact attention as the float64 simulation of the scheme, the
    gradients of fp8="full" as in test_full_backward. float32 inputs (16-bit ones cannot hold 1e-37 or 1e-30)."""
    shape = (1, 2, 1, 37, 45, 40)
    q, k, v = make(shape, device, dtype=torch.float32)
    q, k = q * magnitude, k * magnitude
    out = flash_attention(q, k, v, causal=causal, fp8="forward")
    exact = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
    sim = simulated(q, k, v, causal, hadamard=True)
    assert torch.isfinite(out).all()
    assert rel_error(out, exact) <= 1.1 * rel_error(sim, exact) + 1e-3, (rel_error(out, exact), rel_error(sim, exact))
    dout = make(shape, device, dtype=torch.float32, seed=1)[0]
    grads, sim_grads, exact_grads = full_backward_and_references(q, k, v, dout, causal=causal)
    for name, g, s, e in zip(("dq", "dk", "dv"), grads, sim_grads, exact_grads):
        assert torch.isfinite(g).all(), name
        assert rel_error(g, s) < (2e-2 if device == "cuda" else 2e-3), name
        assert rel_error(g, e) < 0.1, name


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["forward", "full"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("head_dim, hopper", [(64, "never"), (128, "never"), (128, "always"), (256, "always")],
                         ids=str)
def test_nan_inputs_give_the_16_bit_paths_nan_outputs(head_dim, hopper, where, mode):
    """A NaN in Q, K or V makes the FP8 forward's outputs NaN where the 16-bit path's are (one query's row, every
    row, one column), through the Triton and the Hopper FP8 kernels; it used to be quantised to a finite e4m3."""
    q, k, v = make((1, 2, 2, 256, 256, head_dim), "cuda", torch.bfloat16)
    {"q": q, "k": k, "v": v}[where][0, 0, 3, 5] = float("nan")
    with dispatch.hopper_forward(hopper):
        out = flash_attention(q, k, v, fp8=mode)
    expected = flash_attention(q, k, v).isnan()
    assert expected.any() and torch.equal(out.isnan(), expected)


def test_zero_inputs_and_rows_that_see_no_key(device):
    """All-zero tiles quantise with scale 1 (no 0/0); causal rows with no key give zeros, not NaN."""
    q, k, v = make((1, 2, 2, 40, 9, 16), device)
    out = flash_attention(q, k.zero_(), v.zero_(), causal=True, fp8="forward")
    assert torch.equal(out, torch.zeros_like(out))
    q, k, v = make((1, 2, 2, 40, 9, 16), device)
    out, lse = flash_attention(q, k, v, causal=True, fp8="forward", return_lse=True)
    assert torch.equal(out[:, :, :31], torch.zeros_like(out[:, :, :31])) and torch.isneginf(lse[:, :, :31]).all()
    assert torch.isfinite(out[:, :, 31:]).all() and torch.isfinite(lse[:, :, 31:]).all()
    exact = attention_ref(q, k, v, causal=True)[1]
    assert (lse[:, :, 31:].double() - exact[:, :, 31:]).abs().max() < 0.1


@pytest.mark.parametrize("kwargs, error, words", [
    ({"fp8": "fwd"}, ValueError, ["fp8='fwd'", "'forward'"]),
    ({"fp8": "forward", "hadamard": 1}, TypeError, ["hadamard must be a bool"]),
    ({"fp8": "forward", "smooth_k": None}, TypeError, ["smooth_k must be a bool"]),
    ({"fp8": "forward", "dropout_p": 0.1}, ValueError, ["does not support", "dropout_p"]),
    ({"fp8": "full", "key_padding_mask": torch.zeros(1, 8, dtype=torch.bool)}, ValueError, ["key_padding_mask"]),
])
def test_bad_fp8_arguments(kwargs, error, words, device):
    q, k, v = make((1, 2, 2, 8, 8, 16), device)
    with pytest.raises(error) as info:
        flash_attention(q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def test_fp8_input_dtypes(device):
    """float32 inputs are quantised like half ones (the trainer's CPU runs are float32); float64 is refused."""
    q, k, v = make((1, 2, 2, 19, 23, 16), device, dtype=torch.float32)
    out = flash_attention(q, k, v, fp8="forward")
    assert out.dtype == torch.float32
    assert rel_error(out, attention_ref(q, k, v)[0]) < 0.1
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        flash_attention(q.double(), k.double(), v.double(), fp8="forward")


def test_scale_argument(device):
    q, k, v = make((1, 2, 1, 21, 33, 24), device)
    out = flash_attention(q, k, v, fp8="forward", scale=0.3)
    exact = attention_ref(q, k, v, scale=0.3)[0].double()
    sim = fp8_attention_ref(q, k, v, scale=0.3, block_m=fp8_tiles.fp8_config(33, 24)["BLOCK_M"],
                            block_n=fp8_tiles.fp8_config(33, 24)["BLOCK_N"], signs=_rotation_signs(24, q.device),
                            smooth_k=True)
    assert rel_error(out, exact) <= 1.1 * rel_error(sim, exact) + 1e-3
    assert not math.isclose(rel_error(out, exact), 0.0)


def test_fp8_hopper_launcher_checks_the_q_tiles():
    """The FP8 Hopper forward reads one Q scale per tile of 128 rows: scales of other tiles are refused on the
    host, with the shapes named (checked before anything is launched, so this runs on the CPU)."""
    from flashtrain.kernels.hopper.fp8_fwd import attention_fp8_fwd_hopper

    q8 = torch.zeros(1, 2, 300, 128, dtype=torch.float8_e4m3fn)
    vt8 = torch.zeros(1, 2, 128, 320, dtype=torch.float8_e4m3fn)
    k_scales = torch.ones(1, 2, 3)
    q_scales_of_64_rows = torch.ones(1, 2, 5)
    out, lse = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16), torch.empty(1, 2, 300)
    with pytest.raises(ValueError, match=r"q_scales: expected one scale per tile of 128 query rows, 3 for "
                                         r"seq_q=300; got shape \(1, 2, 5\)"):
        attention_fp8_fwd_hopper(q8, q_scales_of_64_rows, q8, k_scales, vt8, k_scales, out, lse, True, 0.1, 128)


def test_fp8_hopper_rescale_skip_tests_one_register_per_row():
    """The skipped rescale's asm (``_rows_unless_one_asm``, written on the host) on the wgmma accumulator's register
    bases (register bit 0: the next column, bit 1: row + 8, bits 2-5: columns 8, 16, 32, 64): it tests the factors
    of registers 0 and 2 (a thread's two rows) and no other, multiplies all 64 registers in place, behind one
    warp-uniform branch; its constraints tie each output to its input. (Its effect, bit for bit, is a GPU test.)"""
    from flashtrain.kernels.hopper.fp8_fwd import _rows_unless_one_asm, _rows_unless_one_constraints

    layout = types.SimpleNamespace(reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64], [0, 128]])
    asm = _rows_unless_one_asm(layout, 64)
    assert re.findall(r"setp\.neu(?:\.or)?\.f32 p, \$(\d+)", asm) == ["128", "130"]
    assert asm.count("mul.f32") == 64 and "mul.f32 $63, $63, $191;" in asm
    assert asm.count("vote.sync.any.pred") == 1 and asm.count("bra.uni") == 1
    constraints = _rows_unless_one_constraints(64).split(",")
    assert constraints[:64] == ["=f"] * 64 and constraints[64:128] == [str(i) for i in range(64)]
    assert constraints[128:] == ["f"] * 64


@pytest.mark.usefixtures("poison_allocations")
def test_causal_launch_sections(device, monkeypatch):
    """The FP8 forward's and ``"full"`` backward's causal blocks in launch sections of (batch, head) pairs
    (``masking.causal_sections``): the same output, LSE and gradient bits as head by head, 8 query-head pairs
    (GQA: 4 KV-head pairs) of 3 query blocks (dK/dV: 3 key blocks) in 1 section, 3 and by the rule."""
    q, k, v = make((2, 4, 2, 70, 90, 24), device, requires_grad=True)
    dout = torch.randn_like(q)

    def run(count):
        monkeypatch.setattr(masking, "CAUSAL_SECTIONS", count)
        out, lse = flash_attention(q, k, v, causal=True, fp8="full", return_lse=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    head_by_head = run(8)  # the override is capped at each kernel's pair count
    for sections in (1, 3, None):
        for got, expected in zip(run(sections), head_by_head):
            assert torch.isfinite(got).all() and torch.equal(got, expected), sections
