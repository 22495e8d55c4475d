"""flash_attention against the float64 PyTorch reference: forward, LSE, gradients, layouts, edge cases.

Runs on CPU through Triton's interpreter (slow: shapes stay tiny) and on CUDA when present.
"""

import math
import random

import pytest
import torch

from flashtrain import flash_attention
from flashtrain.kernels import masking
from flashtrain.ops import dispatch
from flashtrain.ops.reference import attention_ref
from flashtrain.testing import TOLERANCE, assert_close

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim): odd lengths, head dims that are not powers of two,
# GQA and MQA, seq_q != seq_k both ways (causal with seq_q > seq_k leaves rows that see no key).
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 2, 2, 17, 17, 24),
    (1, 4, 2, 37, 37, 40),
    (1, 4, 1, 37, 129, 64),
    (1, 2, 2, 129, 37, 24),
    (1, 2, 1, 129, 129, 40),
    (1, 1, 1, 17, 1, 16),
]
DTYPES = [torch.float64, torch.float32, torch.float16]


def make_qkv(shape, dtype, device, requires_grad=False, seed=0):
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen)
    return [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v)]


def check_forward(q, k, v, causal, scale=None):
    out, lse = flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, scale=scale)
    tol = TOLERANCE[q.dtype][0]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_close("out", out, ref_out, tol)
    assert_close("lse", lse, ref_lse, max(tol, 1e-6))  # lse is returned in float32
    return out


def check_backward(q, k, v, causal, scale=None):
    out = flash_attention(q, k, v, causal=causal, scale=scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_ref(q, k, v, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    tol = TOLERANCE[q.dtype][1]
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert_close(name, g, r, tol)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(shape, causal, dtype, device):
    check_forward(*make_qkv(shape, dtype, device), causal)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[4]], ids=str)
def test_backward(shape, causal, dtype, device):
    check_backward(*make_qkv(shape, dtype, device, requires_grad=True), causal)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_whole_query_blocks(causal, dtype, device):
    """seq_q a multiple of 128: the dK/dV kernel's unmasked (EVEN_M) loads, with seq_k longer (causal offset)."""
    check_backward(*make_qkv((1, 2, 1, 128, 160, 40), dtype, device, requires_grad=True), causal)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape, dtype", [(SHAPES[2], torch.float16), *((shape, torch.float64) for shape in (
    SHAPES[2], SHAPES[3], SHAPES[4], (1, 2, 1, 128, 160, 40)))], ids=str)
def test_backward_with_dk_and_dv_apart(shape, dtype, causal, device):
    """dK and dV in two launches (``dispatch.split_dkdv``): right against the reference (GQA, seq_q != seq_k,
    whole query blocks), and with the fixed tiles of the interpreter and float64 bitwise equal to one launch."""
    q, k, v = make_qkv(shape, dtype, device, requires_grad=True)
    with dispatch.split_dkdv("always"):
        check_backward(q, k, v, causal)
    dout = torch.randn(q.shape, dtype=dtype, device=device)
    with dispatch.split_dkdv("always"):
        apart = torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), dout)
    together = torch.autograd.grad(flash_attention(q, k, v, causal=causal), (q, k, v), dout)
    if device == "cpu" or dtype == torch.float64:
        for a, b in zip(apart, together):
            assert torch.equal(a, b)


@pytest.mark.usefixtures("poison_allocations")
def test_dk_and_dv_apart_with_masks_and_dropout(device):
    """The split launches with a key padding mask and dropout, and with a sliding window: each the same gradients
    as one launch (float64, fixed tiles: bitwise)."""
    q, k, v = make_qkv((2, 4, 2, 37, 45, 24), torch.float64, device, requires_grad=True)
    padding = torch.rand(2, 45, device=device) < 0.3
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    for kwargs in (dict(causal=True, key_padding_mask=padding, dropout_p=0.25), dict(window_size=(9, 4))):
        grads = []
        for mode in ("always", "never"):
            torch.manual_seed(7)
            with dispatch.split_dkdv(mode):
                grads.append(torch.autograd.grad(flash_attention(q, k, v, **kwargs), (q, k, v), dout))
        for a, b in zip(*grads):
            assert torch.equal(a, b), kwargs


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("head_dim", [100, 256])
def test_large_and_odd_head_dims(head_dim, device):
    q, k, v = make_qkv((1, 2, 1, 33, 45, head_dim), torch.float64, device, requires_grad=True)
    check_forward(q, k, v, causal=True)
    check_backward(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 5, 7, 8), (2, 2, 2, 19, 13, 16), (1, 3, 3, 18, 18, 24)], ids=str)
def test_gradcheck(shape, causal, device):
    q, k, v = make_qkv(shape, torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=causal),
                                    (q, k, v), fast_mode=True)


