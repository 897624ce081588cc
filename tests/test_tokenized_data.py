"""--data.tokenizer: JSON lines, parquet and `datasets` folders tokenized by a real (tiny, locally trained) BPE
tokenizer into cached memory-mapped shards, and the errors a user can meet."""
import json

import numpy as np
import pytest
import torch

from syncwise.cli import main
from syncwise.data import load_corpus
from syncwise.errors import ConfigError

pytest.importorskip("tokenizers")

DOCS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # document number {i}\n" for i in range(300)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    folder = tmp_path_factory.mktemp("tok")
    t.save(str(folder / "tokenizer.json"))
    return folder, t


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), d / "docs.parquet")
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(d / "docs_ds"))
    return d


def test_every_source_gives_the_same_tokens_and_they_decode(tok, sources, tmp_path):
    folder, t = tok
    eos = t.token_to_id("<|endoftext|>")
    expected = sum(len(t.encode(d).ids) + 1 for d in DOCS)
    streams = {}
    for name in ("docs.jsonl", "docs.parquet", "docs_ds"):
        c = load_corpus(str(sources / name), 0.1, tokenizer=str(folder), cache_dir=tmp_path)
        assert c.vocab_size == t.get_vocab_size() and not c.byte_level
        assert c.train.numel() + c.val.numel() == expected
        assert c.val.numel() > 0 and c.train.numel() > c.val.numel()
        streams[name] = (c.train.numpy().copy(), c.val.numpy().copy())
    assert all(np.array_equal(s[0], streams["docs.jsonl"][0]) for s in streams.values())
    first = streams["docs.jsonl"][0]
    cut = int(np.argmax(first == eos))  # the first document that went to train, decoded back
    assert t.decode(first[:cut].tolist()) in DOCS


def test_the_cache_is_reused_and_follows_the_source(tok, sources, tmp_path):
    from syncwise.data.tokenized import prepare

    folder, _ = tok
    a = prepare(str(sources / "docs.jsonl"), str(folder), 0.1, cache_dir=tmp_path)
    stamp = (a / "train.bin").stat().st_mtime_ns
    assert prepare(str(sources / "docs.jsonl"), str(folder), 0.1, cache_dir=tmp_path) == a
    assert (a / "train.bin").stat().st_mtime_ns == stamp  # not tokenized again
    assert json.loads((a / "meta.json").read_text())["dtype"] == "uint16"
    other = tmp_path / "more.jsonl"
    other.write_text((sources / "docs.jsonl").read_text() + json.dumps({"text": "one more"}) + "\n")
    assert prepare(str(other), str(folder), 0.1, cache_dir=tmp_path) != a


def test_worker_processes_give_the_same_shards_with_a_progress_bar_on_a_terminal(tok, sources, tmp_path, monkeypatch):
    """2 spawned tokenizing processes write the same shards as 1; on an interactive terminal (rank 0) a rich progress
    bar shows the rows done and the tokens per second; off a terminal, nothing is printed."""
    import io
    import sys

    from syncwise.data.tokenized import prepare

    folder, _ = tok
    one = prepare(str(sources / "docs.parquet"), str(folder), 0.1, cache_dir=tmp_path / "a", workers=1)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    two = prepare(str(sources / "docs.parquet"), str(folder), 0.1, cache_dir=tmp_path / "b", workers=2)
    monkeypatch.undo()
    for name in ("train.bin", "val.bin"):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    meta = json.loads((two / "meta.json").read_text())
    assert meta["workers"] == 2 and meta["documents"] == len(DOCS)
    assert "tokenizing docs.parquet" in screen.getvalue() and f"{len(DOCS)}/{len(DOCS)}" in screen.getvalue()
    assert "tok/s" in screen.getvalue()


def test_concurrent_callers_build_the_cache_once(tok, sources, tmp_path, monkeypatch):
    """Ranks of a plain torchrun job each call load_corpus: one builds, the others wait on the lock and map it."""
    import threading

    from syncwise.data import tokenized

    folder, _ = tok
    builds = []
    real = tokenized._build
    monkeypatch.setattr(tokenized, "_build", lambda *a: (builds.append(1), real(*a)))
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(tokenized.prepare(
        str(sources / "docs.jsonl"), str(folder), 0.1, cache_dir=tmp_path, workers=1))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 3 and len(set(outs)) == 1 and len(builds) == 1


