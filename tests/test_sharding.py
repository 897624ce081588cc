import itertools
import logging

import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler, TensorDataset,
                              WeightedRandomSampler)
from torch.utils.data.distributed import DistributedSampler

from syncwise.data import ShardedLoader, TokenBatchLoader, shard_loader
from syncwise.data import sharding
from syncwise.errors import ConfigError, SyncwiseError

N = 20


def dataset(n=N):
    return TensorDataset(torch.arange(n))


def ids(batch):
    return batch[0].tolist()


def epoch_ids(loader):
    return [i for b in loader for i in ids(b)]


def stream(loader, k):
    """The first k batches of the trainer's loop: ``loader`` re-entered each epoch."""
    def forever():
        while True:
            yield from loader
    return [ids(b) for b in itertools.islice(forever(), k)]


class CountingDataset(Dataset):
    def __init__(self, n=N):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor(i)


@pytest.fixture(autouse=True)
def _reset_warning():
    sharding._warned_unsharded = False
    yield
    sharding._warned_unsharded = False


def test_two_ranks_shuffled_disjoint_cover_and_reshuffle_per_epoch():
    r0 = shard_loader(DataLoader(dataset(), batch_size=3, shuffle=True), rank=0, world_size=2, seed=7)
    r1 = shard_loader(DataLoader(dataset(), batch_size=3, shuffle=True), rank=1, world_size=2, seed=7)
    assert isinstance(r0, ShardedLoader) and isinstance(r0.sampler, DistributedSampler)
    e0 = [epoch_ids(r0), epoch_ids(r1)]
    assert not set(e0[0]) & set(e0[1]) and sorted(e0[0] + e0[1]) == list(range(N))
    e1 = [epoch_ids(r0), epoch_ids(r1)]  # second pass = epoch 1
    assert r0.epoch == 1
    assert not set(e1[0]) & set(e1[1]) and sorted(e1[0] + e1[1]) == list(range(N))
    assert e1 != e0
    # Same seed, same construction: the same shards in the same order; another seed: another order.
    again = shard_loader(DataLoader(dataset(), batch_size=3, shuffle=True), rank=0, world_size=2, seed=7)
    assert [epoch_ids(again), epoch_ids(again)] == [e0[0], e1[0]]
    other = shard_loader(DataLoader(dataset(), batch_size=3, shuffle=True), rank=0, world_size=2, seed=8)
    assert epoch_ids(other) != e0[0]


def test_sequential_loader_keeps_order_and_settings():
    collate = lambda items: [torch.stack([t[0] for t in items])]  # noqa: E731
    src = DataLoader(dataset(), batch_size=4, shuffle=False, drop_last=True, collate_fn=collate)
    r1 = shard_loader(src, rank=1, world_size=2)
    assert r1.loader.collate_fn is collate and r1.loader.drop_last and r1.batch_size == 4
    assert r1.sampler.shuffle is False and r1.sampler.drop_last is True
    assert [ids(b) for b in r1] == [[1, 3, 5, 7], [9, 11, 13, 15]]  # 10 samples per rank, last 2 dropped
    # An explicit plain BatchSampler around a default sampler is the default too.
    explicit = DataLoader(dataset(), batch_sampler=BatchSampler(SequentialSampler(range(N)), 5, False))
    assert [ids(b) for b in shard_loader(explicit, 0, 2)] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]


def test_len_per_rank():
    assert len(shard_loader(DataLoader(dataset(), batch_size=3), 0, 2)) == 4  # 10 per rank -> 3,3,3,1
    assert len(shard_loader(DataLoader(dataset(), batch_size=3, drop_last=True), 1, 2)) == 3
    assert len(shard_loader(DataLoader(dataset(), batch_size=3), 0, 1)) == 7
    assert len(shard_loader(DataLoader(dataset(21), batch_size=2), 2, 4)) == 3  # 21 -> padded to 24, 6 each
    lens = [len(list(shard_loader(DataLoader(dataset(), batch_size=3), r, 3))) for r in range(3)]
    assert lens == [len(shard_loader(DataLoader(dataset(), batch_size=3), r, 3)) for r in range(3)] == [3, 3, 3]


@pytest.mark.parametrize("world_size,rank,batches_before", [(2, 1, 3), (2, 0, 5), (1, 0, 3), (1, 0, 7), (1, 0, 0)])
def test_resume_continues_exactly_across_epochs(world_size, rank, batches_before):
    def make():
        return shard_loader(DataLoader(dataset(), batch_size=3, shuffle=True), rank, world_size, seed=3)
    total = 3 * len(make()) + 2
    uninterrupted = stream(make(), total)
    first = make()
    head = stream(first, batches_before)
    state = first.state_dict()
    assert set(state) >= {"epoch", "batches_in_epoch"}
    assert all(isinstance(v, (int, str)) for v in state.values())  # plain data: weights_only checkpoints
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.state_dict()["epoch"] == state["epoch"]
    assert head + stream(fresh, total - batches_before) == uninterrupted


def test_resume_at_epoch_end_starts_next_epoch():
    def make():
        return shard_loader(DataLoader(dataset(), batch_size=5, shuffle=True), 0, 2)
    a = make()
    e0 = [ids(b) for b in a]
    assert a.state_dict()["epoch"] == 0 and a.state_dict()["batches_in_epoch"] == 2
    b = make()
    b.load_state_dict(a.state_dict())
    nxt = [ids(x) for x in b]  # must not be empty: the trainer's loop would call that an empty loader
    reference = make()
    list(reference)  # epoch 0
    assert nxt and b.epoch == 1 and nxt == [ids(x) for x in reference]
    assert nxt != e0


