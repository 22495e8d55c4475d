"""Key padding masks and attention dropout inside the kernels, against the float64 reference.

The reference applies the kernels' own dropout mask (``dropout_keep_mask`` regenerates it from the seed);
separate tests check that mask's statistics and its reproducibility under ``torch.manual_seed``.
"""

import math

import pytest
import torch

from flashtrain import flash_attention
from flashtrain.ops.attention import SEED_BOUND
from flashtrain.kernels import dropout_keep_mask
from flashtrain.ops.reference import attention_ref
from flashtrain.testing import TOLERANCE, assert_close

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim)
SHAPES = [(2, 2, 2, 17, 17, 24), (3, 2, 1, 37, 45, 40), (2, 2, 1, 41, 23, 16)]


def make_inputs(shape, dtype, device, seed=0, pad_fraction=0.3):
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen)
    kpm = torch.rand(batch, seq_k, generator=gen) < pad_fraction
    kpm[0, -(seq_k // 3):] = True  # right padding on one row, scattered padding on the others
    qkv = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    return (*qkv, kpm.to(device))


def run_pair(q, k, v, causal, kpm, dropout_p, torch_seed=7):
    """Kernel and reference outputs and gradients, the reference using the kernels' dropout mask."""
    torch.manual_seed(torch_seed)
    out, lse = flash_attention(q, k, v, causal=causal, key_padding_mask=kpm, dropout_p=dropout_p, return_lse=True)
    keep = None
    if dropout_p > 0:
        torch.manual_seed(torch_seed)  # the op draws its Philox seed exactly like this
        seed = int(torch.randint(SEED_BOUND, (), dtype=torch.int64))
        keep = dropout_keep_mask(seed, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, q.device)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, key_padding_mask=kpm, dropout_keep=keep,
                                 dropout_p=dropout_p)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    return (out, lse, grads), (ref, ref_lse, ref_grads)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_padding_and_dropout_match_reference(shape, causal, dtype, dropout_p, device):
    q, k, v, kpm = make_inputs(shape, dtype, device)
    (out, lse, grads), (ref, ref_lse, ref_grads) = run_pair(q, k, v, causal, kpm, dropout_p)
    tol_out, tol_grad = TOLERANCE[dtype]
    assert_close("out", out, ref, tol_out)
    assert_close("lse", lse, ref_lse, max(tol_out, 1e-6))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, tol_grad)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float_key_padding_mask_is_an_additive_bias(causal, device):
    """A float mask is added to the scaled scores, as nn.MultiheadAttention does: finite values, and -inf."""
    q, k, v, kpm = make_inputs((2, 4, 2, 19, 27, 24), torch.float64, device)
    bias = torch.randn(2, 27, dtype=torch.float64, device=device).masked_fill(kpm, float("-inf"))
    (out, lse, grads), (ref, ref_lse, ref_grads) = run_pair(q, k, v, causal, bias, 0.0)
    assert_close("out", out, ref, 1e-12)
    assert_close("lse", lse, ref_lse, 1e-6)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, 1e-12)


def test_dropout_only(device):
    q, k, v, _ = make_inputs((1, 2, 1, 33, 29, 24), torch.float64, device)
    (out, _, grads), (ref, _, ref_grads) = run_pair(q, k, v, True, None, 0.5)
    assert_close("out", out, ref, 1e-12)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, 1e-12)


def test_fully_padded_rows(device):
    """A batch row whose keys are all padding attends to nothing: zeros, LSE -inf, zero and finite grads."""
    q, k, v, kpm = make_inputs((2, 2, 2, 13, 19, 16), torch.float64, device)
    kpm[1] = True
    out, lse = flash_attention(q, k, v, key_padding_mask=kpm, causal=True, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1])) and torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))


def test_padding_equals_dropping_the_keys(device):
    """Right padding gives exactly what the unpadded sequence gives, and padded keys get zero gradients."""
    q, k, v, _ = make_inputs((1, 2, 2, 21, 30, 24), torch.float64, device)
    kpm = torch.zeros(1, 30, dtype=torch.bool, device=device)
    kpm[:, 18:] = True
    padded = flash_attention(q, k, v, key_padding_mask=kpm)
    cut = flash_attention(q, k[:, :, :18], v[:, :, :18])
    assert_close("out", padded, cut, 1e-13)
    padded.sum().backward()
    assert torch.equal(k.grad[:, :, 18:], torch.zeros_like(k.grad[:, :, 18:]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_padding_and_dropout(causal, device):
    q, k, v, kpm = make_inputs((2, 2, 1, 7, 9, 8), torch.float64, device)

    def fn(q, k, v):
        torch.manual_seed(3)  # the same dropout mask at every evaluation
        return flash_attention(q, k, v, causal=causal, key_padding_mask=kpm, dropout_p=0.25)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_dropout_is_reproducible_under_manual_seed(device):
    q, k, v, kpm = make_inputs((2, 2, 1, 19, 23, 16), torch.float32, device)
    dout = torch.randn(2, 2, 19, 16, device=device)

    def run(seed):
        torch.manual_seed(seed)
        out = flash_attention(q, k, v, key_padding_mask=kpm, dropout_p=0.2)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_dropout_mask_statistics(dropout_p, device):
    """Kept fraction within 5 sigma of 1 - p (binomial), per (batch, head) as well as overall; heads,
    batch rows and seeds get different masks; and E[keep / (1 - p)] = 1, so the output is unbiased."""
    batch, heads, seq_q, seq_k = 2, 3, 64, 96
    keep = dropout_keep_mask(12345, batch, heads, seq_q, seq_k, dropout_p, device).double()
    n = seq_q * seq_k
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / n)
    per_head = keep.mean(dim=(2, 3))
    assert ((per_head - (1 - dropout_p)).abs() < 5 * sigma).all(), per_head
    assert abs((keep / (1 - dropout_p)).mean().item() - 1.0) < 5 * sigma / (1 - dropout_p)
    flat = keep.view(batch * heads, n)
    for i in range(batch * heads):
        for j in range(i):
            assert not torch.equal(flat[i], flat[j])
    other = dropout_keep_mask(54321, batch, heads, seq_q, seq_k, dropout_p, device).double()
    agree = (other == keep).double().mean().item()  # independent masks agree on p^2 + (1-p)^2 of entries
    expected = dropout_p ** 2 + (1 - dropout_p) ** 2
    assert abs(agree - expected) < 5 * math.sqrt(expected * (1 - expected) / keep.numel())


def test_dropout_mask_is_what_the_forward_applies(device):
    """V = identity makes the output the dropped-out probability matrix itself: its zeros are the mask's."""
    seq_q, seq_k, p = 24, 16, 0.4
    q = torch.randn(1, 1, seq_q, 16, dtype=torch.float64, device=device)
    k = torch.randn(1, 1, seq_k, 16, dtype=torch.float64, device=device)
    v = torch.eye(seq_k, 16, dtype=torch.float64, device=device)[None, None]
    torch.manual_seed(11)
    probs_dropped = flash_attention(q, k, v, dropout_p=p)[0, 0]  # (seq_q, seq_k)
    torch.manual_seed(11)
    seed = int(torch.randint(SEED_BOUND, (), dtype=torch.int64))
    keep = dropout_keep_mask(seed, 1, 1, seq_q, seq_k, p, device)[0, 0]
    assert torch.equal(probs_dropped != 0, keep)
    probs = torch.softmax(q[0, 0] @ k[0, 0].T / 4.0, dim=-1)
    torch.testing.assert_close(probs_dropped, probs * keep / (1 - p), rtol=1e-12, atol=0)