def test_clear_errors(tok, sources, tmp_path):
    folder, _ = tok
    with pytest.raises(ConfigError, match="data.text_column.*line 1 has: text, id"):
        load_corpus(str(sources / "docs.jsonl"), tokenizer=str(folder), text_column="body", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="data.text_column.*a column of .*: text, id"):
        load_corpus(str(sources / "docs.parquet"), tokenizer=str(folder), text_column="body", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="data.text_column.*a column of .*: text"):
        load_corpus(str(sources / "docs_ds"), tokenizer=str(folder), text_column="body", cache_dir=tmp_path)
    from syncwise.data.tokenized import prepare, resolve_workers

    with pytest.raises(ConfigError, match="data.tokenize_workers.*an integer ≥ 0"):
        prepare(str(sources / "docs.jsonl"), str(folder), cache_dir=tmp_path, workers=-1)
    assert resolve_workers(0, 1 << 20) == 1 and resolve_workers(3, 1 << 20) == 3  # small: no worker processes
    assert 1 <= resolve_workers(0, 1 << 30) <= 8
    with pytest.raises(ConfigError, match="data.corpus.*not written by save_to_disk"):
        load_corpus(str(tmp_path), tokenizer=str(folder), cache_dir=tmp_path / "c")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="data.corpus.*is empty"):
        load_corpus(str(empty), tokenizer=str(folder), cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="data.tokenizer.*tokenizer.json"):
        load_corpus(str(sources / "docs.jsonl"), tokenizer=str(tmp_path / "nope"), cache_dir=tmp_path)
    nano = tmp_path / "nano"
    nano.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(nano / "train.bin")
    (nano / "meta.json").write_text(json.dumps({"vocab_size": 50304}))
    with pytest.raises(ConfigError, match="data.tokenizer.*50304 ids.*this one has 300"):
        load_corpus(str(nano), tokenizer=str(folder), cache_dir=tmp_path)


