"""The trainer: configs compose and instantiate, training runs on CPU (kernels through the interpreter),
every attention backend gives the same loss, resuming continues the same losses, metrics are logged to
CSV and to an offline wandb run, and two data-parallel processes count tokens over both."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from flashtrain.trainer.config import parse_tokens, register_resolvers
from flashtrain.trainer.data import StepSampler, TextDataModule, builtin_corpus_file
from flashtrain.trainer.train import build, train

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
SMALL = ["model=tiny", "seq_len=64", "tokens_per_step=128", "trainer.enable_progress_bar=false",
         "optim.warmup_steps=2"]  # logging every step is train_cpu.yaml's own default

register_resolvers()


def config(*overrides, name="train_cpu"):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def read_metrics(output_dir):
    path = next(Path(output_dir).rglob("metrics.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


def losses_by_step(rows):
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@pytest.mark.parametrize("value, expected", [(16384, 16384), ("16384", 16384), ("16k", 16384), ("16K", 16384),
                                             ("1M", 1048576), ("2.5k", 2560), (" 4k ", 4096)])
def test_parse_tokens(value, expected):
    assert parse_tokens(value) == expected


@pytest.mark.parametrize("value", ["16kb", "", "-1", "0", "1.1k", "sixteen", True])
def test_parse_tokens_rejects(value):
    with pytest.raises(ValueError, match="seq_len"):
        parse_tokens(value)


def test_resolved_sequence_length():
    cfg = config("attn=flash", "seq_len=16k", name="train")
    assert cfg.data.seq_len == 16384 and cfg.model.seq_len == 16384
    assert cfg.data.batch_size == 2  # 32k tokens per step


@pytest.mark.parametrize("group, option", [(g, o) for g in ("model", "attn", "data", "optim", "trainer", "logger")
                                           for o in options(g)])
def test_every_config_group_composes_and_instantiates(group, option, tmp_path):
    cfg = config(f"{group}={option}", f"output_dir={tmp_path}", "model=tiny" if group != "model" else "seq_len=64")
    datamodule, module, trainer = build(cfg)
    assert module.model.num_params() > 0 and trainer.max_steps == cfg.trainer.max_steps


def test_max_steps_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="trainer.max_steps=-1"):
        build(config("trainer.max_steps=-1", f"output_dir={tmp_path}"))


def test_cpu_config_trains_in_fp32():
    """The CPU config never picks bfloat16, which Triton's interpreter cannot compute."""
    assert config().trainer.precision == "32-true"


@pytest.mark.parametrize("attn", ["flash", "flash_fp8"])
def test_bf16_on_the_cpu_is_refused_before_training(attn, tmp_path):
    with pytest.raises(ValueError, match="trainer.precision=bf16-mixed with attn=" + attn):
        build(config(f"attn={attn}", "trainer.precision=bf16-mixed", f"output_dir={tmp_path}"))
    build(config("attn=sdpa", "trainer.precision=bf16-mixed", f"output_dir={tmp_path}"))  # PyTorch's attention can


def test_experiment_composes(tmp_path):
    cfg = config("+experiment=long_context_16k", f"output_dir={tmp_path}", name="train")
    assert cfg.data.seq_len == 16384 and cfg.model.n_layer == 12 and cfg.attn.name == "flash"
    cfg = config("+experiment=long_context_1m", f"output_dir={tmp_path}", name="train")
    assert cfg.data.seq_len == 2**20 and cfg.data.batch_size == 1 and cfg.model.activation_checkpointing == "selective"
    assert cfg.model.activation_offload  # what lets 1M tokens fit an 80 GB GPU
    cfg = config("+experiment=long_context_256k_medium", f"output_dir={tmp_path}", name="train")
    assert cfg.data.seq_len == 2**18 and cfg.model.n_layer == 24 and cfg.data.builtin == "python_stdlib"


