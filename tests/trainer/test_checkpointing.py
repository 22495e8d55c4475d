"""Activation checkpointing: "selective" and "full" give the gradients of "none"; "selective" keeps the attention's
output and LSE, so the attention forward runs once per layer and step, where "full" runs it twice."""

import pytest
import torch

from flashtrain.ops import attention as attention_op
from flashtrain.trainer import backends
from flashtrain.trainer import model as model_module
from flashtrain.trainer.data import BYTE_EOD, find_documents
from flashtrain.trainer.model import GPT, GPTConfig


def gradients(mode, attn, documents=None, offload=False):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=BYTE_EOD + 1, seq_len=40, n_layer=2, n_head=2, n_embd=32,
                       activation_checkpointing=mode, activation_offload=offload, window_size=6, window_pattern="LG")
    model = GPT(config, backends.get(attn)).double().train()
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(1))
    tokens[0, 12] = BYTE_EOD
    docs = find_documents(tokens[:, :-1], BYTE_EOD) if documents else None
    _, loss = model(tokens[:, :-1], tokens[:, 1:], docs)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.interpreter
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
def test_checkpointing_keeps_the_gradients_and_skips_the_attention_recompute(documents, monkeypatch):
    calls = []
    real = attention_op.forward_kernels
    monkeypatch.setattr(attention_op, "forward_kernels", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = {}
    for mode in ("none", "selective", "full"):
        calls.clear()
        results[mode] = gradients(mode, "flash", documents)
        results[mode] += (len(calls),)
    loss, grads, forwards = results["none"]
    assert forwards == 2  # one attention forward per layer
    for mode, expected in (("selective", 2), ("full", 4)):
        assert results[mode][0].item() == pytest.approx(loss.item(), rel=1e-12)
        for g, r in zip(results[mode][1], grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
        assert results[mode][2] == expected, mode


def test_selective_checkpointing_with_sdpa():
    loss, grads = gradients("none", "sdpa")
    sel_loss, sel_grads = gradients("selective", "sdpa")
    assert sel_loss.item() == pytest.approx(loss.item(), rel=1e-12)
    for g, r in zip(sel_grads, grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
def test_offloaded_block_inputs_keep_the_gradients(mode, documents, monkeypatch):
    """model.activation_offload: each block's input goes through the host copy (one per layer; the rotary tables
    stay) and the loss and gradients are those without the offload, bit for bit."""
    packed = []

    def counting_hooks(keep=()):
        hooks = real(keep)
        pack = hooks.pack_hook
        hooks.pack_hook = lambda t: (lambda p: packed.append((tuple(t.shape), isinstance(p, tuple))) or p)(pack(t))
        return hooks

    real = model_module.offload_saved_tensors
    monkeypatch.setattr(model_module, "offload_saved_tensors", counting_hooks)
    loss, grads = gradients(mode, "sdpa", documents)
    off_loss, off_grads = gradients(mode, "sdpa", documents, offload=True)
    assert [shape for shape, offloaded in packed if offloaded] == [(2, 40, 32)] * 2  # x of each of the 2 blocks
    assert off_loss.item() == loss.item()
    for g, r in zip(off_grads, grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="model.activation_offload=true .* model.activation_checkpointing=selective"):
        GPTConfig(activation_offload=True)


def test_bad_checkpointing_mode():
    with pytest.raises(ValueError, match="model.activation_checkpointing='some'"):
        GPTConfig(activation_checkpointing="some")
    assert GPTConfig(activation_checkpointing=True).activation_checkpointing == "full"


def test_rotary_tables_built_under_inference_mode_serve_training():
    """A validation forward (inference mode) first at a length leaves tables that training can still save."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=BYTE_EOD + 1, n_layer=1, n_head=2, n_embd=16), backends.get("sdpa"))
    tokens = torch.randint(0, 256, (1, 9))
    with torch.inference_mode():
        model.eval()(tokens[:, :-1])
    _, loss = model.train()(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert model.wte.weight.grad is not None


@pytest.mark.gpu
def test_offload_lowers_the_cuda_peak_by_the_blocks_inputs():
    """On a GPU the offloaded blocks' inputs leave device memory: the peak of a forward + backward drops by about
    n_layer x (B, T, C) fp32, and the loss and gradients stay those without the offload (up to SDPA's efficient
    backward, whose sums are not deterministic on CUDA)."""
    B, T, C, layers = 1, 8192, 256, 8
    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=BYTE_EOD + 1, seq_len=T, n_layer=layers, n_head=4, n_embd=C,
                           activation_checkpointing="selective", activation_offload=offload)
        model = GPT(config, backends.get("sdpa")).cuda().train()
        tokens = torch.randint(0, 256, (B, T + 1), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        torch.cuda.synchronize()
        results[offload] = (torch.cuda.max_memory_allocated() - base, loss.item(), [g.cpu() for g in grads])
        del model, grads, loss
    saved = layers * B * T * C * 4  # each block's fp32 input
    assert results[False][0] - results[True][0] > 0.75 * saved, (results[False][0], results[True][0], saved)
    assert results[True][1] == results[False][1]  # the forward is the same computation
    for g, r in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_selective_policy_saves_sdpa_but_not_the_torch_rings_blocks():
    """Selective checkpointing keeps an SDPA kernel's output, except inside PyTorch's ring (attn=sdpa with context
    parallelism), whose per-block partial outputs are recomputed rather than kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    from flashtrain.distributed import torch_ring

    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert model_module._keep_attention(None, op) == CheckpointPolicy.MUST_SAVE
    with torch_ring._in_ring():
        assert torch_ring.inside_ring()
        assert model_module._keep_attention(None, op) == CheckpointPolicy.PREFER_RECOMPUTE
    assert not torch_ring.inside_ring()
    assert model_module._keep_attention(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE
