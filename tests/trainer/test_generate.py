"""Sampling with a KV cache and the export of a trained GPT: the cached decode's logits equal GPT.forward's at every
position (with and without sliding windows), greedy generation equals repeated full forwards, an export loads back
into the plain GPT with its tied embedding, and a model trained a few steps on CPU exports, reloads and generates,
in process and through scripts/generate.py."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flashtrain.trainer import backends
from flashtrain.trainer.export import BYTE_EOD, export, load, read_config
from flashtrain.trainer.generate import KVCache, forward_cached, generate, sample
from flashtrain.trainer.model import GPT, GPTConfig
from flashtrain.trainer.train import train

from .test_train import SMALL, config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "generate.py"
TINY = dict(vocab_size=257, n_layer=2, n_head=2, n_embd=32)
WINDOWED = dict(window_size=3, window_pattern="LG")  # layer 0 sees 3 tokens back, layer 1 everything


def tiny_gpt(attn="flash", dtype=torch.float64, seed=0, **overrides) -> GPT:
    """A tiny GPT with weights large enough (std 0.3) that attention scores, and so rotary positions, matter."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY, **overrides), backends.get(attn))
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return model.to(dtype).eval()


def prompts(batch=2, length=5, seed=1) -> torch.Tensor:
    return torch.randint(0, 257, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_by_full_forwards(model: GPT, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding without a cache: the whole sequence through GPT.forward at each step."""
    for _ in range(steps):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [{}, WINDOWED], ids=["global", "window"])
def test_cached_decode_logits_equal_the_full_forward(window):
    """A prefill of 5 tokens (longer than the window of 3), then 4 tokens one at a time: the logits at all 9
    positions equal GPT.forward's, through the same kernels (flash) and through PyTorch's sdpa (float64)."""
    model = tiny_gpt(**window)
    ids = prompts(length=9)
    with torch.no_grad():
        full = model(ids)[0]  # (2, 9, 257)
        reference = tiny_gpt("sdpa", **window)(ids)[0]
        cache = KVCache(model, batch=2, capacity=9)
        parts = [forward_cached(model, ids[:, :5], cache)]
        parts += [forward_cached(model, ids[:, t:t + 1], cache) for t in range(5, 9)]
    cached = torch.cat(parts, dim=1)
    assert cache.length == 9
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-10)


@pytest.mark.interpreter
def test_greedy_generation_is_the_argmax_of_full_forwards():
    model = tiny_gpt(**WINDOWED)
    ids = prompts()
    out = generate(model, ids, 4, temperature=0)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], ids)
    assert torch.equal(out, greedy_by_full_forwards(model, ids, 4))
    assert torch.equal(generate(model, ids, 0), ids)


@pytest.mark.interpreter
def test_eos_pads_finished_rows_and_stops_when_all_have_finished():
    model = tiny_gpt()
    ids = prompts()
    free = generate(model, ids, 3, temperature=0)
    eos = int(free[0, 6])  # row 0's second new token
    out = generate(model, ids, 3, temperature=0, eos_id=eos)
    first = next(i for i in range(5, 8) if out[0, i] == eos)
    assert torch.equal(out[0, :first + 1], free[0, :first + 1]) and (out[0, first:] == eos).all()
    one = generate(model, ids[:1], 3, temperature=0, eos_id=int(free[0, 5]))  # the first new token ends it
    assert one.shape == (1, 6)


@pytest.mark.interpreter
def test_sampling_is_reproducible_with_a_generator():
    model = tiny_gpt(dtype=torch.float32)
    ids = prompts()
    draws = [generate(model, ids, 3, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(7))
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (2, 8)


def test_sample_temperature_and_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]).repeat(400, 1)
    assert (sample(logits, temperature=0) == 1).all()
    assert (sample(logits, top_k=1) == 1).all()  # one candidate left: the argmax
    drawn = sample(logits, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {1, 2, 3}  # the three largest, each drawn among 400
    again = sample(logits, temperature=2.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn, again)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(top_k=0), "top_k=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(eos_id=257), "eos_id=257"),
    (dict(prompt_ids=torch.zeros(5, dtype=torch.long)), r"prompt_ids has shape \(5,\)"),
    (dict(prompt_ids=torch.full((1, 3), 300)), r"prompt_ids holds ids in \[300, 300\]"),
    (dict(prompt_ids=torch.zeros(1, 3)), "prompt_ids has dtype torch.float32"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    model = tiny_gpt(dtype=torch.float32)
    args = dict(prompt_ids=prompts(), max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)


def test_bfloat16_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match="torch.bfloat16 on the CPU"):
        generate(tiny_gpt(dtype=torch.bfloat16), prompts(), 2)


def test_export_round_trip(tmp_path):
    from flashtrain.trainer.module import GPTModule

    module = GPTModule(model={**TINY, **WINDOWED}, attn="sdpa", optim={})
    export(module, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "wte.weight" in f.keys() and "lm_head.weight" not in f.keys()  # the tied embedding, once
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attn"] == {"name": "sdpa", "options": {}} and "data" not in config
    assert read_config(tmp_path) == config
    for attn, dtype in ((None, None), ("flash", torch.float64)):
        model = load(tmp_path, attn=attn, dtype=dtype)
        assert type(model) is GPT and model.config == module.model.config and not model.training
        assert model.lm_head.weight is model.wte.weight
        original, loaded = module.model.state_dict(), model.state_dict()
        assert original.keys() == loaded.keys()
        for name in original:
            torch.testing.assert_close(loaded[name], original[name].to(loaded[name].dtype), rtol=0, atol=0)
    assert load(tmp_path, attn=None).blocks[0].attn.attn is backends.sdpa  # the recorded backend


def test_loading_an_export_imports_no_lightning(tmp_path):
    """The plain GPT comes back from an export without Lightning (checked in a fresh interpreter)."""
    export_dir = tmp_path / "export"
    from flashtrain.trainer.module import GPTModule
    export(GPTModule(model=TINY, attn="flash", optim={}), export_dir)
    code = (f"import sys\nfrom flashtrain.trainer.export import load\nmodel = load({str(export_dir)!r})\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
            "print(model.config.n_embd)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONSAFEPATH="1", TRITON_INTERPRET="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "32"


def test_byte_vocabulary_constants_agree():
    from flashtrain.trainer.data import BYTE_EOD as DATA_EOD

    assert BYTE_EOD == DATA_EOD == load_script().BYTE_EOD


def test_missing_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        load(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path)
    with pytest.raises(TypeError, match="expected a GPTModule"):
        export(object(), tmp_path)


@pytest.mark.interpreter
def test_train_export_reload_and_generate(tmp_path):
    """The issue's end to end: a tiny model trained 2 steps on CPU, exported, reloaded, 8 greedy tokens; the
    script prints the same text from the checkpoint."""
    train(config(*SMALL, "trainer.max_steps=2", "logger=csv", f"output_dir={tmp_path}"))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    export(ckpt, tmp_path / "export")
    model, from_ckpt = load(tmp_path / "export"), load(ckpt)
    assert model.config == from_ckpt.config and model.lm_head.weight is model.wte.weight
    for name, tensor in from_ckpt.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    prompt = torch.tensor([list(b"The ")])
    out = generate(model, prompt, 8, temperature=0, eos_id=BYTE_EOD)
    assert torch.equal(out, generate(from_ckpt, prompt, 8, temperature=0, eos_id=BYTE_EOD))
    expected = load_script().ByteCodec().decode(out[0].tolist())

    command = [sys.executable, str(SCRIPT), str(ckpt), "--prompt", "The ", "--max-new-tokens", "8",
               "--temperature", "0"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONSAFEPATH="1", TRITON_INTERPRET="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected + "\n" and result.stdout.startswith("The ")