def test_syncwise_train_on_a_tokenized_jsonl(tok, sources, tmp_path, monkeypatch, capsys):
    folder, _ = tok
    monkeypatch.setenv("SYNCWISE_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--preset", "tiny", "--steps", "3", "--run-dir", str(run_dir),
                 "--data.corpus", str(sources / "docs.jsonl"), f"--data.tokenizer={folder}",
                 "--data.seq_len=16", "--data.batch_size=2"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    assert "docs.jsonl" in capsys.readouterr().out
    # a bad column fails before any worker, naming the field
    assert main(["train", "--nproc", "1", "--preset", "tiny", "--steps", "3", "--run-dir", str(tmp_path / "r2"),
                 "--data.corpus", str(sources / "docs.jsonl"), f"--data.tokenizer={folder}",
                 "--data.text_column=body"]) == 2
    assert "data.text_column" in capsys.readouterr().err


def _mapped_file(t):
    """The file whose mapping holds tensor ``t``'s memory (/proc/self/maps), or None for anonymous memory."""
    at = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi:
            return rest[4] if len(rest) > 4 else None
    return None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("kind", ["parquet", "text"])
def test_a_corpus_larger_than_the_memory_limit_streams(kind, tok, tmp_path, monkeypatch):
    """Tokenizing streams (rows or text pieces in, ids appended to the shards batch by batch) and training maps the
    shards: with the batch sizes turned down, the Python/numpy heap's peak while tokenizing (tracemalloc) stays
    under a 256 KiB limit and does not grow when the corpus grows 4x to shards of several times that limit; the
    train tokens the loader reads are a mapping of train.bin, not a copy."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from syncwise.data import TokenBatchLoader, tokenized

    monkeypatch.setattr(tokenized, "BATCH_DOCS", 16)
    monkeypatch.setattr(tokenized, "BATCH_CHARS", 1 << 14)
    monkeypatch.setattr(tokenized, "ROWS_PER_READ", 16)
    monkeypatch.setattr(tokenized, "TEXT_PIECE_CHARS", 1 << 14)
    limit = 256 << 10
    folder, t = tok
    peaks, shards = [], []
    for mult in (1, 4):
        path = tmp_path / f"corpus{mult}.{'parquet' if kind == 'parquet' else 'txt'}"
        rows = [DOCS[i % len(DOCS)] * 5 for i in range(1500 * mult)]
        if kind == "parquet":
            with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as w:
                for at in range(0, len(rows), 16):
                    w.write_table(pa.table({"text": rows[at:at + 16]}))
        else:
            path.write_text("".join(rows))
        tracemalloc.start()
        try:
            out = tokenized.prepare(str(path), str(folder), 0.1, cache_dir=tmp_path / "cache", workers=1)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        shards.append(sum(p.stat().st_size for p in out.glob("*.bin")))
    assert shards[1] > 4 * limit and shards[1] > 3.5 * shards[0]
    assert max(peaks) < limit, (peaks, shards)
    assert peaks[1] < 1.5 * peaks[0], (peaks, shards)  # flat in the corpus' size
    c = load_corpus(str(path), 0.1, tokenizer=str(folder), cache_dir=tmp_path / "cache")
    assert c.train.numel() + c.val.numel() == shards[1] // 2  # uint16
    assert _mapped_file(c.train) == str(out / "train.bin")
    x, y = next(TokenBatchLoader(c.train, 4, 32, seed=0))
    assert x.shape == (4, 32) and int(x.max()) < t.get_vocab_size()


def test_a_tokenized_run_resumes_at_exactly_the_next_batch(tok, sources, tmp_path, monkeypatch):
    """2 steps, then --resume auto to 4, on a tokenized parquet corpus: steps 3 and 4 see the batches (and give
    the losses) of an uninterrupted 4-step run, bit for bit; the loader's checkpointed position is the next batch."""
    from syncwise.data import TokenBatchLoader

    folder, _ = tok
    monkeypatch.setenv("SYNCWISE_CACHE_DIR", str(tmp_path / "cache"))
    common = ["train", "--nproc", "1", "--preset", "tiny", "--data.corpus", str(sources / "docs.parquet"),
              f"--data.tokenizer={folder}", "--data.seq_len=16", "--data.batch_size=2", "--data.prefetch=0",
              "--train.val_batches=1", "--ckpt.interval=0"]
    assert main([*common, "--steps", "4", "--run-dir", str(tmp_path / "straight")]) == 0
    assert main([*common, "--steps", "2", "--run-dir", str(tmp_path / "parts")]) == 0
    assert main([*common, "--steps", "4", "--run-dir", str(tmp_path / "parts"), "--resume", "auto"]) == 0

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())}

    straight, parts = losses("straight"), losses("parts")
    assert [parts[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]
    # the loader's own resume rule on these tokens: the batch after a restore is the uninterrupted run's next one
    train = load_corpus(str(sources / "docs.parquet"), tokenizer=str(folder), cache_dir=tmp_path / "cache").train
    a, b = TokenBatchLoader(train, 2, 16, seed=1337), TokenBatchLoader(train, 2, 16, seed=1337)
    for _ in range(5):
        next(a)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


def test_an_hf_model_on_tokenized_data_and_a_vocabulary_too_small(tok, sources, tmp_path, monkeypatch, capsys):
    """--model hf:DIR whose vocab_size (256) does not cover the tokenizer's 300 ids: one line naming the field and
    both sizes, before any worker starts; with 320 it trains (first loss about ln 320: a random init)."""
    transformers = pytest.importorskip("transformers")
    folder, _ = tok
    model = tmp_path / "llama"
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, architectures=["LlamaForCausalLM"]).save_pretrained(model)
    monkeypatch.setenv("SYNCWISE_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--model", f"hf:{model}", "--steps", "2", "--run-dir", str(run_dir),
                 "--data.corpus", str(sources / "docs.jsonl"), f"--data.tokenizer={folder}",
                 "--data.seq_len=16", "--data.batch_size=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'model.preset'" in err, err
    assert "300 ids" in err and "vocab_size 256" in err, err
    assert not run_dir.exists()
    # a vocabulary that covers the tokenizer's ids trains on the tokenized data
    transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, architectures=["LlamaForCausalLM"]).save_pretrained(model)
    assert main(["train", "--nproc", "1", "--model", f"hf:{model}", "--steps", "2", "--run-dir", str(run_dir),
                 "--data.corpus", str(sources / "docs.jsonl"), f"--data.tokenizer={folder}",
                 "--data.seq_len=16", "--data.batch_size=2"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == pytest.approx(np.log(320), rel=0.05)
