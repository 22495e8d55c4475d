"""FP8 attention: ``flash_attention(..., fp8="forward")``, and its building blocks (per-tile e4m3
quantisation, randomised Hadamard incoherent processing).

Numerics:

* Format: e4m3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, largest finite value 448,
  relative rounding error at most 2^-4 for normal values, absolute spacing 2^-9 below 2^-6 (subnormals).
* Scales: one float32 scale per (batch, head, tile of rows), the tile the attention kernel loads:
  scale = amax(|tile|) / 448 rounded up to a power of two, so the tile's largest value lands in (224, 448]
  and nothing overflows; being a power of two, q * scale is exact in bfloat16 (see ``fp8="forward"``). An
  all-zero tile gets scale 1 and quantises to zeros (no NaN). Every scale is at least 2^-126, fp32's smallest
  normal value, so 1 / scale stays finite: a tile with amax < ~5e-36 quantises to e4m3's subnormals or zeros.
  Dequantisation is q * scale.
* Rounding: round to nearest, ties to even, bit-identical to torch's own conversion: the GPU's cast does it,
  and in Triton's interpreter ``flashtrain.kernels.fp8_quant`` rounds onto the e4m3 grid before the cast.
* Non-finite inputs: a tile's amax leaves NaNs out; a NaN is quantised to e4m3's NaN, and an infinite value (its
  tile's scale then infinite) to NaN as well, so they reach the output where the 16-bit path's NaNs are.
* Incoherent processing: Q and K are multiplied by the same orthogonal matrix M = diag(signs) H / sqrt(d')
  (Sylvester Hadamard H, random +-1 signs, head_dim zero-padded to d' = next power of two). Q M (K M)^T
  = Q K^T in exact arithmetic; in FP8 it spreads outlier channels over all channels, so per-tile scales are
  set by typical values rather than by the outlier. The rotated values are rounded to the input dtype before
  they are quantised. Where Q and K are rotated and quantised (the forward, ``fp8="full"``'s backward) the
  rotation runs inside the quantisation kernel, as matmuls with the +-1 matrix diag(signs) H (exact products,
  fp32 sums; at d' = 256 two with H_128, H_256 = [[H_128, H_128], [H_128, -H_128]], each with its half of the
  signs; 32-bit inputs there, and 64-bit ones at every width, by the butterfly); that gives the bits of the fast
  Walsh-Hadamard transform kernel (``flashtrain.kernels.hadamard``, O(d log d)) wherever fp32 holds the sums
  exactly (16-bit inputs: nearly always). The inverse (dQ and dK back, the gradient) is the transform kernel's
  butterfly: its own pass in ``fp8="forward"``'s backward, inside the FP8 kernels in ``fp8="full"``'s.
* K smoothing (``smooth_k``, on by default): before the quantisation, K loses a vector m, the mean of a sample
  of its keys (per batch and KV head, in fp32: every (N // 256)-th key from key 0, 256 to 511 of them, all keys
  below 512); with the rotation, its rotated rows lose the rotated m, in fp32, and are
  rounded once to the input dtype: the same in exact arithmetic, and K's rows enter the rotation's matmul as
  loaded; without it, the difference is rounded to the input dtype. Each query's scores move by one constant,
  -scale * q_i . m, which softmax ignores for any m, so the output is unchanged in exact arithmetic; the LSE
  moves by that constant and is corrected back when returned (fp32). The sample's mean is within about
  std / 16 of the full one per channel (std of the keys' own spread), far below the component it removes, and
  it spares the op a read of all of K (``configs.SMOOTHING_KEYS``).
  Without it, a component all keys share (trained transformers' keys often have one; SageAttention, Zhang et
  al. 2024, smooths K for the same reason) sets the tiles' scales and coarsens the rounding of what tells the
  keys apart, and in ``fp8="full"`` it multiplies dS's rounding error in dQ = dS K: dS's rows sum to zero, so
  exact dQ cancels the shared component, while the rounding errors do not cancel. Measured through Triton's
  interpreter with keys N(0, 1) plus 3x a shared N(0, 1) vector (128 tokens, head_dim 64, causal, fp16: the
  setting of tests/test_attention_fp8.py::test_smoothing_keys_with_a_shared_component), error against exact
  attention: output 8.1% -> 4.5%, ``"full"``'s dQ 20% -> 6.6%, dK 9.3% -> 6.6%, dV 8.2% -> 4.7%, the LSE
  0.26 -> 0.04 (largest absolute error). Without a shared component the errors stay within 4% of the
  unsmoothed ones (``"full"``'s dV 4.7% -> 4.8%, the LSE 0.049 -> 0.042). The subtraction runs inside the
  quantisation kernel (after its rotation). In the backward, dK is centred over all keys (``kernels.centring``:
  one pass; in ``fp8="full"`` its mean from the dK kernel's per-program key sums; in ``fp8="forward"``'s,
  inside the inverse rotation's pass): the output's exact dK sums to zero over the keys, so that takes off
  the part of the rounding error all keys share; the LSE's exact dK sums to scale * sum_i dlse_i q_i, which
  the returned LSE's correction puts back through plain autograd (its term q_i . m has m's value and the
  gradient of the mean over all keys).
* Forward (``flashtrain.kernels.attention_fp8_fwd``): Q (rotated), K (rotated) and V are quantised per
  tile (Q in tiles of the kernel's BLOCK_M rows, K and V of BLOCK_N rows); V is quantised straight into its
  transposed layout (K-major, the layout FP8 tensor cores take for the right operand of P V). S = Q8 K8^T
  accumulates in fp32 and is scaled once by c = q_scale * k_scale * softmax_scale * log2(e), held at >= 2^-126
  (with Q and K both below ~1e-20 the product underflows fp32, and a masked score times 0 would be NaN; there
  every |Q8 K8^T| times 2^-126 is below 2^-100, as with the true c: the same probabilities). The online softmax
  runs in fp32. P = exp2(S - running max), in [0, 1], is rounded to e4m3 with the fixed scale 448 (1 -> 448)
  for P8 V8, whose fp32 product is scaled by v_scale / 448; the row sum is of the unrounded P. Output = acc /
  rowsum, cast to the input dtype; the LSE (fp32) is saved. On sm_90 at head_dim 128 and 256 (where measured
  faster, ``configs.FP8_HOPPER_FWD_MIN_SEQ``) the warp-specialised kernel
  (``flashtrain.kernels.attention_fp8_fwd_hopper``) runs instead: the same P, LSE and scales, with P8 V8
  summed into the output accumulator by the tensor core (kept in units of the current V tile's scale; the
  ratios are powers of two), which rounds the sum differently (outputs within 4e-3 of the other kernel's in
  bf16 units on the H200; the LSE bit-identical). Its V^T has the keys of each group of 32 in another order
  (the sum over keys is unchanged; see that module). At head_dim 128 it sums the scores in float16
  (``configs.FP8_HOPPER_FWD_CONFIGS``) and runs the softmax on float16 pairs: Q and K are then quantised with
  their tiles' amax in (8, 16] (``configs.FP8_SCORES_AMAX``; e4m3's subnormals start at amax / 1024), so no
  |Q8 K8^T| exceeds 128 * 16 * 16 = 32768 < 65504; the tensor core rounds each score to float16 (relative error
  ~2^-11, against e4m3's 2^-4 on every element of Q and K); the scale enters as a float16 value: the softmax
  scale * log2(e) rounded to float16 (``attention_fp8_fwd.f16_softmax_scale``, within 2^-11; the op passes that
  scale on to its LSE and backward), times the tile scales (powers of two): c, held at >= 2^-24 (below, every
  |score * c| < 2^-9 anyway); the exponent's offset is rounded down in float16, and the max it stands for is the
  row max the LSE keeps, so P448 <= 448; the exponential is ``ex2.approx.f16x2``; the row sum adds each thread's
  values in float16 (at most 32 of them, <= 448 each; the LSE within ~5e-4 of the fp32 sum's), then fp32. Where c
  > 0.99 for the rows' Q tile and some K tile of the head (``F16_C_MAX``: an exponent's argument could then leave
  float16's range; Q and K entries ~8x N(0, 1) and larger), those rows compute the argument in fp32 (c and the row
  max in fp32; the argument, <= log2(448), rounded toward zero to float16 for the exponential) on the same float16
  scores. On the H200 the output's error against float64 is within 1% of fp32 scores' (benchmarks/NOTES.md,
  twentieth and twenty-ninth sessions), and finite and as close from 1e-4x to 1e4x unit-scale inputs.
* ``fp8="forward"``: the backward runs the 16-bit kernels on the scores the forward computed: the forward
  saves its FP8 (rotated) Q and K with their scales, and the backward dequantises them (exact in the input
  dtype), so P recomputed from them and the forward's LSE is the forward's P (rows sum to one; up to the float16
  rounding of the scores where the Hopper kernel sums them in float16); V, dO and the forward's output enter
  unquantised. The gradient passes straight through the quantisation (and back
  through the rotation).
* ``fp8="full"`` (``flashtrain.kernels.attention_fp8_bwd``): Q, K, V and dO are quantised per tile of 128 rows
  on the GPU (``configs.fp8_bwd_tiles``; an all-zero Q or dO tile reports scale 0). Q and K are the forward's
  where its tiles are these (head_dim 128 and 256 on the GPU; every width in the interpreter, whose tiles are
  set so): the forward quantises them in both layouts (and Q's all-zero tiles with scale 0) and saves them,
  so the backward's scores are the forward's bits, and where the FP8 Hopper forward sums its scores in float16
  (head_dim 128) they come quantised to 16, not 448 (e4m3's subnormals then start at amax / 1024 instead of
  amax / 28672; the same 3-bit mantissa above). Elsewhere (head_dim 64 on the GPU) the backward rotates and
  quantises Q and K again, from Q and K saved in the input dtype. P is recomputed from the FP8 Q K^T and the
  forward's LSE; dP = dO8 V8^T, dS = P (dP - delta) in
  fp32 with delta = rowsum(dO8 * O) (dO8 dequantised: the dO that dP takes, so dS's rows sum closer to zero
  than with dO's own values; computed in dO's quantisation pass). dV and dK accumulate in place in fp32 (the
  tensor core's accumulator), each in a power-of-two unit, so every product lands unscaled:
  - dV = sum P8^T dO8 in units of u_V / 448, u_V the largest dO tile scale of the GQA group: P8 =
    round_e4m3(448 P do_scale / u_V), P's fixed scale 1/448 for the largest dO tiles and lower binades (down to
    e4m3's subnormals) for smaller ones;
  - dK (the dK/dV kernel's dS^T tile, BLOCK_N keys x BLOCK_M queries): per key, u_K is the running largest
    (over the query tiles so far) of c = (amax over the tile's queries of |dS| / 448, up to a power of two) x
    q_scale, and at least 2^-126; a larger c rescales the key's dK row by u_old / u_new (exact), and dS8 =
    round_e4m3(dS q_scale / u_K), which is dS over its own row scale where c is the largest. (Without the floor,
    a key whose probabilities over a query tile are ~2^-100 or less, with gradients of ~1e-7, had c below fp32's
    normal range, 1 / u_K infinite and dK NaN: gpt2-small-h128 training, benchmarks/NOTES.md, twenty-fourth
    session.);
  - dQ (the dQ kernel's dS tile, BLOCK_M queries x BLOCK_N keys): one power-of-two scale per query row over the
    key tile, dQ += (dS8 K8) x row scale x k_scale.
  dQ and dK are rotated back by the inverse Hadamard transform, in the kernels on the fp32 tiles before they are
  stored, and rounded to the input dtype (dK by its centring with smooth_k); dV is written in V's.
  ``flashtrain.reference.fp8_attention_bwd_ref`` simulates all of it in float64 (the units in the kernels'
  order); the kernels match it to 2e-3 (the fp16 rounding of the result) in Triton's interpreter and to ~1e-2
  on Hopper (next point), and exact attention's gradients to 4-7% on the tests' shapes.
* Accumulation: the FP8 products accumulate in fp32 registers, but on sm_90 Triton's default for FP8
  ``tl.dot`` (``max_num_imprecise_acc``) leaves the whole sum to the tensor core's accumulator, which keeps a
  mantissa of about 14 bits. Measured on the H200 (``benchmarks/gpu_diagnostics.py fp8acc``): a 64 / 128-term
  FP8 dot is off by 7.6e-5 / 1.3e-4 (RMS, relative) against exact, 4.6e-5 when promoted to fp32 every 32
  terms. Far below e4m3's rounding (up to 2^-4), but enough to send some of P's and dS's e4m3 roundings
  to the neighbouring value.
* ``flashtrain.reference.fp8_attention_ref`` simulates the scheme in float64 (with the global row max where
  the kernel has the running one); the kernel's error against exact attention matches the simulation's
  (tests/test_attention_fp8.py); benchmarks/NOTES.md has the simulated errors on FlashAttention-3's outlier
  benchmark.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .attention import kernel_dlse
from .kernels import configs
from .kernels.attention_bwd import attention_bwd
from .kernels.attention_fp8_bwd import attention_fp8_bwd
from .kernels.attention_fp8_fwd import attention_fp8_fwd, fp8_forward_scale, fp8_tiles
from .kernels.attention_fwd import LOG2E
from .kernels.centring import centre, seq_mean
from .kernels.configs import cdiv
from .kernels.fp8_quant import fp8_dequantize, fp8_quantize
from .kernels.hadamard import hadamard, padded_dim

__all__ = ["fp8_quantize", "hadamard_transform", "random_signs", "padded_dim", "FP8_MODES"]

FP8_MODES = (None, "forward", "full")


def random_signs(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """A fixed random +-1 vector of length padded_dim(head_dim), float32, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (padded_dim(head_dim),), generator=gen).float() * 2 - 1
    return signs.to(device) if device is not None else signs


