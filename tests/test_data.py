import json
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from distributed import run_workers
from syncwise.data import (ByteTokenizer, SmartPrefetcher, TokenBatchLoader, evaluation_batches, load_corpus,
                           stdlib_files)
from syncwise.data.corpus import _is_val
from syncwise.errors import ConfigError, SyncwiseError


# ---------------------------------------------------------------- tokenizer
def test_byte_tokenizer_round_trip_and_replacement():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓ 🚀\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(tok.encode_array(text)) == text
    # A lone continuation byte is not valid UTF-8: replaced, not an exception.
    assert tok.decode([104, 0x80, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match="256"):
        tok.decode([1, 256])


# ---------------------------------------------------------------- corpora
def test_stdlib_corpus_is_deterministic_cached_and_split_by_file(tmp_path):
    cold = load_corpus("stdlib", cache_dir=tmp_path)
    cache_files = list(tmp_path.iterdir())
    assert len(cache_files) == 1 and cache_files[0].suffix == ".npz"  # atomic write left no temp file
    warm = load_corpus("stdlib", cache_dir=tmp_path)
    assert cold.vocab_size == 256 and cold.name == "stdlib"
    assert cold.train.dtype == torch.uint8 and cold.train.dim() == 1
    assert cold.train.numel() > 1_000_000 and cold.val.numel() > 10_000
    assert torch.equal(cold.train, warm.train) and torch.equal(cold.val, warm.val)

    # Val is made of whole files chosen by a hash of their path: a large val file's text is in the
    # val stream and not in train, and vice versa for a train file.
    train_b, val_b = cold.train.numpy().tobytes(), cold.val.numpy().tobytes()
    _, files = stdlib_files()
    val_files = [p for rel, p in files if _is_val(rel, 0.05)]
    train_files = [p for rel, p in files if not _is_val(rel, 0.05)]
    assert val_files and train_files
    big_val = max(val_files, key=lambda p: p.stat().st_size).read_bytes()
    big_train = max(train_files, key=lambda p: p.stat().st_size).read_bytes()
    assert big_val in val_b and big_val not in train_b
    assert big_train in train_b and big_train not in val_b

    # A corrupt cache is rebuilt, not fatal; a smaller cap is a different cache entry.
    cache_files[0].write_bytes(b"garbage")
    assert torch.equal(load_corpus("stdlib", cache_dir=tmp_path).train, cold.train)
    small = load_corpus("stdlib", max_bytes=200_000, cache_dir=tmp_path)
    assert small.train.numel() + small.val.numel() == 200_000
    assert "first 200,000 bytes" in small.description


def _write_text_tree(root, n):
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"file {i}: " + "lorem ipsum " * (5 + i) + "\n")


def test_text_folder_corpus_splits_by_path_hash(tmp_path):
    _write_text_tree(tmp_path / "a", 60)
    (tmp_path / "a" / "image.png").write_bytes(b"\x89PNG not text")
    c = load_corpus(str(tmp_path / "a"), val_fraction=0.2)
    assert c.vocab_size == 256 and c.byte_level
    assert c.files["train"] > 0 and c.files["val"] > 0 and c.files["train"] + c.files["val"] == 60
    everything = c.train.numpy().tobytes() + c.val.numpy().tobytes()
    assert b"PNG" not in everything
    for i in range(60):
        rel = f"d{i % 3}/f{i:03d}.txt"
        text = (tmp_path / "a" / rel).read_bytes()
        assert text in (c.val if _is_val(rel, 0.2) else c.train).numpy().tobytes()
    # Adding a file moves no other file between train and val.
    _write_text_tree(tmp_path / "b", 61)
    c2 = load_corpus(str(tmp_path / "b"), val_fraction=0.2)
    assert c2.files["val"] + c2.files["train"] == 61
    for i in range(61):
        rel = f"d{i % 3}/f{i:03d}.txt"
        text = (tmp_path / "b" / rel).read_bytes()
        assert text in (c2.val if _is_val(rel, 0.2) else c2.train).numpy().tobytes()


