"""Context parallelism in the trainer (``context_parallel=P``): two CPU processes splitting each sequence reproduce
the one-process run's losses and count each token once; the data module hands each rank its shard in the
load-balanced layout at the global positions; the options that do not fit together are refused before anything
runs."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flashtrain.trainer.data import TextDataModule, collate
from flashtrain.trainer.train import build

from .test_train import REPO, SMALL, config, losses_by_step, read_metrics

CPU2 = ["trainer.accelerator=cpu", "trainer.devices=2"]


def launch(tmp_path, name: str, *overrides, attn: str = "flash", gpu: bool = False) -> tuple[subprocess.Popen, object]:
    """scripts/train.py in a subprocess writing to tmp_path / name (through the interpreter unless ``gpu``): (the
    process, its run directory)."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"attn={attn}", *SMALL, "logger=csv",
           "trainer.max_steps=3", "callbacks.checkpoint=null", *overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ) if gpu else dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True), run_dir


def finish(process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]


@pytest.mark.interpreter
@pytest.mark.parametrize("attn", ["flash", "sdpa"])
def test_two_process_context_parallel_reproduces_one_process(attn, tmp_path):
    """context_parallel=2 on 2 processes (one data-parallel replica: the same samples as one process), each rank
    holding half of every sequence, flashtrain's ring (flash) or PyTorch's (sdpa): the same per-step losses as one
    process with that backend (measured: at most 9e-8 relative, float32 on CPU), and tokens/s x step time = the
    2 x 64 tokens of one step, counted once."""
    single, single_dir = launch(tmp_path, "one", attn=attn)  # both at once: each spends most of its time starting up
    sharded, sharded_dir = launch(tmp_path, "cp", *CPU2, "context_parallel=2", attn=attn)
    finish(single)
    finish(sharded)
    expected, got = losses_by_step(read_metrics(single_dir)), losses_by_step(read_metrics(sharded_dir))
    assert sorted(expected) == [0, 1, 2] and sorted(got) == [0, 1, 2]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    perf = [r for r in read_metrics(sharded_dir) if r.get("perf/tokens_per_s")]
    assert perf
    for r in perf:  # batch 2 x 64 tokens per step, each on one of the two ranks
        assert float(r["perf/tokens_per_s"]) * float(r["perf/step_time_s"]) == pytest.approx(2 * 64)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("attn", ["flash", "sdpa"])
def test_two_gpu_context_parallel_reproduces_one_gpu(attn, tmp_path):
    """NCCL over two GPUs, bf16-mixed: context_parallel=2 with flashtrain's ring (flash) or PyTorch's (sdpa) gives
    the one-GPU run's losses within bf16's rounding of a different summation order."""
    single, single_dir = launch(tmp_path, "one", "trainer.devices=1", attn=attn, gpu=True)
    finish(single)
    sharded, sharded_dir = launch(tmp_path, "cp", "trainer.devices=2", "context_parallel=2", attn=attn, gpu=True)
    finish(sharded)
    expected, got = losses_by_step(read_metrics(single_dir)), losses_by_step(read_metrics(sharded_dir))
    assert sorted(expected) == [0, 1, 2] and sorted(got) == [0, 1, 2]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-2), step


