"""Text data for the GPT trainer, through Hugging Face ``datasets``.

Sources, in order of precedence:
  * ``files``: local text or JSON(L) files (``datasets``' "text" / "json" builders);
  * ``hub``: a dataset name on the Hugging Face hub (needs the network);
  * neither: a built-in corpus that every CPython carries, so a fresh machine trains offline (``builtin``):
    ``"python_docs"`` (default), the Python documentation topics (``pydoc_data.topics``, ~466 KB of English
    prose and grammar), or ``"python_stdlib"``, the running Python's standard library sources (10-30 MB of
    ``.py`` files, as the install has its tests or not; site-packages left out): large enough that a few hundred
    steps of 32k tokens see no window twice, so the training loss there measures learning rather than memorising.

Text is tokenised (UTF-8 bytes by default, or a ``tokenizers`` tokenizer file), concatenated and cut into
windows of ``seq_len + 1`` tokens (inputs and shifted targets), split into train and validation, and cached
by ``datasets`` (its fingerprinted cache files: a second run does not tokenise again).

Batches come from ``StepSampler``: the k-th training sample is a pure function of (seed, k), so a run
resumed from a checkpoint at step s sees exactly the batches the original run saw after step s, on any
number of processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler


BUILTIN_CORPORA = ("python_docs", "python_stdlib")


def check_builtin(name: str) -> None:
    """``data.builtin`` must name one of ``BUILTIN_CORPORA``."""
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"data.builtin={name!r}; expected one of {BUILTIN_CORPORA}")


def _stdlib_sources() -> list[Path]:
    """The running Python's standard library ``.py`` files (site-packages and dist-packages left out), sorted."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def builtin_corpus_file(cache_dir: Path, name: str = "python_docs") -> Path:
    """Write the built-in corpus ``name`` (``BUILTIN_CORPORA``; the module docstring) to a text file once;
    return its path."""
    import sys

    check_builtin(name)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    path = cache_dir / ("python_docs_topics.txt" if name == "python_docs" else f"python{version}_stdlib_sources.txt")
    if not path.exists():
        if name == "python_docs":
            import pydoc_data.topics

            pieces = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
        else:
            pieces = [p.read_text(encoding="utf-8", errors="replace") for p in _stdlib_sources()]
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n\n".join(pieces), encoding="utf-8")
        tmp.replace(path)  # atomic: a concurrent process never reads half a file
    return path


