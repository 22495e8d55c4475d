"""Text data for the GPT trainer, through Hugging Face ``datasets``.

Sources, in order of precedence:
  * ``files``: local text or JSON(L) files (``datasets``' "text" / "json" builders);
  * ``hub``: a dataset name on the Hugging Face hub (needs the network);
  * neither: a built-in corpus that every CPython carries, so a fresh machine trains offline (``builtin``):
    ``"python_docs"`` (default), the Python documentation topics (``pydoc_data.topics``, ~466 KB of English
    prose and grammar), or ``"python_stdlib"``, the running Python's standard library sources (10-30 MB of
    ``.py`` files, as the install has its tests or not; site-packages left out): large enough that a few hundred
    steps of 32k tokens see no window twice, so the training loss there measures learning rather than memorising.

Text is tokenised (UTF-8 bytes by default; ``tokenizer="bpe"``, a byte-level BPE trained on the corpus and cached
beside it; or a ``tokenizers`` tokenizer file), each document followed by an
end-of-document token (bytes: id 256, so the byte vocabulary has 257 ids), concatenated and cut into windows of
``seq_len + 1`` tokens (inputs and shifted targets), split into train and validation, and cached by ``datasets``
(its fingerprinted cache files: a second run does not tokenise again). A document is a row of a JSON(L) or hub
dataset, a whole text file, a documentation topic or a standard-library source file.

With ``document_masking`` each batch also says where its documents start (``Documents``): attention stays
within a document and rotary positions restart at each one. Off by default: then every attention backend computes
the same function at the same cost (``sdpa`` and ``eager`` have no packed path and need a (T, T) mask), and the
model sees its whole context, as GPT-2-style pretraining on concatenated text does.

Batches come from ``StepSampler``: the k-th training sample is a pure function of (seed, k), so a run
resumed from a checkpoint at step s sees exactly the batches the original run saw after step s, on any
number of processes.

With ``context_parallel=P`` (``flashtrain.trainer.parallel``) the P ranks of a context-parallel group read the same
samples, and each gets its shard of every sequence in the load-balanced layout (``flashtrain.distributed``):
{"inputs", "targets", "positions"} instead of {"tokens"}.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from .parallel import context_rank, data_rank

BUILTIN_CORPORA = ("python_docs", "python_stdlib")
BYTE_EOD = 256  # the byte vocabulary's end-of-document id, after the 256 byte values
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")  # a tokenizer's end-of-document token


class Documents(NamedTuple):
    """Where the documents of a (B, T) batch of inputs lie, for document masking. A document starts at each row's
    first token and after each end-of-document token.

    cu_seqlens: int32 (n + 1,) offsets of the n documents in the flattened (B * T) tokens, row by row;
    max_seqlen: the longest; positions: (B, T) long, each token's position in its document; doc_ids: (B, T) long,
    the index of its document (for the backends that build an explicit mask)."""
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    doc_ids: torch.Tensor


def find_documents(inputs: torch.Tensor, eod: int) -> Documents:
    """``Documents`` of (B, T) input ids whose documents end with ``eod`` (on the CPU, in the collate function)."""
    batch, seq = inputs.shape
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eod
    first = starts.flatten().nonzero().squeeze(1)  # (n,) flat index of each document's first token
    cu_seqlens = torch.cat([first, torch.tensor([batch * seq])]).to(torch.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    doc_ids = torch.repeat_interleave(torch.arange(first.shape[0]), lengths)
    positions = torch.arange(batch * seq) - torch.repeat_interleave(first, lengths)
    return Documents(cu_seqlens, int(lengths.max()), positions.view(batch, seq), doc_ids.view(batch, seq))


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
    """Write the built-in corpus ``name`` (``BUILTIN_CORPORA``; the module docstring) to a JSON-lines file once,
    a document per line ({"text": ...}); return its path."""
    import sys

    check_builtin(name)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    path = cache_dir / ("python_docs_topics.jsonl" if name == "python_docs"
                        else f"python{version}_stdlib_sources.jsonl")
    if not path.exists():
        if name == "python_docs":
            import pydoc_data.topics

            pieces = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
        else:
            pieces = [p.read_text(encoding="utf-8", errors="replace") for p in _stdlib_sources()]
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": piece}) + "\n" for piece in pieces)
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
                 text_field: str = "text", tokenizer: str | None = None, vocab_size: int = BYTE_EOD + 1,
                 val_fraction: float = 0.02, seed: int = 1234, num_workers: int = 0, cache_dir=None,
                 builtin: str = "python_docs", document_masking: bool = False, eod_token: int | None = None,
                 context_parallel: int = 1):
        super().__init__()
        if int(seq_len) < 1 or int(batch_size) < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive integers")
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.files = [files] if isinstance(files, str) else (list(files) if files else None)
        self.hub, self.hub_config, self.text_field = hub, hub_config, text_field
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.document_masking, self.eod_token = bool(document_masking), eod_token
        check_builtin(builtin)  # here, not at setup: a wrong name fails when the config is built
        self.builtin = builtin
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.context_parallel = int(context_parallel)  # ranks that split each sequence (one shard each)
        self.cache_dir = Path(cache_dir or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface"))
                              / "flashtrain")
        self.consumed_samples = 0  # restored from checkpoints (state_dict below)
        self.eod = None  # the end-of-document id, known once the text is tokenised (``_packed``)
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
            ds = datasets.load_dataset("json", data_files=str(builtin_corpus_file(self.cache_dir, self.builtin)),
                                       split="train")
        if self.text_field not in ds.column_names:
            raise ValueError(f"data.text_field={self.text_field!r} is not a column of the dataset; "
                             f"columns: {ds.column_names}")
        return ds

    def _encode_fn(self):
        """(encode(texts) -> id lists, the end-of-document id)."""
        if self.tokenizer is None:
            eod = BYTE_EOD if self.eod_token is None else self.eod_token
            if self.vocab_size <= max(255, eod):
                raise ValueError(f"data.vocab_size={self.vocab_size}: byte-level tokens and the end-of-document id "
                                 f"{eod} need at least {max(255, eod) + 1}")
            return (lambda texts: [list(t.encode("utf-8")) for t in texts]), eod
        tok = self._tokenizer()
        if tok.get_vocab_size() > self.vocab_size:
            raise ValueError(f"data.tokenizer has {tok.get_vocab_size()} tokens but data.vocab_size="
                             f"{self.vocab_size}; set data.vocab_size (the model's vocabulary follows it)")
        eod = self.eod_token
        if eod is None:
            eod = next((tok.token_to_id(name) for name in EOD_NAMES if tok.token_to_id(name) is not None), None)
        if eod is None:
            raise ValueError(f"data.tokenizer has none of the end-of-document tokens {list(EOD_NAMES)}; set "
                             "data.eod_token to the id that separates documents")
        if not 0 <= eod < self.vocab_size:
            raise ValueError(f"data.eod_token={eod} is outside the vocabulary [0, {self.vocab_size})")
        return (lambda texts: [e.ids for e in tok.encode_batch(texts)]), eod

    def _tokenizer(self):
        """The ``tokenizers`` tokenizer: "bpe", a byte-level BPE of ``vocab_size`` tokens trained on this corpus
        once and cached beside the data (``tokenizer.load_or_train``), or a tokenizer.json path. A literal
        end-of-document string inside a text stays text (``encode_special_tokens``)."""
        from tokenizers import Tokenizer

        from .tokenizer import bpe_path, check_vocab_size, corpus_key, load_or_train

        if self.tokenizer == "bpe":
            path = bpe_path(self.cache_dir, corpus_key(self._corpus_parts()), check_vocab_size(self.vocab_size))
            tok = load_or_train(lambda: self._raw()[self.text_field], self.vocab_size, path)
        else:
            if not Path(self.tokenizer).is_file():
                raise FileNotFoundError(f"data.tokenizer={self.tokenizer!r}: no such file; expected 'bpe' (train one "
                                        "on the corpus) or the path of a tokenizer.json")
            tok = Tokenizer.from_file(self.tokenizer)
        tok.encode_special_tokens = True
        return tok

    def _corpus_parts(self) -> list[str]:
        """Strings that identify the corpus, for the cached tokenizer's name."""
        if self.files:
            return [f"{Path(f).resolve()}:{Path(f).stat().st_size}:{Path(f).stat().st_mtime_ns}" for f in self.files]
        if self.hub:
            return [f"hub:{self.hub}:{self.hub_config}:{self.text_field}"]
        import sys
        return [f"builtin:{self.builtin}:{sys.version_info[0]}.{sys.version_info[1]}"]

    def _packed(self) -> datasets.Dataset:
        """(num_windows,) dataset of 'ids': seq_len + 1 tokens each, cut from the concatenated stream."""
        (encode, eod), field, window = self._encode_fn(), self.text_field, self.seq_len + 1
        self.eod = eod

        def tokenize(batch):
            return {"ids": [ids + [eod] for ids in encode(batch[field])]}

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
                             "need at least 2 (train and validation): use more text (data.builtin=python_stdlib, "
                             "10-30 MB; data.files=[...]; data.hub=NAME) or a shorter seq_len")
        n_val = max(1, int(len(packed) * self.val_fraction))
        split = packed.train_test_split(test_size=n_val, seed=self.seed, shuffle=True)
        self.train_set = split["train"].with_format("torch")
        self.val_set = split["test"].with_format("torch")

    # --- loaders -------------------------------------------------------------------------------------------
    def _global(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _world(self) -> tuple[int, int]:
        """(data-parallel rank, replicas): the ranks of a context-parallel group share one sample stream."""
        return data_rank(*self._global(), self.context_parallel)

    def train_dataloader(self):
        rank, world = self._world()
        sampler = StepSampler(len(self.train_set), self.seed, self.consumed_samples, rank, world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate,
                          num_workers=self.num_workers)

    @property
    def collate(self):
        """Rows -> {"tokens": (B, seq_len + 1)}, plus "documents" (``Documents`` of the inputs) when masking; with
        context_parallel > 1, this rank's shards {"inputs", "targets", "positions"} (``collate``)."""
        # the id _packed found: the tokenizer is not loaded (or a BPE trained) again per loader
        eod = (self.eod if self.eod is not None else self._encode_fn()[1]) if self.document_masking else None
        if self.context_parallel == 1:
            return functools.partial(collate, eod=eod)
        rank = context_rank(self._global()[0], self.context_parallel)
        return functools.partial(collate, eod=eod, context_rank=rank, context_size=self.context_parallel)

    # --- resumption ----------------------------------------------------------------------------------------
    def state_dict(self):
        trainer = self.trainer
        steps = trainer.global_step if trainer is not None else 0
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        return {"consumed_samples": steps * accumulate * self.batch_size * self._world()[1]}

    def load_state_dict(self, state):
        self.consumed_samples = int(state["consumed_samples"])


def collate(rows, eod: int | None = None, context_rank: int = 0, context_size: int = 1) -> dict:
    """The batch of ``rows``: {"tokens": (B, seq_len + 1)}, and with ``eod`` the "documents" of its inputs.

    With ``context_size`` P > 1, shard ``context_rank`` of every sequence in the load-balanced layout (chunks c and
    2P-1-c of 2P): {"inputs": (B, seq_len / P), "targets": (B, seq_len / P), "positions": (seq_len / P,) the global
    positions of those tokens} (no documents: ring attention has no document masking)."""
    tokens = torch.stack([r["ids"] for r in rows])
    if context_size > 1:
        if eod is not None:
            raise ValueError(f"data.document_masking with context_parallel={context_size}: ring attention has no "
                             "document masking yet")
        return shard_tokens(tokens, context_rank, context_size)
    if eod is None:
        return {"tokens": tokens}
    return {"tokens": tokens, "documents": find_documents(tokens[:, :-1], eod)}


def shard_tokens(tokens: torch.Tensor, rank: int, size: int) -> dict:
    """Shard ``rank`` of P = ``size`` of (B, T + 1) token windows: {"inputs", "targets"} (B, T / P) and "positions"
    (T / P,), the layout of ``flashtrain.distributed.shard_sequence`` (computed here without a process group)."""
    from flashtrain.distributed import positions  # here: flashtrain.distributed imports the Triton kernels

    seq = tokens.shape[1] - 1
    if seq % (2 * size):
        raise ValueError(f"seq_len={seq} with context_parallel={size}: expected a multiple of 2 x context_parallel "
                         f"= {2 * size}")
    index = positions(seq, rank, size)
    return {"inputs": tokens[:, :-1][:, index], "targets": tokens[:, 1:][:, index], "positions": index}


def input_tokens(batch: dict) -> int:
    """The input tokens this process holds of a batch from ``collate`` (its shard with context parallelism)."""
    return batch["inputs"].numel() if "inputs" in batch else batch["tokens"][:, :-1].numel()