def test_a_context_parallel_config_builds_the_mesh_strategy(tmp_path):
    """No processes start: the Trainer gets ModelParallelStrategy with (data_parallel, context_parallel) = (2, 2)
    for 4 devices, and the data module and the module know P."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    datamodule, module, trainer = build(config(*SMALL, "trainer.accelerator=cpu", "trainer.devices=4",
                                               "context_parallel=2", f"output_dir={tmp_path}"))
    assert isinstance(trainer.strategy, ModelParallelStrategy)
    assert (trainer.strategy._data_parallel_size, trainer.strategy._tensor_parallel_size) == (2, 2)
    assert datamodule.context_parallel == 2 and module.context_parallel == 2


@pytest.mark.parametrize("overrides, message", [
    (["context_parallel=2"], r"context_parallel=2 with trainer.devices=1 x trainer.num_nodes=1 = 1 processes"),
    ([*CPU2, "context_parallel=3"], r"context_parallel=3 with trainer.devices=2 .* multiple of context_parallel"),
    ([*CPU2, "context_parallel=0"], r"context_parallel=0: expected an int >= 1"),
    ([*CPU2, "context_parallel=2", "seq_len=66"], r"seq_len=66 with context_parallel=2: expected a multiple of 2 x "
                                                  r"context_parallel = 4"),
    ([*CPU2, "context_parallel=2", "data.document_masking=true"], r"data.document_masking=True with "
                                                                   r"context_parallel=2: ring attention has no"),
    ([*CPU2, "context_parallel=2", "model.window_size=8"], r"model.window_size=8 with context_parallel=2"),
    ([*CPU2, "context_parallel=2", "attn=eager"], r"attn=eager with context_parallel=2: only attn=flash .* and "
                                                  r"attn=sdpa"),
    ([*CPU2, "context_parallel=2", "trainer.strategy=ddp"], r"trainer.strategy='ddp' with context_parallel=2"),
])
def test_layouts_that_do_not_fit_are_refused_before_anything_runs(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        build(config(*SMALL, *overrides, f"output_dir={tmp_path}"))


def batches(tmp_path, context_parallel: int, rank: int, world: int) -> dict:
    """The first training batch of process ``rank`` of ``world`` (a stand-in for the Trainer: no processes)."""
    text = tmp_path / "corpus.txt"
    if not text.exists():
        text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    dm = TextDataModule(seq_len=16, batch_size=2, files=[str(text)], cache_dir=tmp_path, seed=5,
                        context_parallel=context_parallel)
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)
    dm.setup()
    return next(iter(dm.train_dataloader()))


def test_ranks_of_a_context_parallel_group_get_the_shards_of_the_same_samples(tmp_path):
    """World 4, P = 2: ranks 2 and 3 form data-parallel replica 1 of 2. Their inputs and targets, put back at their
    positions, are replica 1's full batch; the positions are the global ones of chunks (c, 3 - c) of 4."""
    full = batches(tmp_path, 1, 1, 2)["tokens"]  # data-parallel rank 1 of 2, no context parallelism
    inputs, targets = torch.zeros_like(full[:, :-1]), torch.zeros_like(full[:, 1:])
    for cp_rank, expected in ((0, [*range(0, 4), *range(12, 16)]), (1, list(range(4, 12)))):
        shard = batches(tmp_path, 2, 2 + cp_rank, 4)
        assert set(shard) == {"inputs", "targets", "positions"}
        assert shard["positions"].tolist() == expected
        assert shard["inputs"].shape == shard["targets"].shape == (2, 8)
        inputs[:, shard["positions"]], targets[:, shard["positions"]] = shard["inputs"], shard["targets"]
    assert torch.equal(inputs, full[:, :-1]) and torch.equal(targets, full[:, 1:])


def test_collate_shards_in_the_layout_of_flashtrain_distributed():
    rows = [{"ids": torch.arange(17) + 100 * i} for i in range(2)]
    shard = collate(rows, context_rank=1, context_size=2)
    chunks = torch.stack([r["ids"] for r in rows])[:, :-1].chunk(4, dim=1)  # chunks 1 and 2 of 4 for rank 1
    assert torch.equal(shard["inputs"], torch.cat([chunks[1], chunks[2]], dim=1))
    assert torch.equal(shard["targets"], shard["inputs"] + 1)
    assert set(collate(rows)) == {"tokens"}  # one rank: the batch format every other path reads
    with pytest.raises(ValueError, match="seq_len=16 with context_parallel=3"):
        collate(rows, context_rank=0, context_size=3)
