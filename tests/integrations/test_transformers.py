"""attn_implementation="flashtrain" in Hugging Face transformers matches "eager" on tiny random models:
Llama (GQA) and GPT-2, unpadded and padded batches, logits and loss gradients, every call on our kernels."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtrain.integrations import transformers as integration  # noqa: E402


def tiny_models(name, reference, dtype):
    torch.manual_seed(0)
    if name == "llama":  # GQA: 4 query heads on 2 KV heads
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    # one config each: _from_config writes the attention implementation into the config it is given
    ref = cls._from_config(copy.deepcopy(config), attn_implementation=reference).to(dtype).train()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=integration.NAME).to(dtype).train()
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == reference
    return ref, ours


def logits_and_grads(model, ids, mask):
    # no loss from padded positions, whose outputs differ by implementation: the shifted LM loss reads the
    # logits at t - 1 for the label at t, so a label right after padding is ignored too
    previous_is_pad = torch.cat([torch.zeros_like(mask[:, :1]), 1 - mask[:, :-1]], dim=1).bool()
    labels = ids.masked_fill((mask == 0) | previous_is_pad, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad])
    return out.logits, grads


# "eager" as the issue asks, in float32: transformers' eager path computes its softmax in float32 whatever the
# model dtype (and in float64 its left-padding mask turns padded rows into NaN). "sdpa" in float64 (PyTorch's
# math backend) is the tight check.
@pytest.mark.interpreter
@pytest.mark.parametrize("reference, dtype, tol", [("eager", torch.float32, 2e-5), ("sdpa", torch.float64, 1e-10)],
                         ids=["eager-fp32", "sdpa-fp64"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_matches_reference(name, padded, reference, dtype, tol, monkeypatch):
    ref, ours = tiny_models(name, reference, dtype)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0  # left padding, as for generation
    calls = []
    real = integration.flash_attention
    monkeypatch.setattr(integration, "flash_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ref_logits, ref_grads = logits_and_grads(ref, ids, mask)
    assert not calls
    logits, grads = logits_and_grads(ours, ids, mask)
    # every attention call ran flashtrain's kernels, one launch per layer (padding inside the kernels)
    assert len(calls) == 2
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], ref_logits[keep], rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=10 * tol, atol=tol)


@pytest.mark.interpreter
def test_varlen_matches_per_sequence_calls_and_passes_dropout():
    """flash_attn_varlen_func (packed sequences): each sequence attends only to itself; dropout reaches
    the kernels (same torch seed, same result)."""
    q, k, v = (torch.randn(12, 2, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12])
    out = integration.flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    first = integration.flash_attn_func(q[None, :5], k[None, :5], v[None, :5], causal=True)[0]
    torch.testing.assert_close(out[:5], first, rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    dropped = integration.flash_attn_func(q[None], k[None], v[None], dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(dropped, integration.flash_attn_func(q[None], k[None], v[None], dropout_p=0.5))
    assert not torch.equal(dropped, integration.flash_attn_func(q[None], k[None], v[None]))


def test_unsupported_features_are_clear_errors():
    with pytest.raises(ValueError, match="sliding_window=4"):
        integration.flashtrain_attention_forward(None, *(torch.randn(1, 2, 8, 8) for _ in range(3)), None,
                                                 sliding_window=4)
