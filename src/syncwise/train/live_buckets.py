"""Live recovery's cross-replica gradient buckets (docs/live-recovery.md): the gradients averaged across replica
groups through torchft's manager, in fixed flat buckets sent from gradient hooks during backward where the step
allows it (:class:`ReplicaBuckets`). Used by :class:`syncwise.train.live_recovery.LiveRecovery`."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..errors import ConfigError
from ..parallel.local_sgd import local_shard as _local

FIRST_BUCKET_BYTES = 1 << 20  # the first bucket is small so its all-reduce starts early (DDP's first bucket)
BUCKET_BYTES = 25 << 20       # then buckets of DDP's default bucket_cap_mb


def assign_buckets(params: list[torch.Tensor], cap_bytes: int = BUCKET_BYTES,
                    first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """The parameters' indices in buckets, in reverse order (backward produces the last layers' gradients first,
    as DDP assumes); one dtype and device per bucket; a bucket is closed once it holds ``cap_bytes``
    (``first_bytes`` for the first one). Depends only on the parameters' shapes and order: every replica (and
    a replacement) gets the same buckets, so their all-reduces pair up."""
    if cap_bytes <= 0 or first_bytes <= 0:
        raise ConfigError("bucket_cap_bytes", min(cap_bytes, first_bytes), "a positive number of bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    size, key = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        k = (p.dtype, p.device)
        if current and (k != key or size >= (first_bytes if not buckets else cap_bytes)):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        key = k
    if current:
        buckets.append(current)
    return buckets


def overlap_ok(trainer: Any, group_size: int) -> bool:
    """Whether the buckets can be sent from gradient hooks during backward: the gradient a hook sees is the step's
    final one only with one backward per step (no accumulation, no DynamicBatcher) and no DDP inside the replica
    group (its averaged gradient lands in ``.grad`` only at the end of backward)."""
    pipeline = getattr(getattr(trainer, "par", None), "pipeline", None)
    return group_size == 1 and getattr(trainer, "batcher", None) is None and \
        getattr(trainer, "grad_accum_steps", 1) == 1 and pipeline is None


def wire_dtype(compress: Any) -> Optional[torch.dtype]:
    """The cross-replica all-reduce's dtype for ``compress`` (a spec text): fp16/bf16 cast it; anything else
    sends the gradients' own dtype (another compressor works inside a replica group only:
    syncwise.layout.check_live_compress)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(compress))


class ReplicaBuckets:
    """The cross-replica all-reduce of the gradients, in fixed flat buckets (:func:`assign_buckets`) allocated once
    and reused every step. With ``overlap``, a post-accumulate-grad hook on each parameter marks its gradient
    ready during backward, and each bucket is sent (``issue(flat)`` → a torchft work) as soon as it and every
    bucket before it are complete, so the all-reduces run while backward computes the earlier layers. The order
    of the buckets is the same on every replica whatever order gradients arrive in (gloo and NCCL pair collectives by
    order). :meth:`finish` sends the buckets not sent yet (a parameter unused this step, an MoE expert no token
    chose, never becomes ready: it sends zeros, as every replica must hand the all-reduce the same buffer), waits
    for all, and writes the averages back to ``.grad``."""

    def __init__(self, params: list[torch.Tensor], issue: Callable[[torch.Tensor], Any], overlap: bool,
                 cap_bytes: int = BUCKET_BYTES, first_bytes: int = FIRST_BUCKET_BYTES,
                 wire_dtype: Optional[torch.dtype] = None):
        self.params, self._issue = params, issue
        self.buckets = assign_buckets(params, cap_bytes, first_bytes)
        self.flats = [torch.empty(sum(_local(params[i]).numel() for i in b), dtype=params[b[0]].dtype,
                                  device=_local(params[b[0]]).device) for b in self.buckets]
        # compress.method=fp16/bf16: each bucket goes out cast to this dtype (half the bytes), back to fp32 after
        self.wires = [torch.empty_like(f, dtype=wire_dtype) if wire_dtype is not None and f.dtype != wire_dtype
                      else None for f in self.flats]
        self._bucket_of = {i: n for n, b in enumerate(self.buckets) for i in b}
        self._handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))
                         for i, p in enumerate(params)] if overlap else []
        self._armed = False
        self.arm()
        self._armed = False  # (armed by each step's begin_step)

    @property
    def overlapped(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """A new step: every bucket waits for its gradients again."""
        self._missing = [len(b) for b in self.buckets]
        self._seen = [False] * len(self.params)
        self._works: list[Any] = [None] * len(self.buckets)
        self.issued = 0  # buckets sent this step (always a prefix of the bucket order)
        self._armed = self.overlapped

    def _ready(self, i: int) -> None:
        if not self._armed or self._seen[i]:
            return
        self._seen[i] = True
        self._missing[self._bucket_of[i]] -= 1
        while self.issued < len(self.buckets) and self._missing[self.issued] == 0:
            self._send(self.issued)

    def _send(self, b: int) -> None:
        flat, offset = self.flats[b], 0
        for i in self.buckets[b]:
            p = self.params[i]
            n = _local(p).numel()  # (HSDP: this rank's shard, paired with group rank r of every replica)
            if p.grad is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(_local(p.grad).reshape(-1))
            offset += n
        wire = self.wires[b]
        if wire is not None:
            wire.copy_(flat)
        self._works[b] = self._issue(flat if wire is None else wire)
        self.issued += 1

    def finish(self) -> None:
        """Send the rest, wait for every bucket, and write the averaged gradients to ``.grad``."""
        self._armed = False
        while self.issued < len(self.buckets):
            self._send(self.issued)
        for b, work in enumerate(self._works):
            if work is not None:
                work.wait()
            flat, offset = self.flats[b], 0
            if self.wires[b] is not None:
                flat.copy_(self.wires[b])
            for i in self.buckets[b]:
                p = self.params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = _local(p.grad)
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
