"""The one instrumented layer every syncwise collective goes through.

Thin wrappers over ``torch.distributed``: same semantics, plus a record in ``STATS`` of the op,
the payload bytes this rank contributes (the input tensor's size) and the duration. Asynchronous
calls return the usual work handle; their duration is recorded when their future completes.
"""
from __future__ import annotations

import time
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


def _issue(name: str, nbytes: int, fn, async_op: bool, stats: CommStats):
    start = time.perf_counter()
    work = fn()
    if not async_op:
        stats.record(name, nbytes, time.perf_counter() - start)
        return None
    stats.record(name, nbytes)

    def _done(fut):
        stats.add_time(name, time.perf_counter() - start)
        return fut.value()

    try:
        work.get_future().then(_done)
    except RuntimeError:  # e.g. gloo's reduce_scatter has no future: time it at wait() instead
        return _TimedWork(work, name, start, stats)
    return work


class _TimedWork:
    """A work handle without a future: records the duration when waited on."""

    def __init__(self, work, name: str, start: float, stats: CommStats):
        self._work, self._name, self._start, self._stats = work, name, start, stats

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._stats.add_time(self._name, time.perf_counter() - self._start)
        return out

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def all_reduce(tensor: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum", group=None,
               async_op: bool = False, stats: CommStats = STATS):
    """In-place all-reduce of ``tensor``."""
    rop = reduce_op(op)
    return _issue("all_reduce", tensor.numel() * tensor.element_size(),
                  lambda: dist.all_reduce(tensor, op=rop, group=group, async_op=async_op), async_op, stats)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               stats: CommStats = STATS):
    """Gather equal-size ``input`` from every rank into the flat ``output`` (rank-major)."""
    return _issue("all_gather", input.numel() * input.element_size(),
                  lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op, stats)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum",
                   group=None, async_op: bool = False, stats: CommStats = STATS):
    """Reduce the flat ``input`` across ranks; each rank keeps its contiguous shard in ``output``."""
    rop = reduce_op(op)
    return _issue("reduce_scatter", input.numel() * input.element_size(),
                  lambda: _reduce_scatter_flat(output, input, op=rop, group=group, async_op=async_op),
                  async_op, stats)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
               input_split_sizes: Optional[list[int]] = None, group=None, async_op: bool = False,
               stats: CommStats = STATS):
    """``all_to_all_single`` with optional uneven splits."""
    return _issue("all_to_all", input.numel() * input.element_size(),
                  lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=async_op), async_op, stats)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, stats: CommStats = STATS):
    """Broadcast ``tensor`` from global rank ``src``."""
    return _issue("broadcast", tensor.numel() * tensor.element_size(),
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op, stats)


def all_gather_object(obj: object, group=None) -> list:
    """Gather a picklable object from every rank (not counted: control traffic only)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
