"""FlashMultiheadAttention against nn.MultiheadAttention with identical weights, and swap_attention."""

import copy
import warnings

import pytest
import torch
from torch import nn

import flashtrain.nn.multihead as modules
from flashtrain import FlashMultiheadAttention, swap_attention, unswap_attention
from flashtrain.ops.attention import SEED_BOUND
from flashtrain.kernels import dropout_keep_mask

E, H = 32, 4


def pair(dtype=torch.float64, device="cpu", **kwargs):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=dtype, device=device, **kwargs)
    for p in ref.parameters():  # biases are zero-initialised: give every parameter a value
        nn.init.normal_(p, std=0.3)
    flash = FlashMultiheadAttention(E, H, dtype=dtype, device=device, **kwargs)
    flash.load_state_dict(ref.state_dict())
    return ref, flash


def inputs(shape_q, shape_kv=None, dtype=torch.float64, device="cpu", kdim=E, vdim=E):
    shape_kv = shape_kv or shape_q
    q = torch.randn(*shape_q[:-1], E, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(*shape_kv[:-1], kdim, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(*shape_kv[:-1], vdim, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def compare(ref, flash, q, k, v, expect_flash=True, tol=1e-10, **kwargs):
    kwargs.setdefault("need_weights", False)
    reason = flash.flash_skip_reason(q, k, v, kwargs.get("key_padding_mask"), kwargs["need_weights"],
                                     kwargs.get("attn_mask"), kwargs.get("is_causal", False))
    assert (reason is None) == expect_flash, reason
    out_ref, w_ref = ref(q, k, v, **kwargs)
    grads_ref = torch.autograd.grad(out_ref.square().sum(), [q, k, v, *ref.parameters()], allow_unused=True)
    out, w = flash(q, k, v, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, *flash.parameters()], allow_unused=True)
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    assert (w is None) == (w_ref is None)
    if w is not None:
        torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol)
    for g, r in zip(grads, grads_ref):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=tol * 10, atol=tol * 10)


def test_state_dict_loads_both_ways():
    ref, flash = pair(add_bias_kv=True, kdim=16, vdim=24)
    assert list(ref.state_dict()) == list(flash.state_dict())
    ref.load_state_dict(flash.state_dict())


@pytest.mark.interpreter
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["fp64", "fp32"])
def test_self_attention(batch_first, dtype, tol):
    ref, flash = pair(dtype=dtype, batch_first=batch_first)
    shape = (2, 19, E) if batch_first else (19, 2, E)
    q = torch.randn(shape, dtype=dtype, requires_grad=True)
    compare(ref, flash, q, q, q, tol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch_first", [False, True])
def test_causal(batch_first):
    ref, flash = pair(batch_first=batch_first)
    q, _, _ = inputs((2, 23, E) if batch_first else (23, 2, E))
    mask = nn.Transformer.generate_square_subsequent_mask(23, dtype=torch.float64)
    compare(ref, flash, q, q, q, attn_mask=mask, is_causal=True)


@pytest.mark.interpreter
def test_cross_attention_kdim_vdim_bias_kv_zero_attn_no_bias():
    ref, flash = pair(kdim=16, vdim=24, add_bias_kv=True, add_zero_attn=True, bias=False, batch_first=True)
    q, k, v = inputs((2, 13, E), (2, 29, E), kdim=16, vdim=24)
    compare(ref, flash, q, k, v)


@pytest.mark.interpreter
def test_unbatched():
    ref, flash = pair()
    q, k, v = inputs((11, E), (17, E))
    compare(ref, flash, q, k, v)


@pytest.mark.interpreter
@pytest.mark.parametrize("mask_type", ["bool", "float-inf", "float-bias"])
@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}], ids=["plain", "bias_kv", "zero_attn"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_key_padding_mask(batch_first, extra, mask_type):
    """Bool masks, float masks of 0 / -inf (what nn.TransformerEncoderLayer passes) and any float bias."""
    ref, flash = pair(batch_first=batch_first, **extra)
    q, k, v = inputs((2, 9, E) if batch_first else (9, 2, E), (2, 12, E) if batch_first else (12, 2, E))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 8:] = True  # right padding
    padding[0, [0, 3, 4]] = True  # and holes anywhere
    if mask_type == "float-inf":
        padding = torch.zeros(2, 12, dtype=torch.float64).masked_fill(padding, float("-inf"))
    elif mask_type == "float-bias":
        padding = torch.randn(2, 12, dtype=torch.float64)
    compare(ref, flash, q, k, v, key_padding_mask=padding)