class _HadamardTransform(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, signs):
        ctx.save_for_backward(signs)
        ctx.head_dim = x.shape[-1]
        return hadamard(x, signs)

    @staticmethod
    def backward(ctx, grad_y):
        (signs,) = ctx.saved_tensors
        # the transform is orthogonal: its gradient is its inverse, cut back to head_dim
        return hadamard(grad_y, signs, inverse=True, out_dim=ctx.head_dim), None


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) -> (..., padded_dim(head_dim)): (x * signs) @ H / sqrt(d'), differentiable in x."""
    return _HadamardTransform.apply(x, signs)


@functools.lru_cache(maxsize=None)
def _rotation_signs(head_dim: int, device: torch.device) -> Tensor:
    """The fixed random signs of the incoherent-processing rotation (seed 0): one per (head_dim, device)."""
    return random_signs(head_dim, seed=0, device=device)


def _seq_mean(x: Tensor) -> Tensor:
    """x (B, H, N, D)'s mean over the sequence, (B, H, D) in fp32."""
    return x.mean(dim=2, dtype=torch.float32)


def _smoothing_mean(k: Tensor) -> Tensor:
    """K smoothing's vector for k (B, H_kv, N, D): the mean of every ``configs.smoothing_stride(N)``-th key,
    (B, H_kv, D) in fp32. The rotation or quantisation kernel subtracts it and rounds the difference to K's dtype
    as ``_centred`` does. One kernel (``kernels.centring.seq_mean``): the value of ``_seq_mean`` of those keys up
    to the order of its fp32 sums."""
    return seq_mean(k, configs.smoothing_stride(k.shape[2]))


def _centred(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x minus ``_seq_mean(x)``, in x's dtype (or ``dtype``): what the backward does to dK with K smoothing (the
    output's exact dK sums to zero over the keys; this takes off the part of the rounding error they share):
    the mean, then one kernel pass that subtracts it in fp32 and rounds once (``kernels.centring``: the bits
    of ``(x - mean).to(dtype)``)."""
    return centre(x, _seq_mean(x), dtype)


def _backward_reads_forward_tiles(q: Tensor, k: Tensor, qk_dim: int) -> bool:
    """Whether fp8="full"'s backward quantises Q and K in the forward's tiles (``fp8_tiles``: Q per tile of
    SCALE_M rows, K per tile of SCALE_N, ``configs.fp8_bwd_tiles``), so that it can take the forward's FP8 Q and
    K instead of rotating and quantising them again: on the GPU at head_dim 128 and 256 (tiles of 128 x 128),
    not at 64 (the forward's K tiles are 64 keys)."""
    tiles = configs.fp8_bwd_tiles(max(q.shape[2], k.shape[2]), qk_dim)
    return fp8_tiles(q, k) == (tiles["SCALE_M"], tiles["SCALE_N"])


# the dtypes of the op's quantised outputs (q8, q_scales, k8, k_scales, q8_t, k8_t)
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float32) * 2 + (torch.float8_e4m3fn, ) * 2


def _padded_rows(t: Tensor) -> Tensor:
    """The whole buffer of a transposed e4m3 copy (``fp8_quantize(..., with_transposed=True)``'s third output, a
    (B, H, D, N) view with its row stride padded to 16 bytes): (B, H, D, row stride), contiguous; ``[..., :N]``
    gives the view back. What the custom op returns (an output is a whole tensor)."""
    return t.as_strided((*t.shape[:3], t.stride(2)), t.stride(), t.storage_offset())


# K smoothing runs inside the custom ops (not as torch ops around them), so that torch.compile runs the same
# code as eager mode: Inductor's own fusion of the mean would round differently, and one flipped e4m3 rounding
# changes the result's bits.
def _fp8_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, rotate: bool, fp8_backward: bool,
             smooth_k: bool) -> tuple[Tensor, ...]:
    """(out, lse, q8, q_scales, k8, k_scales, q8_t, k8_t, k_mean): the quantised (rotated) Q and K are outputs
    too (non-differentiable), so that the backward recomputes the forward's scores from them instead of
    rotating and quantising again: fp8="forward"'s (q8_t and k8_t empty) and fp8="full"'s where it reads the
    forward's tiles (``_backward_reads_forward_tiles``; q8_t and k8_t are then the transposed copies, whole
    buffers (``_padded_rows``), and an all-zero Q tile's scale is 0). Otherwise for fp8="full" all six are empty
    and its backward quantises Q and K itself. With smooth_k, the kernels see k minus k_mean and lse is the LSE
    of those scores; k_mean, ``_smoothing_mean(k)`` (empty without smooth_k), is an output for the backward that
    centres K again and for the LSE's correction."""
    # Q M (K M)^T = Q K^T for the orthogonal M: only the quantisation sees the rotation (and the centring)
    signs = _rotation_signs(q.shape[-1], q.device) if rotate else None
    k_mean = _smoothing_mean(k) if smooth_k else None
    qk_dim = q.shape[-1] if signs is None else signs.numel()
    both_layouts = fp8_backward and _backward_reads_forward_tiles(q, k, qk_dim)
    out, lse, quantized = attention_fp8_fwd(q, k, v, causal, scale, signs, k_mean, both_layouts=both_layouts)
    q8, q_scales, k8, k_scales, q8_t, k8_t = quantized
    if both_layouts:
        q8_t, k8_t = _padded_rows(q8_t), _padded_rows(k8_t)
    elif fp8_backward:
        q8, q_scales, k8, k_scales = (q.new_empty(0, dtype=t.dtype) for t in (q8, q_scales, k8, k_scales))
    if not both_layouts:
        q8_t, k8_t = (q.new_empty(0, dtype=torch.float8_e4m3fn) for _ in range(2))
    return (out, lse, q8, q_scales, k8, k_scales, q8_t, k8_t,
            q.new_empty(0, dtype=torch.float32) if k_mean is None else k_mean)


@torch.library.custom_op("flashtrain::attention_fp8_fwd", mutates_args=())
def _attention_fp8_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, rotate: bool,
                          fp8_backward: bool, smooth_k: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor, Tensor]:
    return _fp8_fwd(q, k, v, causal, scale, rotate, fp8_backward, smooth_k)