@pytest.mark.interpreter
def test_all_attention_backends_give_the_same_initial_loss():
    losses = {}
    batch = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    for attn in ("flash", "sdpa", "eager", "flash_fp8"):
        _, module, _ = build(config(f"attn={attn}", *SMALL, "output_dir=/tmp/unused", "logger=csv"))
        with torch.no_grad():
            losses[attn] = module(batch[:, :-1], batch[:, 1:])[1].item()
    assert losses["flash"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["sdpa"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["flash_fp8"] == pytest.approx(losses["eager"], rel=1e-2)  # FP8 rounding, same model


@pytest.mark.interpreter
def test_flash_fp8_options(tmp_path):
    train(config("attn=flash_fp8", "attn.fp8=full", "attn.smooth_k=false", *SMALL, "trainer.max_steps=2",
                 "logger=csv", f"output_dir={tmp_path}"))
    losses = losses_by_step(read_metrics(tmp_path))
    assert sorted(losses) == [0, 1] and all(l == l for l in losses.values())
    with pytest.raises(ValueError, match="unknown"):
        build(config("attn=flash", "+attn.fp8=forward", *SMALL, f"output_dir={tmp_path}"))


@pytest.mark.parametrize("attn", [pytest.param("flash", marks=pytest.mark.interpreter), "sdpa", "eager",
                                  pytest.param("flash_fp8", marks=pytest.mark.interpreter)])
def test_a_few_training_steps(attn, tmp_path):
    train(config(f"attn={attn}", *SMALL, "trainer.max_steps=3", "logger=csv", f"output_dir={tmp_path}"))
    rows = read_metrics(tmp_path)
    losses = losses_by_step(rows)
    assert sorted(losses) == [0, 1, 2] and all(l == l for l in losses.values())
    perf = [r for r in rows if r.get("perf/tokens_per_s")]
    assert perf and all(float(r["perf/tokens_per_s"]) > 0 and float(r["perf/tflops"]) > 0 for r in perf)
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.interpreter
def test_resume_continues_the_same_losses(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    common = [*SMALL, "logger=csv", "trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=3"]
    train(config(*common, f"output_dir={first}"))
    ckpt = first / "checkpoints" / "step3.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (first / "checkpoints").iterdir())
    train(config(*common, f"output_dir={second}", f"ckpt_path={ckpt}"))
    before, after = losses_by_step(read_metrics(first)), losses_by_step(read_metrics(second))
    assert sorted(after) == [3, 4, 5]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-6), step


@pytest.mark.interpreter
def test_wandb_offline_run(tmp_path, monkeypatch):
    """Metrics reach an offline wandb run. wandb 0.31 keeps an offline run's history only in its binary
    run-*.wandb log (protobuf records, uncompressed), so the metric names are looked for in its bytes."""
    from lightning.pytorch.loggers import WandbLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = set()
    real_log_metrics = WandbLogger.log_metrics

    def log_metrics(self, metrics, step=None):
        logged.update(metrics)
        return real_log_metrics(self, metrics, step)

    monkeypatch.setattr(WandbLogger, "log_metrics", log_metrics)
    train(config(*SMALL, "trainer.max_steps=3", "logger=wandb", f"output_dir={tmp_path}"))
    import wandb
    wandb.finish()
    keys = ("train/loss", "perf/tokens_per_s", "perf/tflops", "perf/step_time_s", "perf/lr")
    assert set(keys) <= logged
    runs = list(tmp_path.rglob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "no offline wandb run written"
    # wandb.finish() can return before wandb-core's writer has flushed the log: wait for it (seen in CI)
    deadline = time.monotonic() + 60
    while not all(key.encode() in runs[0].read_bytes() for key in keys) and time.monotonic() < deadline:
        time.sleep(0.5)
    data = runs[0].read_bytes()
    for key in keys:
        assert key.encode() in data, key


def test_two_process_data_parallel(tmp_path):
    """`trainer.devices=2` with DDP on CPU: two processes, and tokens/s counts the tokens of both."""
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), *SMALL, "logger=csv", "trainer.max_steps=3",
           "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    perf = [r for r in read_metrics(tmp_path) if r.get("perf/tokens_per_s")]
    assert perf
    for r in perf:  # 2 processes x batch 2 x 64 tokens per step
        assert float(r["perf/tokens_per_s"]) * float(r["perf/step_time_s"]) == pytest.approx(2 * 2 * 64)


def test_data_windows_and_split(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    dm = TextDataModule(seq_len=31, batch_size=4, files=[str(text)], cache_dir=tmp_path, val_fraction=0.1)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == (len(text.read_bytes()) + 1) // 32  # the text, its end token
    batch = next(iter(dm.train_dataloader()))["tokens"]
    assert batch.shape == (4, 32) and batch.dtype == torch.int64
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": "some text " * 20}) for _ in range(10)))
    dm = TextDataModule(seq_len=15, batch_size=2, files=str(jsonl), text_field="body", cache_dir=tmp_path)
    dm.setup()
    assert next(iter(dm.train_dataloader()))["tokens"].shape == (2, 16)


def test_builtin_corpus_is_real_text(tmp_path):
    dm = TextDataModule(seq_len=255, batch_size=2, cache_dir=tmp_path)
    dm.setup()
    assert len(dm.train_set) > 1000  # ~466 KB of Python documentation
    window = bytes(t for t in dm.train_set[0]["ids"].tolist() if t < 256).decode("utf-8", errors="replace")
    assert sum(c.isalpha() for c in window) > 100


def test_stdlib_corpus_is_the_standard_library(tmp_path):
    path = builtin_corpus_file(tmp_path, "python_stdlib")
    text = path.read_text(encoding="utf-8")
    assert len(text) > 5_000_000  # 10-30 MB of sources where measured (10.7 MB: Python 3.12 without its tests)
    assert "def " in text and "import " in text
    assert builtin_corpus_file(tmp_path, "python_stdlib").stat().st_mtime == path.stat().st_mtime  # written once
    with pytest.raises(ValueError, match="data.builtin='python'"):
        TextDataModule(seq_len=8, batch_size=2, builtin="python", cache_dir=tmp_path)


def test_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        TextDataModule(seq_len=8, batch_size=2, files=[str(tmp_path / "missing.txt")], cache_dir=tmp_path).setup()
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 10)
    with pytest.raises(ValueError, match="text_field='body'"):
        TextDataModule(seq_len=8, batch_size=2, files=[str(text)], text_field="body", cache_dir=tmp_path).setup()
    with pytest.raises(ValueError, match="need at least 2"):
        TextDataModule(seq_len=4096, batch_size=2, files=[str(text)], cache_dir=tmp_path).setup()


def test_step_sampler_is_resumable_and_sharded():
    full = StepSampler(10, seed=3)
    stream = [i for _, i in zip(range(35), full)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    resumed = StepSampler(10, seed=3, start=17)
    assert [i for _, i in zip(range(18), resumed)] == stream[17:35]
    ranks = [StepSampler(10, seed=3, start=4, rank=r, world_size=2) for r in (0, 1)]
    shards = [[i for _, i in zip(range(5), s)] for s in ranks]
    assert shards[0] == stream[4:14:2] and shards[1] == stream[5:15:2]


def test_activation_checkpointing_and_accumulation_keep_the_losses(tmp_path):
    base = [*SMALL, "attn=sdpa", "logger=csv", "trainer.max_steps=3", "callbacks.checkpoint=null"]
    train(config(*base, f"output_dir={tmp_path / 'plain'}"))
    train(config(*base, "model.activation_checkpointing=full", f"output_dir={tmp_path / 'ckpt'}"))
    plain, recomputed = losses_by_step(read_metrics(tmp_path / "plain")), losses_by_step(read_metrics(tmp_path / "ckpt"))
    assert plain == pytest.approx(recomputed, rel=1e-6)
    # two micro-batches of 1 per optimizer step instead of one batch of 2: same tokens per step, counted
    train(config(*base, "tokens_per_step=64", "trainer.accumulate_grad_batches=2", f"output_dir={tmp_path / 'acc'}"))
    perf = [r for r in read_metrics(tmp_path / "acc") if r.get("perf/tokens_per_s")]
    assert perf and all(float(r["perf/tokens_per_s"]) * float(r["perf/step_time_s"]) == pytest.approx(2 * 64)
                        for r in perf)


@pytest.mark.interpreter
def test_compiled_model_trains(tmp_path):
    torch._dynamo.reset()
    train(config(*SMALL, "attn=flash", "compile=true", "logger=csv", "trainer.max_steps=2",
                 "callbacks.checkpoint=null", f"output_dir={tmp_path}"))
    assert sorted(losses_by_step(read_metrics(tmp_path))) == [0, 1]


def test_tokenizers_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "fox": 2, "dog": 3, "</s>": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    text = tmp_path / "a.txt"
    text.write_text("the fox the dog a cat " * 50)
    dm = TextDataModule(seq_len=9, batch_size=2, files=[str(text)], tokenizer=str(path), vocab_size=5,
                        cache_dir=tmp_path)
    dm.setup()
    assert next(iter(dm.train_dataloader()))["tokens"].max() < 5
    assert dm._encode_fn()[1] == 4  # </s> ends each document
    with pytest.raises(ValueError, match="vocab_size=2"):
        TextDataModule(seq_len=9, batch_size=2, files=[str(text)], tokenizer=str(path), vocab_size=2,
                       cache_dir=tmp_path).setup()
    del vocab["</s>"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(path))
    with pytest.raises(ValueError, match="set data.eod_token"):
        TextDataModule(seq_len=9, batch_size=2, files=[str(text)], tokenizer=str(path), vocab_size=4,
                       cache_dir=tmp_path).setup()


def test_bad_hub_name_is_a_clear_error(tmp_path):
    """Offline here (HF_HUB_OFFLINE=1, read when datasets is imported, hence the subprocess)."""
    code = ("from flashtrain.trainer.data import TextDataModule\n"
            f"TextDataModule(seq_len=8, batch_size=2, hub='no-such-user/no-such-dataset', cache_dir={str(tmp_path)!r})"
            ".setup()\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ValueError: data.hub='no-such-user/no-such-dataset'" in result.stderr, result.stderr[-2000:]


def test_tokens_per_step_that_is_not_whole_sequences_is_reported(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="flashtrain.trainer.train"):
        build(config(*SMALL, "tokens_per_step=100", f"output_dir={tmp_path}"))
    assert "each step trains on 1 x 64 = 64 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="flashtrain.trainer.train"):
        build(config(*SMALL, f"output_dir={tmp_path}"))
    assert "tokens_per_step" not in caplog.text


def test_a_corpus_too_short_names_the_options_that_give_more(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 10)
    with pytest.raises(ValueError, match="data.builtin=python_stdlib"):
        TextDataModule(seq_len=4096, batch_size=2, files=[str(text)], cache_dir=tmp_path).setup()
