"""Shard a user's ``DataLoader`` across data-parallel ranks and make its position resumable.

:func:`shard_loader` is what Lightning and Accelerate do to a user's loader before training:

* A ``torch.utils.data.DataLoader`` over a map-style dataset with the default sampler
  (``SequentialSampler`` from ``shuffle=False``, ``RandomSampler`` from ``shuffle=True``, or an explicit
  ``BatchSampler`` around one of them) is rebuilt with the same settings (batch size, drop_last,
  collate_fn, workers, pin_memory, worker_init_fn, generator, prefetch_factor, timeout, ...) around
  ``DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=<was RandomSampler>,
  seed=seed, drop_last=<loader.drop_last>)``. Each pass calls ``set_epoch(epoch)``, so the shuffle
  differs per epoch and every rank partitions the same permutation: within an epoch the ranks' samples
  are disjoint and together cover the dataset (``DistributedSampler`` pads the last few by repeating
  samples unless ``drop_last``). This happens at ``world_size == 1`` too: the order is then a function
  of ``(seed, epoch)`` instead of torch's global RNG (or the loader's ``generator``), which is what makes
  a mid-epoch resume exact. ``shuffle=False`` keeps the dataset order (each rank takes every
  ``world_size``-th sample).
* A loader whose sampler (or whose batch sampler's sampler) is already a ``DistributedSampler`` is used
  as it is; syncwise only calls its ``set_epoch(epoch)`` at each pass, as Lightning does, and tracks the
  position.
* A ``DataLoader`` over an ``IterableDataset``, or any other iterable, is NOT sharded by syncwise (one
  warning is logged): the dataset must shard itself, e.g. by taking every
  ``world_size * num_workers``-th item from ``rank * num_workers + worker_id``, with
  ``torch.utils.data.get_worker_info()`` for the worker and ``torch.distributed.get_rank()`` /
  ``get_world_size()`` for the rank, or with ``datasets.distributed.split_dataset_by_node(ds, rank,
  world_size)`` for a Hugging Face dataset. Its position is tracked; resuming mid-pass re-reads and
  discards the batches already trained on, which is exact only if each pass yields the same sequence.
  If the dataset has ``set_epoch`` it is called at each pass.
* Any other sampler or batch sampler (weighted, bucketing, a ``RandomSampler`` with replacement, a
  subclass...) raises :class:`~syncwise.errors.ConfigError`: syncwise cannot know how to split it, and
  leaving it alone would silently train every rank on the same batches. Wrap it in something
  rank-aware (a ``DistributedSampler`` or your own) and pass that.
* An object that already has ``state_dict``/``load_state_dict`` and is not a ``DataLoader`` (such as
  :class:`~syncwise.data.TokenBatchLoader`) keeps its own position and sharding and is returned as it is.

The returned :class:`ShardedLoader` iterates one epoch per ``iter()`` (so the trainer's
re-entering loop advances epochs), has ``len()`` = batches per epoch on this rank, and
``state_dict()`` / ``load_state_dict()``: after loading, the next ``iter()`` continues the saved epoch
at the saved batch, without loading the skipped batches for map-style loaders (their batches of
indices are computed and dropped), and later ``iter()`` calls go on with the next epochs. Sample
indices resume exactly; randomness inside worker processes (augmentation seeded per worker) is not
replayed.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable, Iterator, Optional

from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler)
from torch.utils.data.distributed import DistributedSampler

from ..errors import ConfigError, SyncwiseError

log = logging.getLogger(__name__)

ACCEPTED = ("a DataLoader with the default sampler (syncwise shards it), a DistributedSampler, or an "
            "IterableDataset that shards itself")

# Kinds of loader, recorded in the state.
SHARDED, DISTRIBUTED, ITERABLE = "sharded", "distributed", "iterable"

_warned_unsharded = False


def _warn_unsharded(what: str, world_size: int) -> None:
    global _warned_unsharded
    if not _warned_unsharded and world_size > 1:  # one process: nothing to shard
        _warned_unsharded = True
        log.warning("syncwise does not shard %s across ranks: it must shard itself (use "
                    "torch.utils.data.get_worker_info() and the rank/world size from torch.distributed, or "
                    "datasets.distributed.split_dataset_by_node), otherwise every rank trains on the same "
                    "batches", what)


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The constructor arguments of ``loader`` other than dataset/sampling, for this torch version."""
    accepted = inspect.signature(DataLoader.__init__).parameters
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers, "collate_fn": loader.collate_fn, "pin_memory": loader.pin_memory,
        "timeout": loader.timeout, "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context, "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
        "in_order": getattr(loader, "in_order", True),
    }
    if loader.num_workers > 0 and getattr(loader, "prefetch_factor", None) is not None:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return {k: v for k, v in kwargs.items() if k in accepted}


