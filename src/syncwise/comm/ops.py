"""The one instrumented layer every syncwise collective goes through.

Thin wrappers over ``torch.distributed``: same semantics, plus a record in ``STATS`` of the op,
the payload bytes this rank contributes (the input tensor's size) and the duration. Asynchronous
calls return the usual work handle; their duration is recorded when their future completes.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .stats import STATS, CommStats

ReduceOpName = str
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
# torch renamed the *_into_tensor collectives; keep working on torch>=2.5.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(op: "ReduceOpName | dist.ReduceOp") -> dist.ReduceOp:
    """Map 'sum' | 'avg' | 'max' | 'min' | 'product' (or a ReduceOp) to a ReduceOp."""
    if isinstance(op, str):
        try:
            return _REDUCE_OPS[op.lower()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; accepted: {', '.join(_REDUCE_OPS)}") from None
    return op


# ---- timeouts and the collectives in flight (what a hang report names) -----------------------------
_timeout: Optional[timedelta] = None
_in_flight: dict[int, "InFlight"] = {}
_tokens = itertools.count()
_last_failed: "Optional[InFlight]" = None


@dataclass(frozen=True)
class InFlight:
    """A collective issued through this module and not completed yet."""

    op: str
    group: object  # the process group (None: the default one); named only when a report needs it
    started: float  # time.monotonic()

    def describe(self) -> str:
        return f"{self.op} on process group '{group_name(self.group)}'"


def set_collective_timeout(seconds: Optional[float]) -> None:
    """The job's collective timeout (``--dist.timeout_s``): groups made by :func:`new_group` get it too."""
    global _timeout
    _timeout = timedelta(seconds=seconds) if seconds else None


def collective_timeout_s() -> Optional[float]:
    return _timeout.total_seconds() if _timeout is not None else None


def new_group(ranks: Optional[list[int]] = None, backend: Optional[str] = None, desc: str = "syncwise"):
    """``dist.new_group`` with the job's timeout (torch's own default is 30 min, so a side communicator —
    compression, checkpoint saving — would outlast ``--dist.timeout_s`` by far) and a name for reports."""
    try:
        return dist.new_group(ranks=ranks, backend=backend, timeout=_timeout, group_desc=desc)
    except TypeError:  # torch without group_desc
        return dist.new_group(ranks=ranks, backend=backend, timeout=_timeout)


def group_name(group=None) -> str:
    """'default [0, 1]', 'compress [0, 1]' ...: the group a report names."""
    try:
        desc = "default" if group is None else (getattr(group, "group_desc", None) or "unnamed")
        return f"{desc} {dist.get_process_group_ranks(group or dist.group.WORLD)}"
    except (RuntimeError, ValueError, AttributeError):
        return "default" if group is None else "unnamed"


def oldest_in_flight() -> Optional[InFlight]:
    """The longest-running collective not completed yet (None if none)."""
    items = list(_in_flight.values())
    return min(items, key=lambda f: f.started) if items else None


def last_failed() -> Optional[InFlight]:
    """The last collective that raised (e.g. timed out)."""
    return _last_failed


def _issue(name: str, nbytes: int, fn, async_op: bool, stats: CommStats, group=None):
    global _last_failed
    start = time.perf_counter()
    token = next(_tokens)
    record = _in_flight[token] = InFlight(name, group, time.monotonic())
    try:
        work = fn()
    except BaseException:
        _last_failed = record
        _in_flight.pop(token, None)
        raise
    if not async_op:
        _in_flight.pop(token, None)
        stats.record(name, nbytes, time.perf_counter() - start)
        return None
    stats.record(name, nbytes)

    def _done(fut):
        global _last_failed
        _in_flight.pop(token, None)
        stats.add_time(name, time.perf_counter() - start)
        try:
            return fut.value()
        except BaseException:
            _last_failed = record
            raise

    try:
        work.get_future().then(_done)
    except RuntimeError:  # e.g. gloo's reduce_scatter has no future: time it at wait() instead
        return _TimedWork(work, name, start, stats, token)
    return work


class _TimedWork:
    """A work handle without a future: records the duration when waited on."""

    def __init__(self, work, name: str, start: float, stats: CommStats, token: int):
        self._work, self._name, self._start, self._stats, self._token = work, name, start, stats, token

    def wait(self, *args, **kwargs):
        try:
            out = self._work.wait(*args, **kwargs)
        finally:
            _in_flight.pop(self._token, None)
        self._stats.add_time(self._name, time.perf_counter() - self._start)
        return out

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def all_reduce(tensor: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum", group=None,
               async_op: bool = False, stats: CommStats = STATS):
    """In-place all-reduce of ``tensor``."""
    rop = reduce_op(op)
    return _issue("all_reduce", tensor.numel() * tensor.element_size(),
                  lambda: dist.all_reduce(tensor, op=rop, group=group, async_op=async_op), async_op, stats, group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               stats: CommStats = STATS):
    """Gather equal-size ``input`` from every rank into the flat ``output`` (rank-major)."""
    return _issue("all_gather", input.numel() * input.element_size(),
                  lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op, stats, group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum",
                   group=None, async_op: bool = False, stats: CommStats = STATS):
    """Reduce the flat ``input`` across ranks; each rank keeps its contiguous shard in ``output``."""
    rop = reduce_op(op)
    return _issue("reduce_scatter", input.numel() * input.element_size(),
                  lambda: _reduce_scatter_flat(output, input, op=rop, group=group, async_op=async_op),
                  async_op, stats, group)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
               input_split_sizes: Optional[list[int]] = None, group=None, async_op: bool = False,
               stats: CommStats = STATS):
    """``all_to_all_single`` with optional uneven splits."""
    return _issue("all_to_all", input.numel() * input.element_size(),
                  lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=async_op), async_op, stats, group)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, stats: CommStats = STATS):
    """Broadcast ``tensor`` from global rank ``src``."""
    return _issue("broadcast", tensor.numel() * tensor.element_size(),
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op, stats, group)


def all_gather_object(obj: object, group=None) -> list:
    """Gather a picklable object from every rank (not counted: control traffic only)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
