"""The byte-level BPE tokenizer: exact round trips, the end-of-document id, deterministic training, the cache, the
vocabulary-size check and the file that ``TextDataModule`` loads."""

import re

import pydoc_data.topics
import pytest
from tokenizers import Tokenizer

from flashtrain.trainer.data import TextDataModule
from flashtrain.trainer.tokenizer import EOD_ID, EOD_TOKEN, bpe_path, corpus_key, load_or_train, train_bpe

VOCAB = 300
UNICODE = ["naïve café — déjà vu", "日本語のテキスト", "emoji 🙂👍🏽 and ZWJ 👨‍👩‍👧", "e\u0301 combining",
           "\x00\x01 control\tand\r\nnewlines", "  leading and trailing spaces  ", "Ελληνικά, русский, عربى",
           "def f(x):\n    return x ** 2  # code", "", " "]


def corpus() -> list[str]:
    """About 8 KB of English documents (the first Python documentation topics), a str each."""
    topics = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    out, size = [], 0
    for text in topics:
        out.append(text[:2000])
        size += len(out[-1])
        if size > 8000:
            return out
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Path of a BPE of at most ``VOCAB`` tokens trained on ``corpus()``."""
    return train_bpe(corpus(), VOCAB, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def test_round_trip_eod_and_size(tiny):
    tok = Tokenizer.from_file(str(tiny))
    assert 257 < tok.get_vocab_size() <= VOCAB  # merges were learned, and no more than asked for
    assert tok.token_to_id(EOD_TOKEN) == EOD_ID == 0
    for text in UNICODE + corpus()[:2]:
        ids = tok.encode(text).ids
        assert all(0 < i < tok.get_vocab_size() for i in ids)  # no unknown token, no stray end-of-document
        assert tok.decode(ids, skip_special_tokens=False) == text
    text = corpus()[0]
    assert len(tok.encode(text).ids) < 0.8 * len(text.encode("utf-8"))  # the merges compress the training text
    ids = tok.encode(f"one{EOD_TOKEN}two").ids
    assert ids.count(EOD_ID) == 1 and tok.decode(ids, skip_special_tokens=False) == f"one{EOD_TOKEN}two"


def test_training_is_deterministic(tmp_path):
    a = train_bpe(corpus(), VOCAB, tmp_path / "a.json").read_bytes()
    b = train_bpe(corpus(), VOCAB, tmp_path / "b.json").read_bytes()
    assert a == b
    assert train_bpe(corpus(), 280, tmp_path / "c.json").read_bytes() != a  # the vocabulary size shows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "c.json"]  # no temporary file left


def test_load_or_train_trains_once(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return iter(corpus())

    path = bpe_path(tmp_path / "cache", corpus_key(["corpus.jsonl", "8123", "1700000000"]), VOCAB)
    first = load_or_train(texts, VOCAB, path)
    second = load_or_train(texts, VOCAB, path)
    assert len(calls) == 1 and path.is_file()
    assert first.to_str() == second.to_str() and second.token_to_id(EOD_TOKEN) == EOD_ID
    with pytest.raises(ValueError, match="data.vocab_size=280"):  # a file larger than asked for is not used
        load_or_train(texts, 280, path)


def test_corpus_key_and_path(tmp_path):
    key = corpus_key(["python_stdlib", "3.12"])
    assert re.fullmatch("[0-9a-f]{16}", key) and key == corpus_key(["python_stdlib", "3.12"])
    assert key != corpus_key(["python_stdlib", "3.13"]) and key != corpus_key(["python_stdlib3.12"])
    assert bpe_path(tmp_path, key, 32768) == tmp_path / f"bpe-32768-{key}.json"


@pytest.mark.parametrize("bad", [256, 0, -1, 300.0, "32768", True])
def test_vocab_size_is_checked(tmp_path, bad):
    with pytest.raises(ValueError, match=re.escape(f"data.vocab_size={bad!r}") + ".*at least 257"):
        train_bpe(corpus(), bad, tmp_path / "t.json")
    with pytest.raises(ValueError, match="data.vocab_size"):
        load_or_train(lambda: pytest.fail("texts_fn called for an invalid vocab_size"), bad, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_smallest_vocabulary_is_bytes_and_eod(tmp_path):
    tok = Tokenizer.from_file(str(train_bpe(corpus(), 257, tmp_path / "t.json")))
    assert tok.get_vocab_size() == 257 and tok.token_to_id(EOD_TOKEN) == EOD_ID
    text = "bytes only: ünïcödé 🙂"
    assert len(tok.encode(text).ids) == len(text.encode("utf-8"))  # no merges: one token a byte


def test_data_module_finds_the_eod(tiny):
    assert Tokenizer.from_file(str(tiny)).token_to_id("<|endoftext|>") == EOD_ID
    dm = TextDataModule(seq_len=16, batch_size=2, tokenizer=str(tiny), vocab_size=VOCAB, cache_dir=tiny.parent)
    encode, eod = dm._encode_fn()
    assert eod == EOD_ID
    tok = Tokenizer.from_file(str(tiny))
    assert [tok.decode(ids, skip_special_tokens=False) for ids in encode(UNICODE)] == UNICODE


def test_data_module_trains_and_caches_a_bpe(tmp_path):
    """data.tokenizer=bpe: a BPE of data.vocab_size tokens trained on the corpus once, cached beside the data; its
    end-of-document id separates documents, and a literal end-of-document string in a text stays text."""
    text = tmp_path / "a.txt"
    text.write_text("def attention(q, k, v): return softmax(q @ k.T) @ v  # <|endoftext|> in a comment\n" * 60)
    dm = TextDataModule(seq_len=31, batch_size=2, files=[str(text)], tokenizer="bpe", vocab_size=300,
                        cache_dir=tmp_path, val_fraction=0.2)
    dm.setup()
    cached = list(tmp_path.glob("bpe-300-*.json"))
    assert len(cached) == 1
    encode, eod = dm._encode_fn()
    assert eod == EOD_ID and list(tmp_path.glob("bpe-300-*.json")) == cached  # loaded, not trained again
    ids = encode(["x <|endoftext|> y"])[0]
    assert EOD_ID not in ids  # the literal string is text, not a document boundary
    batch = next(iter(dm.train_dataloader()))["tokens"]
    assert batch.shape == (2, 32) and int(batch.max()) < 300