def test_state_survives_weights_only_checkpoint_and_workers(tmp_path):
    def make():
        # workers from a forkserver: a worker forked from a pytest-xdist process that earlier tests left with
        # threads once deadlocked in its first collate (a lock held at fork time), and the suite waited on it
        src = DataLoader(dataset(), batch_size=3, shuffle=True, num_workers=1, persistent_workers=True,
                         prefetch_factor=2, multiprocessing_context="forkserver")
        return shard_loader(src, 1, 2, seed=4)
    a = make()
    assert a.loader.num_workers == 1 and a.loader.persistent_workers and a.loader.prefetch_factor == 2
    full = stream(a, 6)
    b = make()
    head = stream(b, 2)
    torch.save(b.state_dict(), tmp_path / "s.pt")
    c = make()
    c.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert head + stream(c, 4) == full


def test_resume_skips_without_loading_data():
    ds = CountingDataset()
    first = shard_loader(DataLoader(ds, batch_size=2, shuffle=True), 0, 2, seed=1)
    reference = [b.tolist() for b in first]
    fresh = shard_loader(DataLoader(ds, batch_size=2, shuffle=True), 0, 2, seed=1)
    fresh.load_state_dict({"epoch": 0, "batches_in_epoch": 3})
    ds.loaded.clear()
    rest = [b.tolist() for b in fresh]
    assert rest == reference[3:]
    assert sorted(ds.loaded) == sorted(i for b in reference[3:] for i in b)  # skipped batches never loaded


def test_no_automatic_batching_is_sharded_and_resumable():
    make = lambda: shard_loader(DataLoader(dataset(), batch_size=None, shuffle=True), 1, 2)  # noqa: E731
    full = [t[0].item() for t in make()]
    assert len(full) == 10
    r = make()
    r.load_state_dict({"epoch": 0, "batches_in_epoch": 4})
    assert [t[0].item() for t in r] == full[4:]


def test_distributed_sampler_left_alone_but_epoch_set():
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
    src = DataLoader(ds, batch_size=4, sampler=sampler)
    out = shard_loader(src, 1, 2)
    assert out.loader is src and out.sampler is sampler and out.kind == "distributed"
    e0, e1 = epoch_ids(out), epoch_ids(out)
    sampler.set_epoch(0)
    assert e0 == list(sampler)
    sampler.set_epoch(1)
    assert e1 == list(sampler) and e1 != e0
    # resumable too
    again = shard_loader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 1, seed=5)), 1, 2)
    again.load_state_dict({"epoch": 1, "batches_in_epoch": 1})
    assert epoch_ids(again) == e1[4:]
    # A batch sampler wrapping one is left alone as well.
    bs = BatchSampler(DistributedSampler(ds, 2, 0, shuffle=False), 3, False)
    wrapped = shard_loader(DataLoader(ds, batch_sampler=bs), 0, 2)
    assert wrapped.batch_sampler is bs and epoch_ids(wrapped) == list(range(0, N, 2))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(7))


def test_iterable_dataset_unchanged_with_one_warning(caplog):
    src = DataLoader(Stream(), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="syncwise.data.sharding"):
        out = shard_loader(src, 0, 2)
        shard_loader(DataLoader(Stream(), batch_size=2), 1, 2)
    warnings = [r for r in caplog.records if "does not shard" in r.getMessage()]
    assert len(warnings) == 1 and "Stream" in warnings[0].getMessage()
    assert out.loader is src and out.kind == "iterable"
    assert [b.tolist() for b in out] == [[0, 1], [2, 3], [4, 5], [6]]
    # Position is still tracked; resuming re-reads and drops the batches already seen.
    next(iter(out))
    resumed = shard_loader(DataLoader(Stream(), batch_size=2), 0, 2)
    resumed.load_state_dict(out.state_dict())
    assert out.state_dict()["epoch"] == 1
    assert [b.tolist() for b in resumed] == [[2, 3], [4, 5], [6]]
    # A plain iterable (a list) is wrapped the same way; no second warning.
    assert list(shard_loader([1, 2, 3], 0, 2)) == [1, 2, 3]


def test_custom_sampler_is_refused():
    ds = dataset()
    weighted = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * N, N))
    with pytest.raises(ConfigError, match="WeightedRandomSampler") as err:
        shard_loader(weighted, 0, 2)
    assert err.value.field == "loader" and "DistributedSampler" in str(err.value)

    class Buckets:
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2
    with pytest.raises(ConfigError, match="Buckets"):
        shard_loader(DataLoader(ds, batch_sampler=Buckets()), 0, 2)
    with pytest.raises(ConfigError, match="RandomSampler"):  # with replacement: not a permutation
        shard_loader(DataLoader(ds, sampler=torch.utils.data.RandomSampler(ds, replacement=True)), 0, 1)


def test_bad_arguments_and_states():
    src = DataLoader(dataset(), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="rank"):
        shard_loader(src, 2, 2)
    with pytest.raises(ConfigError, match="world_size"):
        shard_loader(src, 0, 0)
    with pytest.raises(ConfigError, match="loader"):
        shard_loader(42, 0, 1)
    out = shard_loader(src, 0, 1, seed=1)
    assert shard_loader(out, 0, 1) is out
    with pytest.raises(SyncwiseError, match="batches_in_epoch"):
        out.load_state_dict({"epoch": 0})
    with pytest.raises(SyncwiseError, match="seed"):
        out.load_state_dict({**out.state_dict(), "seed": 2})


def test_stateful_non_dataloader_returned_unchanged():
    tbl = TokenBatchLoader(torch.arange(100), batch_size=2, seq_len=4)
    assert shard_loader(tbl, 0, 1) is tbl
