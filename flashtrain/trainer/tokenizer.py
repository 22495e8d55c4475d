"""A byte-level BPE tokenizer trained offline with Hugging Face ``tokenizers`` and cached as a ``tokenizer.json``.

The vocabulary is the end-of-document token ``EOD_TOKEN`` (id 0: the trainer numbers special tokens first), the 256
byte symbols of ``pre_tokenizers.ByteLevel.alphabet()`` (ids 1-256, in the order of their characters, not of the
bytes) and then the learned merges, in merge order, up to ``vocab_size`` ids in all (fewer when the corpus has no
more pairs to merge). Every string encodes (byte-level: no unknown token) and decodes back exactly. Training is
deterministic: the same texts and ``vocab_size`` give the same JSON bytes, so concurrent processes that train the
same tokenizer write the same file.

``TextDataModule`` finds the end-of-document id through ``EOD_NAMES``, which holds ``EOD_TOKEN``. A literal
``"<|endoftext|>"`` inside a text encodes as that id too, unless the loaded tokenizer has
``encode_special_tokens = True`` (a runtime setting: ``tokenizer.json`` does not store it).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
EOD_ID = 0  # special tokens come before the byte alphabet in the trained vocabulary
MIN_VOCAB_SIZE = 257  # 256 byte symbols + the end-of-document token
_BATCH = 1000  # texts per batch handed to the Rust trainer


def check_vocab_size(vocab_size) -> int:
    """``vocab_size`` as an int; ValueError unless it is an int >= ``MIN_VOCAB_SIZE``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"data.vocab_size={vocab_size!r}: a byte-level BPE needs an integer of at least "
                         f"{MIN_VOCAB_SIZE} (256 byte symbols and the end-of-document token {EOD_TOKEN!r})")
    return int(vocab_size)


def corpus_key(parts: Iterable[str]) -> str:
    """16 hex digits (sha256) naming a corpus, from strings that identify it: say its files' names, sizes and
    modification times, or a built-in corpus's name and the Python version."""
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:16]


def bpe_path(cache_dir: Path, corpus_key: str, vocab_size: int) -> Path:
    """Where the BPE of ``vocab_size`` tokens trained on the corpus ``corpus_key`` (``corpus_key()``) lives."""
    return Path(cache_dir) / f"bpe-{vocab_size}-{corpus_key}.json"


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts`` (documents, str each), write it to
    ``path`` as a ``tokenizer.json`` (atomically) and return ``path``. ``EOD_TOKEN`` gets id ``EOD_ID``."""
    vocab_size = check_vocab_size(vocab_size)
    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_batches(texts), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")  # unique per writer; created with the umask's mode
    try:
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent reader sees no file or a whole one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_or_train(texts_fn: Callable[[], Iterable[str]], vocab_size: int, path: Path) -> Tokenizer:
    """The tokenizer at ``path``; when there is none, one trained by ``train_bpe(texts_fn(), vocab_size, path)``
    (``texts_fn`` is called only then). ValueError when the file at ``path`` lacks ``EOD_TOKEN`` or has more than
    ``vocab_size`` tokens."""
    vocab_size = check_vocab_size(vocab_size)
    path = Path(path)
    if not path.exists():
        train_bpe(texts_fn(), vocab_size, path)
    tok = Tokenizer.from_file(str(path))
    if tok.token_to_id(EOD_TOKEN) is None or tok.get_vocab_size() > vocab_size:
        raise ValueError(f"{path}: {tok.get_vocab_size()} tokens and end-of-document id "
                         f"{tok.token_to_id(EOD_TOKEN)}; expected at most data.vocab_size={vocab_size} tokens "
                         f"and {EOD_TOKEN!r}. Delete the file to train it again")
    return tok
