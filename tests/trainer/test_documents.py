"""Document masking and sliding windows in the GPT trainer: where documents start, that a packed row computes
what its documents compute alone, that every backend gives the same loss for the same masks, and that training
runs with them."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from flashtrain.trainer import backends
from flashtrain.trainer.config import register_resolvers
from flashtrain.trainer.data import BYTE_EOD, TextDataModule, find_documents
from flashtrain.trainer.model import GPT, AttentionMask, GPTConfig, layer_windows
from flashtrain.trainer.module import mean_visible_keys
from flashtrain.trainer.train import build, train

from .test_train import CONF, SMALL, losses_by_step, read_metrics

register_resolvers()
EOD = BYTE_EOD


def config(*overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train_cpu", overrides=list(overrides))


def test_find_documents():
    inputs = torch.tensor([[5, EOD, 7, 8, EOD, 9], [1, 2, 3, 4, 5, EOD]])
    docs = find_documents(inputs, EOD)
    assert docs.cu_seqlens.tolist() == [0, 2, 5, 6, 12] and docs.cu_seqlens.dtype == torch.int32
    assert docs.max_seqlen == 6
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert docs.doc_ids.tolist() == [[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]]


def test_documents_are_separated_in_the_data(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first document " * 5)
    b.write_text("second " * 9)
    dm = TextDataModule(seq_len=40, batch_size=2, files=[str(a), str(b)], cache_dir=tmp_path, document_masking=True,
                        val_fraction=0.3)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    tokens, docs = batch["tokens"], batch["documents"]
    assert (tokens == EOD).any()
    assert torch.equal(docs.cu_seqlens, find_documents(tokens[:, :-1], EOD).cu_seqlens)
    plain = TextDataModule(seq_len=40, batch_size=2, files=[str(a), str(b)], cache_dir=tmp_path)
    plain.setup()
    assert set(next(iter(plain.train_dataloader()))) == {"tokens"}


def tiny_gpt(attn, **model):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=EOD + 1, seq_len=48, n_layer=2, n_head=2, n_embd=32, **model)
    return GPT(config, backends.get(attn)).eval()


def packed_batch():
    """Two rows of 48 tokens: documents of 10, 1, 20, 17 and 30, 18 tokens."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 49), generator=gen)
    for row, ends in ((0, (9, 10, 30)), (1, (29,))):
        tokens[row, list(ends)] = EOD
    return tokens


@pytest.mark.parametrize("attn", [pytest.param("flash", marks=pytest.mark.interpreter), "sdpa"])
def test_packed_row_equals_its_documents_alone(attn):
    """With document masking a document's logits do not depend on its neighbours, and its rotary positions
    start at 0: each document of a packed row gives the logits it gives alone."""
    model = tiny_gpt(attn)
    tokens = packed_batch()[:, :-1]
    docs = find_documents(tokens, EOD)
    with torch.no_grad():
        logits, _ = model(tokens, documents=docs)
        flat = logits.reshape(-1, logits.shape[-1])
        for a, b in zip(docs.cu_seqlens[:-1].tolist(), docs.cu_seqlens[1:].tolist()):
            alone, _ = model(tokens.reshape(-1)[a:b][None])
            torch.testing.assert_close(flat[a:b], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("masks", ["documents", "window", "both"])
def test_backends_agree_under_the_same_masks(masks):
    """flash (packed sequences, windows in the kernels), sdpa and eager (explicit masks) give one loss and the same
    gradients; windows on a local/global pattern."""
    window = dict(window_size=5, window_pattern="LG") if masks != "documents" else {}
    tokens = packed_batch()
    docs = find_documents(tokens[:, :-1], EOD) if masks != "window" else None
    results = {}
    for attn in ("flash", "sdpa", "eager"):
        model = tiny_gpt(attn, **window)
        _, loss = model(tokens[:, :-1], tokens[:, 1:], docs)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results[attn] = (loss.item(), grads)
    for attn in ("flash", "sdpa"):
        assert results[attn][0] == pytest.approx(results["eager"][0], rel=1e-5)
        for g, r in zip(results[attn][1], results["eager"][1]):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    unmasked = tiny_gpt("sdpa")(tokens[:, :-1], tokens[:, 1:])[1].item()
    assert unmasked != pytest.approx(results["eager"][0], rel=1e-5)  # the masks change the function


def test_window_mask_and_layers():
    mask = AttentionMask(None, 2).dense(5, "cpu")[0, 0]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0],
                                   [0, 0, 1, 1, 1]]
    assert layer_windows(GPTConfig(n_layer=4, window_size=8, window_pattern="LLG")) == [8, 8, None, 8]
    assert layer_windows(GPTConfig(n_layer=2, window_size=8)) == [8, 8]
    assert mean_visible_keys(4, None) == 2.5 and mean_visible_keys(4, 1) == (1 + 2 + 2 + 2) / 4
    for bad in (dict(window_size=-1), dict(window_size=4, window_pattern="LX"), dict(window_size=True)):
        with pytest.raises(ValueError, match="window"):
            GPTConfig(**bad)


@pytest.mark.interpreter
def test_training_with_documents_and_windows(tmp_path):
    train(config(*SMALL, "data.document_masking=true", "model.window_size=16", "model.window_pattern=LG",
                 "trainer.max_steps=2", "logger=csv", f"output_dir={tmp_path}"))
    losses = losses_by_step(read_metrics(tmp_path))
    assert sorted(losses) == [0, 1] and all(l == l for l in losses.values())


def test_fp8_refuses_masks(tmp_path):
    with pytest.raises(ValueError, match="attn=flash_fp8 with data.document_masking=True"):
        build(config(*SMALL, "attn=flash_fp8", "data.document_masking=true", f"output_dir={tmp_path}"))
