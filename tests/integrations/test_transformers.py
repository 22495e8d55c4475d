"""attn_implementation="flashtrain" in Hugging Face transformers matches "eager" on tiny random models:
Llama (GQA) and GPT-2, unpadded and padded batches; a packed Llama batch (one varlen launch per layer); sliding-window
Mistral, Qwen 2 and Gemma 2 models, unpadded and padded. Logits and loss gradients, every call on our kernels."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers.modeling_flash_attention_utils as fa_utils  # noqa: E402

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
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=r"softcap=50\.0.*expected None or 0\.0"):
        integration.flashtrain_attention_forward(None, q, q, q, None, softcap=50.0)
    with pytest.raises(ValueError, match=r"s_aux .*\(2,\).*expected None"):
        integration.flashtrain_attention_forward(None, q, q, q, None, s_aux=torch.zeros(2))
    x = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="softcap=30.0"):
        integration.flash_attn_func(x, x, x, softcap=30.0)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap=30.0"):
        integration.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, softcap=30.0)
    with pytest.raises(ValueError, match=r"deterministic=True .*use_deterministic_algorithms"):
        integration.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, deterministic=True)


def test_gemma2_attention_softcapping_is_a_clear_error():
    config = transformers.Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       query_pre_attn_scalar=16, sliding_window=5, attn_logit_softcapping=50.0)
    model = transformers.Gemma2ForCausalLM._from_config(config, attn_implementation=integration.NAME)
    with pytest.raises(ValueError, match=r"softcap=50\.0.*attn_logit_softcapping=None"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_sliding_window_matches_transformers_flash_conversion():
    """window_size as transformers' flash path sets it (read from its own kwargs processing)."""
    kwargs = fa_utils._process_flash_attention_kwargs(
        query_length=21, key_length=21, is_causal=True, sliding_window=5,
        supports_mapping={name: True for name in ("dropout_p", "window_size", "deterministic", "softcap",
                                                  "max_seqlen_q", "max_seqlen_k", "cache_seqlens")})
    assert integration.sliding_window_to_window_size(5, 21) == kwargs["window_size"] == (4, 4)
    assert integration.sliding_window_to_window_size(5, 5) == (-1, -1)  # no more keys than the window
    assert integration.sliding_window_to_window_size(None, 21) == (-1, -1)


@pytest.mark.interpreter
def test_varlen_window_and_dropout():
    """Windows reach the varlen kernels per sequence; with dropout, one flash_attention launch per sequence
    drawing its seed in order (same torch seed, same result as the per-sequence calls)."""
    q, k, v = (torch.randn(19, 2, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 4, 4, 19])  # int64, an empty sequence
    out = integration.flash_attn_varlen_func(q, k, v, cu, cu, torch.tensor(15), torch.tensor(15), causal=True,
                                             window_size=(3, 3))
    for a, b in ((0, 4), (4, 19)):
        alone = integration.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, window_size=(3, 3))
        torch.testing.assert_close(out[a:b], alone[0], rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    dropped = integration.flash_attn_varlen_func(q, k, v, cu, cu, dropout_p=0.5, causal=True)
    torch.manual_seed(0)
    alone = [integration.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], dropout_p=0.5, causal=True)[0]
             for a, b in ((0, 4), (4, 19))]
    assert torch.equal(dropped, torch.cat(alone))


def packed_logits_and_grads(model, ids, labels, position_ids=None):
    """Token-wise loss (each token's own label, no shift), so documents' losses add up across separate runs."""
    out = model(input_ids=ids, position_ids=position_ids, use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits[0], labels[0], reduction="sum") / labels.shape[1]
    return out.logits, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.interpreter
def test_packed_batch_one_launch_per_layer(monkeypatch):
    """Documents of 7, 1 and 13 tokens packed in one row, position_ids restarting at each: one
    flash_attention_varlen launch per layer; logits and gradients match eager and the documents run one at a time."""
    ref, ours = tiny_models("llama", "eager", torch.float32)
    lengths = [7, 1, 13]
    generator = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 97, (1, sum(lengths)), generator=generator) for _ in range(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    varlen_calls, dense_calls = [], []
    real_varlen, real_dense = integration.flash_attention_varlen, integration.flash_attention
    monkeypatch.setattr(integration, "flash_attention_varlen",
                        lambda *a, **kw: varlen_calls.append(a[3].tolist()) or real_varlen(*a, **kw))
    monkeypatch.setattr(integration, "flash_attention", lambda *a, **kw: dense_calls.append(1) or real_dense(*a, **kw))
    ref_logits, ref_grads = packed_logits_and_grads(ref, ids, labels, position_ids)
    logits, grads = packed_logits_and_grads(ours, ids, labels, position_ids)
    assert varlen_calls == [[0, 7, 8, 21]] * 2 and not dense_calls  # one launch per layer, all documents
    torch.testing.assert_close(logits, ref_logits, rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-5)
    # the same documents one at a time (flash_attn_func): the loss is a sum over tokens, so gradients add up
    starts = [0, 7, 8, 21]
    alone = torch.cat([ours(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])], 1)
    loss = torch.nn.functional.cross_entropy(alone[0], labels[0], reduction="sum") / labels.shape[1]
    alone_grads = torch.autograd.grad(loss, [p for p in ours.parameters() if p.requires_grad])
    assert len(dense_calls) == 2 * len(lengths)
    torch.testing.assert_close(logits, alone, rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, alone_grads):
        torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-5)


def sliding_models(name):
    """Two-layer models with a window of 5 keys; per layer, the window_size the kernels should get."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, sliding_window=5)
    if name == "mistral":  # every layer sliding
        config, cls, windows = transformers.MistralConfig(**common), transformers.MistralForCausalLM, [(4, 4)] * 2
    elif name == "qwen2":  # layers from max_window_layers on slide
        config = transformers.Qwen2Config(use_sliding_window=True, max_window_layers=1, **common)
        cls, windows = transformers.Qwen2ForCausalLM, [(-1, -1), (4, 4)]
    else:  # sliding and global layers alternate; attention softcapping off (the kernels have none)
        config = transformers.Gemma2Config(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=None,
                                           **common)
        cls, windows = transformers.Gemma2ForCausalLM, [(4, 4), (-1, -1)]
    ref = cls._from_config(copy.deepcopy(config), attn_implementation="eager").train()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=integration.NAME).train()
    ours.load_state_dict(ref.state_dict())
    return ref, ours, windows


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_sliding_window_matches_eager(name, padded, monkeypatch):
    ref, ours, windows = sliding_models(name)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    calls = []
    real = integration.flash_attention
    monkeypatch.setattr(integration, "flash_attention",
                        lambda *a, **kw: calls.append(tuple(kw["window_size"])) or real(*a, **kw))
    ref_logits, ref_grads = logits_and_grads(ref, ids, mask)
    logits, grads = logits_and_grads(ours, ids, mask)
    assert calls == windows
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], ref_logits[keep], rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-5)