@pytest.mark.interpreter
def test_key_padding_mask_unbatched():
    ref, flash = pair()
    q, k, v = inputs((7, E), (10, E))
    compare(ref, flash, q, k, v, key_padding_mask=torch.arange(10) >= 6)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch_first", [False, True])
def test_causal_with_key_padding(batch_first):
    ref, flash = pair(batch_first=batch_first)
    q, _, _ = inputs((2, 15, E) if batch_first else (15, 2, E))
    mask = torch.ones(15, 15, dtype=torch.bool).triu(1)  # bool like the padding mask (PyTorch warns on a mix)
    padding = torch.zeros(2, 15, dtype=torch.bool)
    padding[0, 11:] = True
    padding[1, [2, 5]] = True
    compare(ref, flash, q, q, q, attn_mask=mask, is_causal=True, key_padding_mask=padding)


@pytest.mark.interpreter
def test_sequence_with_all_keys_padded():
    """Zero attention output for that sequence, as nn.MultiheadAttention's SDPA path (training mode) gives."""
    ref, flash = pair(batch_first=True)
    q, k, v = inputs((2, 9, E), (2, 12, E))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0] = True
    padding[1, 5:] = True
    compare(ref, flash, q, k, v, key_padding_mask=padding)


def test_fallbacks_are_exact():
    """Calls the kernels do not cover take PyTorch's implementation: same results, weights included."""
    ref, flash = pair(batch_first=True)
    q, k, v = inputs((2, 9, E), (2, 12, E))
    padding = torch.zeros(2, 12, dtype=torch.float64)
    padding[1, 8:] = -1e9
    compare(ref, flash, q, k, v, key_padding_mask=padding.requires_grad_(), expect_flash=False)
    bool_mask = torch.rand(9, 12) > 0.7
    bool_mask[:, 0] = False  # every query sees at least one key
    compare(ref, flash, q, k, v, attn_mask=bool_mask, expect_flash=False)
    compare(ref, flash, q, k, v, attn_mask=torch.randn(2 * H, 9, 12, dtype=torch.float64), expect_flash=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare(ref, flash, q, k, v, need_weights=True, expect_flash=False)
        compare(ref, flash, q, k, v, need_weights=True, average_attn_weights=False, expect_flash=False)
    ref, flash = pair(batch_first=True, add_bias_kv=True)
    causal = nn.Transformer.generate_square_subsequent_mask(9, dtype=torch.float64)
    q9, _, _ = inputs((2, 9, E))
    compare(ref, flash, q9, q9, q9, attn_mask=causal, is_causal=True, expect_flash=False)


def test_need_weights_warns_once(monkeypatch):
    monkeypatch.setattr(modules, "_warned_need_weights", False)
    _, flash = pair()
    q, _, _ = inputs((5, 2, E))
    with pytest.warns(UserWarning, match="need_weights=False"):
        flash(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash(q, q, q)


@pytest.mark.interpreter
def test_dropout_matches_pytorch_under_the_same_mask(monkeypatch):
    """Training-mode dropout runs in the kernels; with nn.MultiheadAttention made to drop exactly the
    kernels' mask (its weights path calls F.dropout), outputs and all gradients agree."""
    p = 0.3
    ref, flash = pair(dropout=p, batch_first=True, add_bias_kv=True)
    q, k, v = inputs((2, 9, E), (2, 12, E))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 7:] = True
    assert flash.training and flash.flash_skip_reason(q, k, v, padding, need_weights=False) is None
    torch.manual_seed(21)
    out = flash(q, k, v, key_padding_mask=padding, need_weights=False)[0]
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, *flash.parameters()])
    torch.manual_seed(21)  # the seed the kernels were given
    keep = dropout_keep_mask(int(torch.randint(SEED_BOUND, (), dtype=torch.int64)), 2, H, 9, 13, p, "cpu")
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p, **kw: x * keep.view(2 * H, 9, 13) / (1 - p))
    out_ref = ref(q, k, v, key_padding_mask=padding, need_weights=True)[0]
    grads_ref = torch.autograd.grad(out_ref.square().sum(), [q, k, v, *ref.parameters()])
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)