class StepSampler(Sampler[int]):
    """Endless shuffled sample indices: sample k (counted over all processes) is perm_e[k % n] with
    e = k // n and perm_e a permutation seeded by (seed, e). This process yields samples
    start + rank, start + rank + world_size, ..."""

    def __init__(self, num_samples: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        if num_samples < 1:
            raise ValueError("StepSampler needs at least one sample")
        self.n, self.seed, self.start, self.rank, self.world_size = num_samples, seed, start, rank, world_size

    def __iter__(self):
        k, epoch, perm = self.start + self.rank, -1, None
        while True:
            if k // self.n != epoch:
                epoch = k // self.n
                perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
            yield int(perm[k % self.n])
            k += self.world_size


class TextDataModule(L.LightningDataModule):
    """Packed (batch_size, seq_len + 1) token windows; see the module docstring."""

    def __init__(self, seq_len: int, batch_size: int, files=None, hub: str | None = None, hub_config=None,
                 text_field: str = "text", tokenizer: str | None = None, vocab_size: int = 256,
                 val_fraction: float = 0.02, seed: int = 1234, num_workers: int = 0, cache_dir=None,
                 builtin: str = "python_docs"):
        super().__init__()
        if int(seq_len) < 1 or int(batch_size) < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive integers")
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.files = [files] if isinstance(files, str) else (list(files) if files else None)
        self.hub, self.hub_config, self.text_field = hub, hub_config, text_field
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        check_builtin(builtin)  # here, not at setup: a wrong name fails when the config is built
        self.builtin = builtin
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.cache_dir = Path(cache_dir or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))
                              / "flashtrain")
        self.consumed_samples = 0  # restored from checkpoints (state_dict below)
        self.train_set = self.val_set = None

    # --- loading -------------------------------------------------------------------------------------------
    def _raw(self) -> datasets.Dataset:
        if self.files:
            missing = [f for f in self.files if not Path(f).is_file()]
            if missing:
                raise FileNotFoundError(f"data.files: no such file(s): {missing}")
            suffixes = {Path(f).suffix.lower() for f in self.files}
            builder = "json" if suffixes <= {".json", ".jsonl"} else "text"
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=self.files, split="train", **kwargs)
        elif self.hub:
            try:
                ds = datasets.load_dataset(self.hub, self.hub_config, split="train")
            except Exception as exc:
                raise ValueError(f"data.hub={self.hub!r}: could not load it from the Hugging Face hub "
                                 f"({type(exc).__name__}: {exc}). Check the name, or use data.files=...") from exc
        else:
            ds = datasets.load_dataset("text", data_files=str(builtin_corpus_file(self.cache_dir, self.builtin)),
                                       split="train", sample_by="document")
        if self.text_field not in ds.column_names:
            raise ValueError(f"data.text_field={self.text_field!r} is not a column of the dataset; "
                             f"columns: {ds.column_names}")
        return ds

    def _encode_fn(self):
        if self.tokenizer is None:
            if self.vocab_size < 256:
                raise ValueError(f"data.vocab_size={self.vocab_size}: byte-level tokens need at least 256")
            return lambda texts: [list(t.encode("utf-8")) for t in texts]
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(self.tokenizer)
        if tok.get_vocab_size() > self.vocab_size:
            raise ValueError(f"data.tokenizer has {tok.get_vocab_size()} tokens but data.vocab_size="
                             f"{self.vocab_size}; set data.vocab_size (the model's vocabulary follows it)")
        return lambda texts: [e.ids for e in tok.encode_batch(texts)]

    def _packed(self) -> datasets.Dataset:
        """(num_windows,) dataset of 'ids': seq_len + 1 tokens each, cut from the concatenated stream."""
        encode, field, window = self._encode_fn(), self.text_field, self.seq_len + 1

        def tokenize(batch):
            return {"ids": encode(batch[field])}

        def pack(batch):
            stream = [t for ids in batch["ids"] for t in ids]
            return {"ids": [stream[i:i + window] for i in range(0, len(stream) - window + 1, window)]}

        ds = self._raw()
        ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc="tokenize")
        # one pack over everything for small corpora (no remainder lost per batch); 10k documents otherwise
        return ds.map(pack, batched=True, batch_size=10_000, desc=f"pack into {window}-token windows")

    def prepare_data(self):
        self._packed()  # download / tokenise once (rank 0); setup() then hits datasets' cache

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        packed = self._packed()
        if len(packed) < 2:
            raise ValueError(f"the corpus gives {len(packed)} window(s) of seq_len + 1 = {self.seq_len + 1} tokens; "
                             "need at least 2 (train and validation): use more text or a shorter seq_len")
        n_val = max(1, int(len(packed) * self.val_fraction))
        split = packed.train_test_split(test_size=n_val, seed=self.seed, shuffle=True)
        self.train_set = split["train"].with_format("torch")
        self.val_set = split["test"].with_format("torch")

    # --- loaders -------------------------------------------------------------------------------------------
    def _world(self):
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self):
        rank, world = self._world()
        sampler = StepSampler(len(self.train_set), self.seed, self.consumed_samples, rank, world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=_collate,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, collate_fn=_collate,
                          num_workers=self.num_workers)

    # --- resumption ----------------------------------------------------------------------------------------
    def state_dict(self):
        trainer = self.trainer
        steps = trainer.global_step if trainer is not None else 0
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        return {"consumed_samples": steps * accumulate * self.batch_size * self._world()[1]}

    def load_state_dict(self, state):
        self.consumed_samples = int(state["consumed_samples"])


def _collate(rows):
    return torch.stack([r["ids"] for r in rows])  # (B, seq_len + 1)