@_attention_fp8_fwd_op.register_fake
def _(q, k, v, causal, scale, rotate, fp8_backward, smooth_k):
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    k_mean = q.new_empty((*k.shape[:2], k.shape[3]) if smooth_k else (0, ), dtype=torch.float32)
    qk_dim = padded_dim(q.shape[-1]) if rotate else q.shape[-1]
    both_layouts = fp8_backward and _backward_reads_forward_tiles(q, k, qk_dim)
    if fp8_backward and not both_layouts:
        return out, lse, *(q.new_empty(0, dtype=dt) for dt in _QUANTIZED_DTYPES), k_mean
    e4m3, fp32 = torch.float8_e4m3fn, torch.float32
    quantized, transposed = [], []
    for x, block in zip((q, k), fp8_tiles(q, k)):
        batch, heads, seq = x.shape[:3]
        quantized += [x.new_empty((batch, heads, seq, qk_dim), dtype=e4m3),
                      x.new_empty((batch, heads, cdiv(seq, block)), dtype=fp32)]
        transposed.append(x.new_empty((batch, heads, qk_dim, cdiv(seq, 16) * 16) if both_layouts else (0, ),
                                      dtype=e4m3))
    return out, lse, *quantized, *transposed, k_mean


def _fp8_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
             causal: bool, scale: float, rotate: bool, smooth_k: bool, k_mean: Tensor, q8: Tensor, q_scales: Tensor,
             k8: Tensor, k_scales: Tensor, q8_t: Tensor, k8_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp8="full": FP8 gradient matmuls (kernels/attention_fp8_bwd.py) on the forward's FP8 Q and K (q8 ... k8_t,
    ``_fp8_fwd``'s outputs; q and k then empty, of the inputs' dtype), or, where those are empty, on Q and K
    rotated and quantised again (with smooth_k, K smoothed as in the forward, with the forward's k_mean: the same
    bits). dQ and dK are rotated back, and with smooth_k dK passes back through the centring."""
    # S = (Q M)(K M)^T: dQ = dQ_rot M^T, the inverse rotation (M is orthogonal), run by the kernels before they
    # store dQ and dK. With smooth_k, dK comes in fp32 with its per-program key sums, and is rounded to K's dtype
    # by its centring: one pass over it.
    signs = _rotation_signs(v.shape[-1], v.device) if rotate else None
    quantized = None
    if q8.numel():
        quantized = (q8, q_scales, k8, k_scales, q8_t[..., :q8.shape[2]], k8_t[..., :k8.shape[2]])
    dq, dk, dv, dk_sums = attention_fp8_bwd(dout, q, k, v, out, lse, dlse, causal, scale, signs,
                                            k_mean if smooth_k else None,
                                            dk_dtype=torch.float32 if smooth_k else None, key_sums=smooth_k,
                                            quantized=quantized)
    if smooth_k:
        dk = centre(dk, dk_sums.sum(dim=2) / v.shape[2], v.dtype)  # dK's mean over the keys, (B, H_kv, D) fp32
    return dq, dk, dv


@torch.library.custom_op("flashtrain::attention_fp8_bwd", mutates_args=())
def _attention_fp8_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Tensor | None, causal: bool, scale: float, rotate: bool, smooth_k: bool,
                          k_mean: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor, q8_t: Tensor,
                          k8_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _fp8_bwd(dout, q, k, v, out, lse, dlse, causal, scale, rotate, smooth_k, k_mean, q8, q_scales, k8,
                    k_scales, q8_t, k8_t)


@_attention_fp8_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, scale, rotate, smooth_k, k_mean, q8, q_scales, k8, k_scales, q8_t, k8_t):
    # the kernels' outputs are contiguous; dq has dout's shape and dk v's (q and k may be empty placeholders)
    return dout.new_empty(dout.shape), v.new_empty(v.shape), v.new_empty(v.shape)


def _fp8_forward_bwd(dout: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor, v: Tensor,
                     out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool, scale: float, rotate: bool,
                     block_m: int, block_n: int, smooth_k: bool) -> tuple[Tensor, Tensor, Tensor]:
    """fp8="forward": the 16-bit backward kernels, on the scores the FP8 forward computed.

    q8, k8 and their scales are the forward's quantised (rotated) Q and K, in tiles of block_m / block_n rows;
    dequantising them is exact in the input dtype (power-of-two tile scales). So the backward's recomputed
    probabilities are the forward's, and each row sums to one under the forward's LSE. Recomputing them from
    the unquantised Q and K instead (the first version) let rows sum to exp(LSE_exact - LSE_fp8), 0.3-2.3 on
    logits 8x sharper than N(0, 1) inputs', and gpt2-small training diverged after ~180 steps
    (benchmarks/NOTES.md). The gradient passes straight through the quantisation and back through the
    rotation (and with smooth_k, through the forward's K smoothing); dV and dP use the unquantised V and dO.
    """
    head_dim = v.shape[-1]
    q_scores = fp8_dequantize(q8, q_scales, block_m, v.dtype)
    k_scores = fp8_dequantize(k8, k_scales, block_n, v.dtype)
    pad = q_scores.shape[-1] - head_dim  # the rotation's width, when head_dim is not a power of two
    if pad:
        v, out, dout = (torch.nn.functional.pad(t, (0, pad)) for t in (v, out, dout))
    dq, dk, dv = attention_bwd(dout, q_scores, k_scores, v, out, lse, dlse, causal, scale)
    if rotate:  # with smooth_k, dK's centring runs in its inverse transform (it commutes with the rotation)
        signs = _rotation_signs(head_dim, v.device)
        dq = hadamard(dq, signs, inverse=True, out_dim=head_dim)
        dk = hadamard(dk, signs, inverse=True, out_dim=head_dim, mean=_seq_mean(dk) if smooth_k else None)
    elif smooth_k:
        dk = _centred(dk)
    return dq.contiguous(), dk.contiguous(), dv[..., :head_dim].contiguous()  # contiguous, as the fake says


@torch.library.custom_op("flashtrain::attention_fp8_forward_bwd", mutates_args=())
def _attention_fp8_forward_bwd_op(dout: Tensor, q8: Tensor, q_scales: Tensor, k8: Tensor, k_scales: Tensor,
                                  v: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, causal: bool,
                                  scale: float, rotate: bool, block_m: int, block_n: int,
                                  smooth_k: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _fp8_forward_bwd(dout, q8, q_scales, k8, k_scales, v, out, lse, dlse, causal, scale, rotate, block_m,
                            block_n, smooth_k)


@_attention_fp8_forward_bwd_op.register_fake
def _(dout, q8, q_scales, k8, k_scales, v, out, lse, dlse, causal, scale, rotate, block_m, block_n, smooth_k):
    head_dim = v.shape[-1]
    return (v.new_empty((*q8.shape[:3], head_dim)), v.new_empty((*k8.shape[:3], head_dim)),
            v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, rotate, fp8_backward, smooth_k = inputs
    out, lse, *quantized, k_mean = output
    ctx.mark_non_differentiable(*quantized, k_mean)
    q8 = quantized[0]
    if fp8_backward and q8.numel():  # the forward's FP8 Q and K in both layouts: as many bytes as Q and K
        ctx.save_for_backward(*quantized, v, out, lse)
    elif fp8_backward:  # the FP8 backward quantises Q and K in its own tiles (K centred by k_mean)
        ctx.save_for_backward(q, k, v, out, lse, k_mean)
    else:  # the forward's FP8 Q and K (half the bytes of Q and K), for its scores
        ctx.save_for_backward(*quantized[:4], v, out, lse)
        ctx.tiles = fp8_tiles(q, k)
    ctx.reads_forward_fp8 = fp8_backward and q8.numel() > 0
    ctx.causal, ctx.scale, ctx.rotate, ctx.fp8_backward, ctx.smooth_k = causal, scale, rotate, fp8_backward, smooth_k


def _backward_with(full_bwd, forward_bwd, ctx, dout, dlse2):
    """fp8="forward": the 16-bit backward kernels on the forward's scores (``forward_bwd``); fp8="full": the FP8
    kernels (``full_bwd``). Each is the custom op (compiled graphs) or its plain function (eager mode). ``dout``
    None: only the LSE was used (eager mode sends None for an output without a gradient)."""
    dlse = kernel_dlse(dlse2)
    if ctx.fp8_backward:
        if ctx.reads_forward_fp8:
            *quantized, v, out, lse2 = ctx.saved_tensors
            q, k, k_mean = v.new_empty(0), v.new_empty(0), v.new_empty(0, dtype=torch.float32)
        else:
            q, k, v, out, lse2, k_mean = ctx.saved_tensors
            quantized = (v.new_empty(0, dtype=dt) for dt in _QUANTIZED_DTYPES)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = full_bwd(dout, q, k, v, out, lse2, dlse, ctx.causal, ctx.scale, ctx.rotate, ctx.smooth_k,
                              k_mean, *quantized)
    else:
        q8, q_scales, k8, k_scales, v, out, lse2 = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = forward_bwd(dout, q8, q_scales, k8, k_scales, v, out, lse2, dlse, ctx.causal, ctx.scale,
                                 ctx.rotate, *ctx.tiles, ctx.smooth_k)
    return dq, dk, dv, None, None, None, None, None


def _backward(ctx, dout, dlse2, *_):
    return _backward_with(_attention_fp8_bwd_op, _attention_fp8_forward_bwd_op, ctx, dout, dlse2)


torch.library.register_autograd("flashtrain::attention_fp8_fwd", _backward, setup_context=_setup_context)


class _EagerFP8Attention(torch.autograd.Function):
    """The FP8 custom ops' forward and backward without torch.library's dispatch, for eager mode (as
    ``flashtrain.attention``'s 16-bit path; on the H200 this cut the host time of a forward call from 480-605
    to 290-410 us, benchmarks/NOTES.md)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, rotate, fp8_backward, smooth_k):
        output = _fp8_fwd(q, k, v, causal, scale, rotate, fp8_backward, smooth_k)
        _setup_context(ctx, (q, k, v, causal, scale, rotate, fp8_backward, smooth_k), output)
        # outputs without a gradient (the quantised Q and K, k_mean, an unused LSE) send None to the backward: with
        # autograd's default it filled a zero tensor for each, two of Q's and K's size in e4m3 (~22 us a call at
        # (4, 16, 4096, 128) on the H200, benchmarks/results/fp8_launch_map_h200_2026-12-01.csv)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse2, *_):
        return _backward_with(_fp8_bwd, _fp8_forward_bwd, ctx, dout, dlse2)


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mode: str, hadamard: bool,
                  smooth_k: bool, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """The FP8 path of ``flash_attention`` (inputs already validated there). Returns (out, log2-domain LSE),
    the LSE only if ``need_lse`` (None otherwise).

    With smooth_k the kernels see K - m (m = ``_smoothing_mean(K)``): query i's scores all move by
    -scale * q_i . m, which softmax ignores, and the LSE by the same, added back here (plain autograd: its
    gradient reaches q and k).
    """
    # where the FP8 Hopper forward sums the scores in float16 it applies the scale as a float16 value: the op and
    # its backward take that one
    scale = fp8_forward_scale(q, k, causal, scale, padded_dim(q.shape[-1]) if hadamard else q.shape[-1])
    attend = _attention_fp8_fwd_op if torch.compiler.is_compiling() else _EagerFP8Attention.apply
    out, lse, *_, k_mean = attend(q, k, v, causal, scale, hadamard, mode == "full", smooth_k)
    if not need_lse:
        return out, None
    if smooth_k:
        # q_i . k_mean per row (k_mean shared by the query heads of a GQA group): k_mean's value, with the gradient
        # of the mean of all keys. The backward centres dK over all keys: the output's exact dK sums to zero over
        # the keys, while the LSE's sums to scale * sum_i dlse_i q_i, which this term's gradient puts back.
        full_mean = _seq_mean(k)
        k_mean = k_mean + (full_mean - full_mean.detach())
        shift = torch.einsum("bhgnd,bhd->bhgn", q.float().unflatten(1, (k.shape[1], -1)), k_mean)
        lse = lse + shift.flatten(1, 2) * (scale * LOG2E)  # the log2-domain LSE, (B, H_q, N_q)
    return out, lse