def test_dropout_distribution_and_reproducibility():
    """Over many draws, the kernels' dropout and nn.MultiheadAttention's give outputs with the same mean
    (the eval output) and the same variance; torch.manual_seed reproduces a draw, bit for bit."""
    p, draws = 0.25, 150
    ref, flash = pair(dropout=p, batch_first=True)
    q = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        samples = {}
        for name, module in (("ref", ref), ("flash", flash)):
            torch.manual_seed(0)
            samples[name] = torch.stack([module(q, q, q, need_weights=False)[0] for _ in range(draws)])
        flash.eval()
        expected = flash(q, q, q, need_weights=False)[0]
        flash.train()
        for x in samples.values():
            stderr = x.std(0) / draws ** 0.5
            assert ((x.mean(0) - expected).abs() < 5 * stderr + 1e-12).all()
        var_ratio = samples["flash"].var(0).sum() / samples["ref"].var(0).sum()
        assert 0.8 < var_ratio < 1.25, var_ratio
        torch.manual_seed(5)
        first = flash(q, q, q, need_weights=False)[0]
        torch.manual_seed(5)
        assert torch.equal(first, flash(q, q, q, need_weights=False)[0])
        assert not torch.equal(first, flash(q, q, q, need_weights=False)[0])


@pytest.mark.interpreter
def test_eval_mode_has_no_dropout():
    ref, flash = pair(dropout=0.5)
    ref.eval(), flash.eval()
    q, _, _ = inputs((5, 2, E))
    compare(ref, flash, q, q, q)


@pytest.mark.interpreter
def test_swap_attention_on_transformer_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True, dtype=torch.float64)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    for p in encoder.parameters():
        nn.init.normal_(p, std=0.2)
    swapped = swap_attention(copy.deepcopy(encoder))
    assert sum(type(m) is FlashMultiheadAttention for m in swapped.modules()) == 2
    assert swapped.training and all(p.dtype == torch.float64 for p in swapped.parameters())
    x = torch.randn(2, 17, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(17, dtype=torch.float64)
    calls = []
    real = modules.flash_attention
    modules.flash_attention = lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    try:
        out = swapped(x, mask=mask, is_causal=True)
    finally:
        modules.flash_attention = real
    assert len(calls) == 2 and all(c["causal"] for c in calls)
    ref = encoder(x, mask=mask, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.sum(), list(swapped.parameters()))
    ref_grads = torch.autograd.grad(ref.sum(), list(encoder.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9)
    unswap_attention(swapped)
    assert not any(type(m) is FlashMultiheadAttention for m in swapped.modules())


def test_swap_attention_warns_when_nothing_to_swap():
    with pytest.warns(UserWarning, match="nothing was swapped"):
        swap_attention(nn.Linear(3, 3))


@pytest.mark.interpreter
def test_bfloat16_on_the_cpu_takes_pytorchs_path():
    """CPU bfloat16 inputs, which Triton's interpreter cannot compute, run through PyTorch's implementation (and
    say so) instead of raising or returning wrong numbers."""
    ref, flash = pair(dtype=torch.bfloat16)
    q = torch.randn(5, 2, E, dtype=torch.bfloat16)
    assert "bfloat16" in flash.flash_skip_reason(q, q, q, need_weights=False)
    out, _ = flash(q, q, q, need_weights=False)
    ref_out, _ = ref(q, q, q, need_weights=False)
    assert torch.equal(out, ref_out)