def test_single_text_file_holds_out_its_tail(tmp_path):
    p = tmp_path / "book.txt"
    p.write_text("abcdefghij" * 100)
    c = load_corpus(str(p), val_fraction=0.1)
    data = p.read_bytes() + b"\n"
    assert c.train.numpy().tobytes() + c.val.numpy().tobytes() == data
    assert c.val.numel() == round(len(data) * 0.1)


def test_nanogpt_bin_corpora(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 5000, 10_000).astype(np.uint16)
    val = rng.integers(0, 5000, 1_000).astype(np.uint16)
    folder = tmp_path / "owt"
    folder.mkdir()
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    c = load_corpus(str(folder))  # no meta: vocab = max token + 1
    assert c.train.dtype == torch.uint16 and not c.byte_level
    assert np.array_equal(c.train.numpy(), train) and np.array_equal(c.val.numpy(), val)
    assert c.vocab_size == int(max(train.max(), val.max())) + 1
    x, y = next(TokenBatchLoader(c.train, 4, 16))
    assert x.dtype == torch.long and int(x.max()) < c.vocab_size and torch.equal(x[:, 1:], y[:, :-1])

    (folder / "meta.json").write_text(json.dumps({"vocab_size": 50304}))
    assert load_corpus(str(folder / "train.bin")).vocab_size == 50304

    # nanoGPT's meta.pkl (plain data) is read; a pickle that names any global is refused.
    (folder / "meta.json").unlink()
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 5000, "itos": {0: "a"}, "stoi": {"a": 0}}))
    assert load_corpus(str(folder)).vocab_size == 5000
    # ids beyond the vocabulary its meta names: one line naming the file, not an IndexError in the embedding
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    with pytest.raises(ConfigError, match="train.bin holds id 4999"):
        load_corpus(str(folder))
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "f": print}))
    with pytest.raises(ConfigError, match="print"):
        load_corpus(str(folder))

    lone = tmp_path / "tokens.bin"
    train.tofile(lone)
    c = load_corpus(str(lone), val_fraction=0.1)
    assert c.train.numel() == 9_000 and c.val.numel() == 1_000
    assert np.array_equal(np.concatenate([c.train.numpy(), c.val.numpy()]), train)


