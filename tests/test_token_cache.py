"""The token cache is keyed by content and its shards are checked on open (issue 42, row 8): a corpus edited with
its size and mtime kept gets a new cache; a truncated, garbage or out-of-vocabulary token file, or a meta.json
naming a dtype syncwise cannot read, is refused in one line naming the file."""
import json
import os

import numpy as np
import pytest

from syncwise.cli import main
from syncwise.data import load_corpus
from syncwise.errors import ConfigError

pytest.importorskip("tokenizers")

DOCS = [f"def f_{i}(x):\n    return x + {i}\n" for i in range(60)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<|endoftext|>"]))
    folder = tmp_path_factory.mktemp("tok")
    t.save(str(folder / "tokenizer.json"))
    return folder


def _corpus(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def test_an_edit_that_keeps_size_and_mtime_gets_a_new_cache(tok, tmp_path):
    src = tmp_path / "docs.jsonl"
    _corpus(src, DOCS)
    first = load_corpus(str(src), 0.1, tokenizer=str(tok), cache_dir=tmp_path / "c")
    before = first.train.numpy().copy()
    st = src.stat()
    edited = DOCS[:]
    edited[3] = edited[3].replace("return", "RETURN")  # the same length, other tokens
    _corpus(src, edited)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # what cp -p / rsync -t keep
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    after = load_corpus(str(src), 0.1, tokenizer=str(tok), cache_dir=tmp_path / "c")
    assert not np.array_equal(after.train.numpy(), before)
    assert len(list((tmp_path / "c" / "tokenized").iterdir())) >= 2 + 0  # two caches (and lock files)
    # unchanged, it is found again without tokenizing (the digest is remembered)
    folder = next(p for p in (tmp_path / "c" / "tokenized").iterdir() if p.is_dir() and
                  json.loads((p / "meta.json").read_text())["splits"]["train"] == after.train.numel())
    stamp = (folder / "train.bin").stat().st_mtime_ns
    load_corpus(str(src), 0.1, tokenizer=str(tok), cache_dir=tmp_path / "c")
    assert (folder / "train.bin").stat().st_mtime_ns == stamp


def _cache(tok, tmp_path):
    from syncwise.data.tokenized import prepare

    src = tmp_path / "docs.jsonl"
    _corpus(src, DOCS)
    return src, prepare(str(src), str(tok), 0.1, cache_dir=tmp_path / "c")


def _refused(fn, *words):
    with pytest.raises(ConfigError) as e:
        fn()
    text = str(e.value)
    assert len(text.splitlines()) == 1 and "'data.corpus'" in text, text
    for w in words:
        assert w in text, text
    return text


def test_a_truncated_cache_shard_is_refused_in_one_line(tok, tmp_path):
    src, folder = _cache(tok, tmp_path)
    size = (folder / "train.bin").stat().st_size
    os.truncate(folder / "train.bin", size - 20)
    _refused(lambda: load_corpus(str(src), 0.1, tokenizer=str(tok), cache_dir=tmp_path / "c"),
             "train.bin", "truncated")


def test_a_garbage_cache_shard_of_the_right_length_is_refused(tok, tmp_path):
    src, folder = _cache(tok, tmp_path)
    shard = folder / "train.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    np.random.default_rng(0).permutation(ids).tofile(shard)  # every id in the vocabulary, the bytes wrong
    _refused(lambda: load_corpus(str(src), 0.1, tokenizer=str(tok), cache_dir=tmp_path / "c"),
             "train.bin", "blake2b")


def _nanogpt(tmp_path, vocab, top, dtype="uint16"):
    d = tmp_path / "nano"
    d.mkdir(parents=True)
    ids = np.arange(4000, dtype=np.uint16) % 50
    ids[1234] = top
    ids.tofile(d / "train.bin")
    (np.arange(400, dtype=np.uint16) % 50).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype}))
    return d


def test_out_of_vocabulary_ids_are_refused_in_one_line_not_an_index_error(tmp_path):
    d = _nanogpt(tmp_path, vocab=100, top=4000)
    text = _refused(lambda: load_corpus(str(d), cache_dir=tmp_path / "c"), "train.bin", "4000", "vocab_size 100")
    assert "1,234" in text
    # the CLI's check, before any worker: one line, exit 2
    assert main(["train", "--check", "--preset", "tiny", "--data.corpus", str(d), "--steps", "1",
                 "--run-dir", str(tmp_path / "run")]) == 2
    # a clean folder loads, and a second open is remembered (no scan needed)
    ok = _nanogpt(tmp_path / "ok", vocab=100, top=99)
    assert load_corpus(str(ok), cache_dir=tmp_path / "c").vocab_size == 100
    assert list((tmp_path / "c" / "verified").iterdir())


def test_a_meta_json_with_an_unreadable_dtype_is_refused(tmp_path):
    d = _nanogpt(tmp_path, vocab=100, top=7, dtype="float32")
    _refused(lambda: load_corpus(str(d), cache_dir=tmp_path / "c"), "meta.json", "float32")
    (d / "meta.json").write_text("{not json")
    _refused(lambda: load_corpus(str(d), cache_dir=tmp_path / "c"), "meta.json")
