"""Sliding windows (flash-attn's ``window_size``) against the float64 reference that builds the explicit mask."""

import pytest
import torch

from flashtrain import flash_attention
from flashtrain.ops.reference import attention_ref
from flashtrain.testing import assert_attention_close, assert_close

from .test_attention import make_qkv

# (window_size, causal): windows of 0 and 1, larger than the sequence, one side unbounded, causal capping the right
WINDOWS = [((0, 0), False), ((1, 1), False), ((5, 3), False), ((7, -1), True), ((-1, 2), False), ((3, 9), True),
           ((500, 500), False), ((-1, 0), False), ((16, -1), False)]
# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim): square, GQA with seq_k > seq_q, seq_q > seq_k (rows that see
# no key under a window), long enough to cross several tiles
SHAPES = [(2, 2, 2, 37, 37, 24), (1, 4, 2, 29, 50, 40), (1, 2, 1, 45, 30, 16), (1, 2, 1, 129, 129, 16)]


def run_pair(q, k, v, window, causal, scale=None):
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, scale=scale, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, scale=scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    return (out, lse, grads), (ref, ref_lse, ref_grads)


# every window on one shape; the other shapes (GQA with seq_k > seq_q, seq_q > seq_k) take every other window
CASES = [(SHAPES[0], w, c) for w, c in WINDOWS] + [(SHAPES[1 + i % 2], w, c) for i, (w, c) in enumerate(WINDOWS)]


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("shape, window, causal", CASES, ids=str)
def test_window_matches_reference(shape, window, causal, device):
    q, k, v = make_qkv(shape, torch.float64, device, requires_grad=True)
    assert_attention_close(run_pair(q, k, v, window, causal), torch.float64)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("window, causal", [((8, -1), True), ((20, 5), False)], ids=str)
def test_window_low_precision_and_long(window, causal, dtype, device):
    q, k, v = make_qkv(SHAPES[3], dtype, device, requires_grad=True)
    assert_attention_close(run_pair(q, k, v, window, causal), dtype)


def test_window_with_key_padding_and_scale(device):
    q, k, v = make_qkv((2, 2, 1, 33, 33, 16), torch.float64, device, requires_grad=True)
    kpm = torch.zeros(2, 33, dtype=torch.bool, device=device)
    kpm[1, 20:] = True
    out = flash_attention(q, k, v, causal=True, window_size=(6, -1), key_padding_mask=kpm, scale=0.7)
    ref, _ = attention_ref(q, k, v, causal=True, window_size=(6, -1), key_padding_mask=kpm, scale=0.7)
    assert_close("out", out, ref, 1e-12)
    dout = torch.randn_like(out)
    for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(f"d{name}", g, r, 1e-12)


@pytest.mark.parametrize("shape, window, causal", [((1, 2, 1, 64, 16, 16), (4, -1), True),
                                                   ((1, 1, 1, 70, 20, 16), (5, 2), False)], ids=str)
def test_window_with_seq_q_blocks_beyond_seq_k(shape, window, causal, device):
    """seq_q - seq_k of a query block or more: the first blocks' windows hold no key at all (their rows get zeros,
    LSE -inf), and no block before the first key is visited."""
    q, k, v = make_qkv(shape, torch.float64, device, requires_grad=True)
    assert_attention_close(run_pair(q, k, v, window, causal), torch.float64)


@pytest.mark.parametrize("window, causal", [((3, -1), True), ((2, 4), False)], ids=str)
def test_window_gradcheck(window, causal, device):
    q, k, v = make_qkv((1, 2, 1, 19, 19, 8), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=causal, window_size=window),
                                    (q, k, v), fast_mode=True)


def test_unbounded_window_is_the_dense_op(device):
    """(-1, -1) is the default; a window covering every key gives the same numbers as none."""
    q, k, v = make_qkv((1, 2, 2, 40, 40, 16), torch.float64, device)
    dense = flash_attention(q, k, v, causal=True)
    assert torch.equal(flash_attention(q, k, v, causal=True, window_size=(-1, -1)), dense)
    assert_close("out", flash_attention(q, k, v, causal=True, window_size=(100, 100)), dense, 1e-13)


@pytest.mark.parametrize("window, error", [((-2, 0), ValueError), ((1,), TypeError), ((1.5, 0), TypeError),
                                           ("full", TypeError), ((True, 0), TypeError)], ids=str)
def test_bad_window_is_refused(window, error, device):
    q, k, v = make_qkv((1, 1, 1, 4, 4, 8), torch.float32, device)
    with pytest.raises(error, match="window_size"):
        flash_attention(q, k, v, window_size=window)


def test_fp8_refuses_a_window(device):
    q, k, v = make_qkv((1, 1, 1, 4, 4, 16), torch.float32, device)
    with pytest.raises(ValueError, match="window_size"):
        flash_attention(q, k, v, window_size=(2, 0), fp8="forward")