def _default_sampling(loader: DataLoader) -> Optional[tuple[Any, Optional[int], bool]]:
    """``(sampler, batch_size, drop_last)`` when ``loader`` samples with a default sampler (possibly in an
    explicit plain ``BatchSampler``), else None. ``batch_size`` None: automatic batching is off."""
    bs = loader.batch_sampler
    if bs is None:
        sampler, batch_size, drop_last = loader.sampler, None, False
    elif type(bs) is BatchSampler:
        sampler, batch_size, drop_last = bs.sampler, bs.batch_size, bs.drop_last
    else:
        return None
    if type(sampler) is SequentialSampler:
        return sampler, batch_size, drop_last
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return sampler, batch_size, drop_last
    return None


def _distributed_sampler(loader: DataLoader) -> Optional[DistributedSampler]:
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(s, DistributedSampler):
            return s
    return None


class ShardedLoader:
    """A loader that iterates one epoch per ``iter()`` and can resume mid-epoch; see :func:`shard_loader`."""

    def __init__(self, loader: Iterable, kind: str, rank: int, world_size: int, seed: int):
        self.loader, self.kind, self.rank, self.world_size, self.seed = loader, kind, rank, world_size, seed
        self._epoch = 0  # epoch of the pass in progress (or last finished)
        self._position = 0  # batches of that epoch yielded so far
        self._next = (0, 0)  # (epoch, batches to skip) where the next iter() starts

    # -- iteration ----------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the most recent batch came from (0-based)."""
        return self._epoch

    @property
    def batch_size(self) -> Optional[int]:
        bs = getattr(self.loader, "batch_size", None)
        return bs if bs is not None else getattr(getattr(self.loader, "batch_sampler", None), "batch_size", None)

    def __len__(self) -> int:
        """Batches per epoch on this rank (TypeError for an iterable without a length)."""
        return len(self.loader)  # type: ignore[arg-type]

    def _set_epoch(self, epoch: int) -> None:
        targets = [getattr(self.loader, "batch_sampler", None), getattr(self.loader, "sampler", None)]
        targets.append(getattr(targets[0], "sampler", None))
        if self.kind == ITERABLE:
            targets = [getattr(self.loader, "dataset", None)]
        done: set[int] = set()
        for t in targets:
            if t is not None and id(t) not in done and callable(getattr(t, "set_epoch", None)):
                t.set_epoch(epoch)
                done.add(id(t))

    def __iter__(self) -> Iterator:
        epoch, skip = self._next
        try:
            n = len(self)
        except TypeError:
            n = None
        if n is not None and skip >= n > 0:  # the saved epoch was finished: go on with the next one
            epoch, skip = epoch + 1, 0
        self._epoch, self._position = epoch, skip
        self._next = (epoch + 1, 0)  # an abandoned pass is not resumed by the next iter(), as with DataLoader
        self._set_epoch(epoch)
        return self._batches(epoch, skip)

    def _batches(self, epoch: int, skip: int) -> Iterator:
        source: Iterable = self.loader
        discard = 0
        if skip:
            if type(self.loader) is DataLoader and self.kind != ITERABLE:
                source = self._resumed_loader(skip)
            else:  # no index list to cut: re-read the batches already trained on
                discard = skip
        it = iter(source)
        for _ in range(discard):
            try:
                next(it)
            except StopIteration:
                return
        for batch in it:
            if self._epoch == epoch:  # not superseded by a load_state_dict / iter() meanwhile
                self._position += 1
            yield batch

    def _resumed_loader(self, skip: int) -> DataLoader:
        """A one-pass loader over the rest of this epoch: the batch sampler's index batches after the
        first ``skip`` (computed without loading any data), with the loader's collate/worker settings."""
        loader: DataLoader = self.loader  # type: ignore[assignment]
        kwargs = _loader_kwargs(loader)
        kwargs["persistent_workers"] = False
        if loader.batch_sampler is None:  # no automatic batching: one sample per "batch"
            indices = list(loader.sampler)[skip:]
            return DataLoader(loader.dataset, batch_size=None, sampler=indices, **kwargs)
        batches = list(loader.batch_sampler)[skip:]
        return DataLoader(loader.dataset, batch_sampler=batches, **kwargs)

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``epoch``: the epoch in progress; ``batches_in_epoch``: batches of it this rank has yielded."""
        try:
            n = len(self)
        except TypeError:
            n = -1
        return {"epoch": self._epoch, "batches_in_epoch": self._position, "kind": self.kind,
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "batch_size": -1 if self.batch_size is None else int(self.batch_size), "batches_per_epoch": n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue where the saved loader was: same epoch, next batch."""
        try:
            epoch, position = int(state["epoch"]), int(state["batches_in_epoch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncwiseError(f"cannot resume the data loader: bad state {state!r} (needs integer 'epoch' "
                                "and 'batches_in_epoch')") from exc
        if epoch < 0 or position < 0:
            raise SyncwiseError(f"cannot resume the data loader: negative epoch {epoch} / batch {position}")
        if self.kind == SHARDED and "seed" in state and int(state["seed"]) != self.seed:
            raise SyncwiseError(
                f"cannot resume the data loader: the checkpoint has seed={state['seed']!r} but this run has "
                f"seed={self.seed!r}, so the epoch's order differs; resume with the same seed or start the "
                "data stream from scratch")
        saved_world = int(state.get("world_size", self.world_size))
        saved_batch = int(state.get("batch_size", -1))
        if saved_world != self.world_size and self.kind != ITERABLE and self.batch_size and saved_batch > 0:
            # The ranks had consumed the first position * batch * world samples of the epoch's order:
            # continue after them on the new layout (no sample repeated; a few may be skipped).
            consumed = position * saved_batch * saved_world
            per_step = int(self.batch_size) * self.world_size
            new_position = -(-consumed // per_step)
            log.warning("data loader state was saved with world_size %d, this run has %d: resuming epoch %d "
                        "at batch %d (was %d)", saved_world, self.world_size, epoch, new_position, position)
            position = new_position
        self._epoch, self._position = epoch, position
        self._next = (epoch, position)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, num_workers, ... of the wrapped loader
        if name == "loader" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return (f"ShardedLoader(kind={self.kind!r}, rank={self.rank}, world_size={self.world_size}, "
                f"seed={self.seed}, loader={self.loader!r})")


def shard_loader(loader: Any, rank: int, world_size: int, seed: int = 0) -> Any:
    """Return ``loader`` sharded for data-parallel rank ``rank`` of ``world_size``, with a resumable
    position (``state_dict``/``load_state_dict`` with keys ``epoch`` and ``batches_in_epoch``).

    See the module docstring for what happens to each kind of loader. In short: a ``DataLoader`` with
    the default sampler gets ``DistributedSampler(num_replicas=world_size, rank=rank,
    shuffle=<was shuffled>, seed=seed, drop_last=loader.drop_last)`` (also at ``world_size == 1``,
    so a shuffled order is a function of ``(seed, epoch)`` and resumes exactly); one with a
    ``DistributedSampler`` is kept; an ``IterableDataset`` or other iterable is kept unsharded with a
    warning (it must shard itself: ``torch.utils.data.get_worker_info()`` plus the rank/world size from
    ``torch.distributed``, or ``datasets.distributed.split_dataset_by_node``); any other sampler raises
    ConfigError rather than train every rank on the same data. Objects that are not DataLoaders but
    have their own ``state_dict``/``load_state_dict`` (e.g. ``TokenBatchLoader``) are returned unchanged.
    """
    for name, v in (("world_size", world_size), ("seed", seed)):
        if not isinstance(v, int) or isinstance(v, bool) or (name == "world_size" and v <= 0):
            raise ConfigError(name, v, "a positive integer" if name == "world_size" else "an integer")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"an integer in [0, {world_size})")
    if isinstance(loader, ShardedLoader):
        if (loader.rank, loader.world_size) != (rank, world_size):
            raise ConfigError("loader", repr(loader), f"a loader not already sharded for another rank/world size "
                              f"(this one is for rank {loader.rank} of {loader.world_size})")
        return loader
    if not isinstance(loader, DataLoader):
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            return loader  # keeps its own position and sharding (TokenBatchLoader, stateful loaders)
        if not isinstance(loader, Iterable):
            raise ConfigError("loader", type(loader).__name__, ACCEPTED)
        _warn_unsharded(f"the iterable {type(loader).__name__}", world_size)
        return ShardedLoader(loader, ITERABLE, rank, world_size, seed)
    if isinstance(loader.dataset, IterableDataset):
        _warn_unsharded(f"the IterableDataset {type(loader.dataset).__name__}", world_size)
        return ShardedLoader(loader, ITERABLE, rank, world_size, seed)

    dist = _distributed_sampler(loader)
    if dist is not None:
        if (dist.num_replicas, dist.rank) != (world_size, rank):
            log.warning("the loader's DistributedSampler is for rank %d of %d, but this is data-parallel rank "
                        "%d of %d; syncwise leaves it as it is", dist.rank, dist.num_replicas, rank, world_size)
        return ShardedLoader(loader, DISTRIBUTED, rank, world_size, seed)

    default = _default_sampling(loader)
    if default is None:
        # Refuse rather than guess: a custom sampler left alone would give every rank the same batches
        # (silently wrong training), and wrapping it in a sharding sampler could break what it guarantees
        # (class balance, length bucketing, ...). The user knows how to make it rank-aware.
        custom = loader.batch_sampler if (loader.batch_sampler is not None
                                          and type(loader.batch_sampler) is not BatchSampler) else (
            getattr(loader.batch_sampler, "sampler", None) or loader.sampler)
        raise ConfigError("loader", type(custom).__name__, ACCEPTED)
    sampler, batch_size, drop_last = default
    shuffle = type(sampler) is RandomSampler
    new_sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
    kwargs = _loader_kwargs(loader)
    try:
        rebuilt = type(loader)(loader.dataset, batch_size=batch_size, shuffle=False, sampler=new_sampler,
                               drop_last=drop_last, **kwargs)
    except TypeError as exc:  # a DataLoader subclass with another constructor
        raise ConfigError("loader", type(loader).__name__,
                          f"{ACCEPTED} (syncwise could not rebuild this DataLoader subclass: {exc}; give it a "
                          "DistributedSampler yourself)") from exc
    return ShardedLoader(rebuilt, SHARDED, rank, world_size, seed)


def position_is_global(loader: object) -> bool:
    """Whether ``loader``'s checkpointed position is the epoch's progress over all data-parallel ranks, which a
    loader under another layout or world size can continue from (``TrainState.register(portable=True)``):
    syncwise's ``TokenBatchLoader``, a ``ShardedLoader`` over a map-style dataset, either behind a
    ``SmartPrefetcher``. A user's iterable dataset shards itself: its position is its rank's own."""
    from .loader import TokenBatchLoader
    from .prefetch import SmartPrefetcher

    if isinstance(loader, SmartPrefetcher):
        return position_is_global(loader.loader)
    if isinstance(loader, ShardedLoader):
        return loader.kind != ITERABLE
    return isinstance(loader, TokenBatchLoader)