@pytest.mark.usefixtures("poison_allocations")
def test_gradient_through_lse(device):
    """The LSE output is differentiable too (ring attention and chunked losses combine by it).

    Not a gradcheck: the LSE is returned in float32, too coarse for finite differences at eps=1e-6;
    the analytic gradients are compared with the float64 reference's instead.
    """
    q, k, v = make_qkv((1, 4, 2, 11, 21, 16), torch.float64, device, requires_grad=True)
    weights = torch.randn(1, 4, 11, dtype=torch.float64, device=device)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad((out.sum(-1) + lse.double() * weights).sum(), (q, k, v))
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    ref_grads = torch.autograd.grad((ref_out.sum(-1) + ref_lse * weights).sum(), (q, k, v))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, 1e-6)  # the upstream dlse arrives through the float32 LSE


@pytest.mark.usefixtures("poison_allocations")
def test_strided_views(device):
    """(B, N, H, D).transpose(1, 2) views, slices of a packed QKV tensor, and a non-unit head-dim stride."""
    batch, seq, heads, head_dim = 2, 37, 4, 24
    qkv = torch.randn(batch, seq, 3, heads, head_dim, dtype=torch.float64, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D), not contiguous
    assert not q.is_contiguous()
    check_forward(q, k, v, causal=True)
    wide = torch.randn(batch, heads, seq, 2 * head_dim, dtype=torch.float64, device=device)
    q2 = wide[..., ::2]  # stride 2 along head_dim
    check_forward(q2, k, v, causal=False)
    q, k, v = (t.detach().requires_grad_() for t in (q2, k, v))
    check_backward(q, k, v, causal=True)


def test_rows_that_see_no_key(device):
    """Causal with seq_q > seq_k: the first seq_q - seq_k rows see nothing: zeros, lse -inf, finite grads."""
    q, k, v = make_qkv((1, 2, 1, 40, 9, 16), torch.float64, device, requires_grad=True)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    empty = 40 - 9
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, :empty], torch.zeros_like(q.grad[:, :, :empty]))


def test_scale(device):
    q, k, v = make_qkv((1, 2, 2, 17, 23, 24), torch.float64, device, requires_grad=True)
    check_forward(q, k, v, causal=True, scale=0.3)
    check_backward(q, k, v, causal=False, scale=0.3)
    for scale in (-0.4, 0.0):  # scales that do not commute with the row max
        check_forward(q.detach().float(), k.detach().float(), v.detach().float(), causal=True, scale=scale)
    # default is 1/sqrt(head_dim)
    assert torch.equal(flash_attention(q, k, v), flash_attention(q, k, v, scale=1 / math.sqrt(24)))


def test_backward_is_deterministic(device):
    q, k, v = make_qkv((2, 4, 2, 45, 45, 40), torch.float32, device, requires_grad=True)
    dout = torch.randn(2, 4, 45, 40, device=device)
    runs = [torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), dout) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_empty_inputs(device):
    q, k, v = make_qkv((1, 2, 2, 0, 5, 8), torch.float32, device)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 8)
    q, k, v = make_qkv((1, 2, 2, 3, 0, 8), torch.float32, device)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.usefixtures("poison_allocations")
def test_random_valid_inputs(device):
    """Shapes drawn at random (seeded) from the whole valid space, not only the hand-picked ones."""
    rng = random.Random(1234)
    for trial in range(6):
        heads_kv = rng.choice([1, 2])
        shape = (rng.randint(1, 2), heads_kv * rng.choice([1, 2, 3]), heads_kv, rng.randint(1, 70),
                 rng.randint(1, 70), rng.randint(1, 72))
        causal = rng.random() < 0.5
        scale = rng.choice([None, rng.uniform(0.05, 2.0)])
        q, k, v = make_qkv(shape, torch.float64, device, requires_grad=True, seed=trial)
        check_forward(q, k, v, causal, scale)
        check_backward(q, k, v, causal, scale)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence_tiles(causal, device):
    """Sequences of 256+ take the interpreter's large tiles (on CPU): they are checked as well."""
    q, k, v = make_qkv((1, 2, 1, 300, 257, 24), torch.float64, device, requires_grad=True)
    check_forward(q, k, v, causal)
    check_backward(q, k, v, causal)


@pytest.mark.usefixtures("poison_allocations")
def test_causal_launch_sections(device, monkeypatch):
    """Causal blocks are launched heaviest first within sections of (batch, head) pairs
    (``masking.causal_sections``): the forward's and dQ's query blocks, dK/dV's key blocks. The sections only
    decide which program computes which block, so the output, LSE and gradients are the same bits as head by
    head (a section a pair). 8 query-head pairs (GQA: 4 KV-head pairs) of 3 query blocks in the interpreter's
    32-row tiles (dK/dV: 3 key blocks of 32), in one section, in 3 (of 3, 3 and 2 pairs; dK/dV 2, 1 and 1) and
    by the rule."""
    q, k, v = make_qkv((2, 4, 2, 70, 90, 24), torch.float32, device, requires_grad=True)
    dout = torch.randn_like(q)

    def run(count):
        monkeypatch.setattr(masking, "CAUSAL_SECTIONS", count)
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    head_by_head = run(8)  # the override is capped at each kernel's pair count
    for sections in (1, 3, None):
        for got, expected in zip(run(sections), head_by_head):
            assert torch.equal(got, expected), sections
    check_forward(q.detach(), k.detach(), v.detach(), True)
