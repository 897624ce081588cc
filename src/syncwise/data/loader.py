"""Sharded, resumable random-window sampler over a 1-D token stream, and fixed validation batches.

The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens at stride ``seq_len`` (the
extra token is the last target). Each epoch visits the windows in a permutation seeded by
``seed + epoch``; one global step consumes the next ``batch_size * world_size`` windows of that
permutation and rank r takes every world_size-th of them. So within an epoch no two ranks share a
window, together they cover the epoch, and the whole position is one number (windows consumed),
which is what makes resume exact and lets a run resume on a different world size.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ..errors import ConfigError, SyncwiseError

Batch = tuple[torch.Tensor, torch.Tensor]


def _as_tokens(tokens: torch.Tensor | np.ndarray, field: str) -> torch.Tensor:
    if isinstance(tokens, np.ndarray):
        tokens = torch.from_numpy(tokens)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ConfigError(field, type(tokens).__name__ if not isinstance(tokens, torch.Tensor)
                          else f"tensor of shape {tuple(tokens.shape)}", "a 1-D tensor of token ids")
    return tokens


def _check_layout(batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    for name, v in (("data.batch_size", batch_size), ("data.seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(name, v, "a positive integer")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"an integer in [0, {world_size})")


def check_fits(train_tokens: int | None, val_tokens: int | None, batch_size: int, seq_len: int,
               world_size: int) -> None:
    """ConfigError unless one step's windows fit the train stream (``batch_size * world_size`` windows of
    ``seq_len + 1`` tokens at stride ``seq_len``) and one validation batch per rank fits the val stream.
    Token counts suffice, so a configuration is checked before any worker loads the corpus (None: skip)."""
    per_step = batch_size * world_size
    if train_tokens is not None and max(0, (train_tokens - 1) // seq_len) < per_step:
        raise ConfigError(
            "data.batch_size", batch_size,
            f"batch_size * world_size * seq_len + 1 <= corpus tokens; the corpus has "
            f"{train_tokens:,} tokens = {max(0, (train_tokens - 1) // seq_len)} windows of {seq_len} tokens, "
            f"fewer than batch_size {batch_size} x world_size {world_size} (use a smaller "
            "batch_size or seq_len, or a larger corpus)")
    if val_tokens is not None and max(0, (val_tokens - 1) // seq_len) < per_step:
        raise ConfigError("data.val_fraction", val_tokens,
                          f"a validation stream of at least {per_step * seq_len + 1} tokens for "
                          f"batch_size {batch_size} x world_size {world_size} x seq_len {seq_len} "
                          "(raise data.val_fraction or lower the eval batch size)")


def _gather(tokens: torch.Tensor, window_ids: torch.Tensor, seq_len: int) -> Batch:
    # Slice then widen each window: cheap for B windows, and works for uint8/uint16 storage on
    # every supported torch (advanced indexing and stack of uint16 are missing on older versions).
    rows = [tokens[s: s + seq_len + 1].to(torch.long) for s in (window_ids * seq_len).tolist()]
    xy = torch.stack(rows)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


class TokenBatchLoader:
    """Infinite iterator of ``(x, y)`` int64 batches of shape (batch_size, seq_len), y = x shifted by 1."""

    def __init__(self, tokens: torch.Tensor | np.ndarray, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        _check_layout(batch_size, seq_len, rank, world_size)
        self.tokens = _as_tokens(tokens, "data.corpus")
        self.batch_size, self.seq_len, self.rank, self.world_size, self.seed = (
            batch_size, seq_len, rank, world_size, int(seed))
        self.n_windows = max(0, (self.tokens.numel() - 1) // seq_len)
        self._per_step = batch_size * world_size
        check_fits(self.tokens.numel(), None, batch_size, seq_len, world_size)
        self._epoch = 0
        self._offset = 0  # windows of this epoch's permutation already consumed by all ranks
        self._position = 0  # batches this rank has produced this epoch
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def epoch(self) -> int:
        """The epoch the most recent batch came from (0-based)."""
        return self._epoch

    def __len__(self) -> int:
        """Batches per epoch (per rank); the windows left over at an epoch's end are skipped."""
        return self.n_windows // self._per_step

    def permutation(self, epoch: int) -> torch.Tensor:
        """The window order of ``epoch`` (identical on every rank: seeded by ``seed + epoch``)."""
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_windows, generator=g), epoch
        return self._perm

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._offset + self._per_step > self.n_windows:
            self._epoch, self._offset, self._position = self._epoch + 1, 0, 0
        block = self.permutation(self._epoch)[self._offset: self._offset + self._per_step]
        batch = _gather(self.tokens, block[self.rank:: self.world_size], self.seq_len)
        self._offset += self._per_step
        self._position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from; ``position`` = batches this rank produced this epoch."""
        return {"epoch": self._epoch, "position": self._position, "offset": self._offset,
                "seed": self.seed, "seq_len": self.seq_len, "n_windows": self.n_windows,
                "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so the next batch is the one an uninterrupted loader would produce next.

        A state saved with another batch_size/world_size resumes at the same point of the epoch
        (windows already consumed are not repeated); seed, seq_len and corpus must match.
        """
        for key in ("seed", "seq_len", "n_windows"):
            if key in state and state[key] != getattr(self, key):
                raise SyncwiseError(
                    f"cannot resume the data loader: the checkpoint has {key}={state[key]!r} but this run "
                    f"has {key}={getattr(self, key)!r}; resume with the same data.seed, data.seq_len and "
                    "corpus, or start the data stream from scratch")
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncwiseError(f"cannot resume the data loader: bad state {state!r} (needs integer "
                                "'epoch' and 'position')") from exc
        saved_step = int(state.get("batch_size", self.batch_size)) * int(state.get("world_size", self.world_size))
        offset = int(state.get("offset", position * saved_step))
        if epoch < 0 or not 0 <= offset <= self.n_windows:
            raise SyncwiseError(f"cannot resume the data loader: epoch {epoch} / offset {offset} is "
                                f"outside this corpus ({self.n_windows} windows)")
        self._epoch, self._offset = epoch, offset
        self._position = position if saved_step == self._per_step else -(-offset // self._per_step)


def evaluation_batches(val_tokens: torch.Tensor | np.ndarray, batch_size: int, seq_len: int, n_batches: int,
                       rank: int = 0, world_size: int = 1) -> list[Batch]:
    """Fixed validation batches for this rank: windows evenly spread over the val stream, disjoint
    across ranks, identical on every call. Returns ``min(n_batches, what the stream holds)`` batches,
    the same count on every rank."""
    _check_layout(batch_size, seq_len, rank, world_size)
    if not isinstance(n_batches, int) or n_batches <= 0:
        raise ConfigError("eval.batches", n_batches, "a positive integer")
    tokens = _as_tokens(val_tokens, "data.val")
    n_windows = max(0, (tokens.numel() - 1) // seq_len)
    per_step = batch_size * world_size
    check_fits(None, tokens.numel(), batch_size, seq_len, world_size)
    steps = min(n_batches, n_windows // per_step)
    total = steps * per_step
    # Evenly spaced windows cover the whole val set, not just its start, whatever n_batches is.
    windows = torch.arange(total, dtype=torch.long) * n_windows // total
    return [_gather(tokens, windows[k * per_step:(k + 1) * per_step][rank::world_size], seq_len)
            for k in range(steps)]