def test_bad_corpus_specs_raise_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_corpus(str(tmp_path / "nope"))
    assert e.value.field == "data.corpus" and "stdlib" in e.value.accepted and "nope" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no text files"):
        load_corpus(str(tmp_path / "empty"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="0 bytes"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="uint16"):
        load_corpus(str(tmp_path / "odd.bin"))
    with pytest.raises(ConfigError) as e:
        load_corpus("stdlib", val_fraction=1.5)
    assert e.value.field == "data.val_fraction"


# ---------------------------------------------------------------- sampler
def _window_ids(x, seq_len):
    # With tokens = arange(N), a window's first token tells which window it is.
    return (x[:, 0] // seq_len).tolist()


def test_ranks_take_disjoint_windows_that_cover_the_epoch():
    seq_len, bs, ws = 8, 3, 2
    tokens = torch.arange(12 * bs * ws * seq_len + 1, dtype=torch.int32)  # exactly 12 steps per epoch
    loaders = [TokenBatchLoader(tokens, bs, seq_len, rank=r, world_size=ws, seed=7) for r in range(ws)]
    assert len(loaders[0]) == 12 and loaders[0].n_windows == 72
    seen = []
    for ld in loaders:
        ids = []
        for _ in range(len(ld)):
            x, y = next(ld)
            assert x.shape == (bs, seq_len) and x.dtype == torch.long
            assert torch.equal(y, x + 1)  # y is x shifted by one token
            ids += _window_ids(x, seq_len)
        assert ld.epoch == 0
        seen.append(ids)
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(72))
    # The next epoch is another permutation of the same windows.
    x, _ = next(loaders[0])
    assert loaders[0].epoch == 1
    assert not torch.equal(loaders[0].permutation(1), loaders[0].permutation(0))


def test_leftover_windows_are_skipped_and_never_shared():
    tokens = torch.arange(50 * 4 + 1, dtype=torch.int32)  # 50 windows of 4; 3 ranks x 4 = 12 per step
    loaders = [TokenBatchLoader(tokens, 4, 4, rank=r, world_size=3) for r in range(3)]
    assert len(loaders[0]) == 4
    ids = [w for ld in loaders for _ in range(4) for w in _window_ids(next(ld)[0], 4)]
    assert len(ids) == len(set(ids)) == 48
    assert set(ids) == set(loaders[0].permutation(0)[:48].tolist())


def _shard_worker(rank, world_size):
    import torch.distributed as dist

    from syncwise.comm import all_gather

    torch.set_num_threads(1)
    tokens = torch.arange(10 * 2 * 2 * 16 + 1, dtype=torch.int32)
    loader = TokenBatchLoader(tokens, 2, 16, rank=dist.get_rank(), world_size=dist.get_world_size(), seed=3)
    mine = torch.tensor([w for _ in range(len(loader)) for w in _window_ids(next(loader)[0], 16)])
    out = torch.empty(mine.numel() * world_size, dtype=mine.dtype)
    all_gather(out, mine)
    return out.tolist()


def test_sharding_across_real_processes():
    res = run_workers(_shard_worker, 2)
    assert res[0] == res[1]
    assert sorted(res[0]) == list(range(40))


def test_resume_is_exact_across_an_epoch_boundary():
    tokens = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    ref = TokenBatchLoader(tokens, 4, 32, rank=1, world_size=2, seed=11)
    n_epoch = len(ref)  # 156 windows // (4 x 2 per step) = 19 batches
    first = [next(ref) for _ in range(n_epoch - 2)]
    state = ref.state_dict()
    assert state["epoch"] == 0 and state["position"] == n_epoch - 2
    expected = [next(ref) for _ in range(5)]  # crosses into epoch 1
    assert ref.epoch == 1

    resumed = TokenBatchLoader(tokens, 4, 32, rank=1, world_size=2, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    got = [next(resumed) for _ in range(5)]
    for (xe, ye), (xg, yg) in zip(expected, got):
        assert torch.equal(xe, xg) and torch.equal(ye, yg)
    assert first  # the resumed loader did not replay anything before the saved point
    assert not any(torch.equal(got[0][0], x) for x, _ in first)

    with pytest.raises(SyncwiseError, match="seq_len"):
        TokenBatchLoader(tokens, 4, 16, rank=1, world_size=2, seed=11).load_state_dict(state)


def test_resume_on_a_different_world_size_does_not_repeat_windows():
    tokens = torch.arange(64 * 8 + 1, dtype=torch.int32)
    two = [TokenBatchLoader(tokens, 2, 8, rank=r, world_size=2) for r in range(2)]
    before = [w for _ in range(5) for ld in two for w in _window_ids(next(ld)[0], 8)]
    one = TokenBatchLoader(tokens, 2, 8)
    one.load_state_dict(two[0].state_dict())
    after = [w for _ in range(len(one) - 10) for w in _window_ids(next(one)[0], 8)]
    assert sorted(before + after) == list(range(64))


def test_bad_loader_arguments():
    tokens = torch.arange(100)
    with pytest.raises(ConfigError) as e:
        TokenBatchLoader(tokens, 8, 16)
    assert e.value.field == "data.batch_size"
    with pytest.raises(ConfigError, match="rank"):
        TokenBatchLoader(tokens, 1, 4, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="seq_len"):
        TokenBatchLoader(tokens, 1, 0)


def test_evaluation_batches_fixed_and_disjoint():
    val = torch.arange(40 * 8 + 1, dtype=torch.int32)
    b0 = evaluation_batches(val, 2, 8, 3, rank=0, world_size=2)
    b1 = evaluation_batches(val, 2, 8, 3, rank=1, world_size=2)
    assert len(b0) == len(b1) == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(b0, evaluation_batches(val, 2, 8, 3, 0, 2)))
    ids0 = [w for x, _ in b0 for w in _window_ids(x, 8)]
    ids1 = [w for x, _ in b1 for w in _window_ids(x, 8)]
    assert not set(ids0) & set(ids1)
    assert max(ids0 + ids1) >= 30  # spread over the whole val stream, not just its start
    assert len(evaluation_batches(val, 2, 8, 100, 0, 2)) == 10  # capped at what the stream holds
    with pytest.raises(ConfigError):
        evaluation_batches(val[:10], 2, 8, 1)


# ---------------------------------------------------------------- prefetcher
def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _wait_full(pf, n, timeout=30.0):
    # Poll (no timing assumption): the producer fills the queue to `lookahead`, however slow it is.
    deadline = time.monotonic() + timeout
    while len(pf._buf) < n:
        assert time.monotonic() < deadline, "producer never filled the queue"
        time.sleep(0.001)


def test_prefetcher_yields_the_same_batches_and_resumes_exactly():
    tokens = torch.randint(0, 256, (4000,), dtype=torch.uint8)
    ref = TokenBatchLoader(tokens, 4, 16, seed=5)
    expected = [next(ref) for _ in range(40)]  # > one epoch (62 windows // 4 = 15 batches)

    with SmartPrefetcher(TokenBatchLoader(tokens, 4, 16, seed=5), lookahead=3) as pf:
        got = [next(pf) for _ in range(9)]
        _wait_full(pf, 3)  # the producer is 3 batches ahead of the consumer
        got.append(next(pf))
        _wait_full(pf, 3)
        state = pf.state_dict()
        assert pf.loader.state_dict()["position"] == 13 and state["position"] == 10  # handed out, not prefetched
        got += [next(pf) for _ in range(30)]
    assert all(_same(e, g) for e, g in zip(expected, got))
    assert not pf._thread

    with SmartPrefetcher(TokenBatchLoader(tokens, 4, 16, seed=5), lookahead=3) as pf2:
        pf2.load_state_dict(state)
        assert all(_same(expected[10 + i], next(pf2)) for i in range(20))
        # Rewinding a running prefetcher drops what it had prefetched.
        pf2.load_state_dict(state)
        assert _same(expected[10], next(pf2))
        assert pf2.stats()["batches"] == 21


class _Failing:
    def __init__(self, n_ok):
        self.n_ok = n_ok

    def __iter__(self):
        for i in range(self.n_ok):
            yield torch.full((2,), i)
        raise ValueError("disk on fire")


def test_prefetcher_reraises_producer_errors_and_stops_on_exhaustion():
    pf = SmartPrefetcher(_Failing(3), lookahead=2)
    assert [int(next(pf)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="disk on fire"):
        next(pf)
    with pytest.raises(ValueError):  # stays failed, does not hang
        next(pf)
    pf.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(pf)

    with SmartPrefetcher([torch.zeros(1), torch.ones(1)]) as pf:
        assert [float(t) for t in pf] == [0.0, 1.0]
    with pytest.raises(TypeError, match="state_dict"):
        SmartPrefetcher([1]).state_dict()


class _Slow:
    def __iter__(self):
        i = 0
        while True:
            time.sleep(0.05)  # far slower than the consumer, which then always finds the queue empty
            yield torch.tensor([i])
            i += 1


def test_prefetcher_pattern_detection_deepens_queue_when_starved():
    before = threading.active_count()
    with SmartPrefetcher(_Slow(), lookahead=1, pattern_detection=True, max_lookahead=4) as pf:
        assert [int(next(pf)) for _ in range(6)] == list(range(6))
        s = pf.stats()
        assert s["starved"] >= 2 and pf.lookahead >= 3 and pf.lookahead <= 4
    assert threading.active_count() == before  # close() joined the producer thread
    with pytest.raises(ConfigError):
        SmartPrefetcher(_Slow(), lookahead=0)
