"""The one timing primitive of syncwise (issue 24): CUDA events on a CUDA device, the host clock elsewhere.

On a GPU a host clock around queued work measures the *launch*: NCCL collectives "complete" when they are
enqueued, kernels return at once. Every timer of communication or exposed time (``comm.ops``, the step
meter's per-dimension timers, DiLoCo / Pipe-SGD / pipeline replicas, ``pp_bubble``, comm-bench, calibration)
uses :class:`Interval`: on CUDA a pair of events recorded on a stream, read (and only then waited for) when the
number is needed; on the CPU ``time.perf_counter``, where the work is done when the call returns.

    iv = Interval(tensor.device).start()
    ...queue or run the work...
    iv.stop()
    seconds = iv.seconds()      # waits for the end event on CUDA; iv.done() asks without waiting
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch


def on_cuda(device: Any) -> bool:
    """True if ``device`` (a torch.device, a str, a tensor, or None) is a CUDA device that can be timed."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        return False
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class Interval:
    """A start and an end: CUDA events on ``device`` when it is a CUDA device, else the host clock."""

    __slots__ = ("cuda", "_t0", "_t1", "_e0", "_e1")

    def __init__(self, device: Any = None):
        self.cuda = on_cuda(device)
        self._t0 = self._t1 = None
        self._e0 = self._e1 = None

    def start(self, stream: "Optional[torch.cuda.Stream]" = None) -> "Interval":
        """Mark the start: an event on ``stream`` (default: the current stream) or the host clock now."""
        if self.cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record(stream)
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self, stream: "Optional[torch.cuda.Stream]" = None) -> "Interval":
        """Mark the end (after everything queued on ``stream`` so far, on CUDA)."""
        if self.cuda:
            self._e1 = torch.cuda.Event(enable_timing=True)
            self._e1.record(stream)
        else:
            self._t1 = time.perf_counter()
        return self

    @property
    def stopped(self) -> bool:
        return (self._e1 if self.cuda else self._t1) is not None

    def done(self) -> bool:
        """True once the end has been reached (on CUDA: the end event completed; never waits)."""
        if not self.stopped:
            return False
        return self._e1.query() if self.cuda else True

    def seconds(self) -> float:
        """The duration in seconds (on CUDA this waits for the end event)."""
        if not self.stopped:
            raise RuntimeError("Interval.seconds() before stop()")
        if self.cuda:
            self._e1.synchronize()
            return self._e0.elapsed_time(self._e1) / 1e3
        return self._t1 - self._t0


@contextmanager
def timed(device: Any = None, stream: "Optional[torch.cuda.Stream]" = None) -> Iterator[Interval]:
    """``with timed(device) as iv: ...`` then ``iv.seconds()``: an :class:`Interval` around the block."""
    iv = Interval(device).start(stream)
    try:
        yield iv
    finally:
        iv.stop(stream)


def synchronize(device: Any = None) -> None:
    """Wait for the device's queued work (a no-op on the CPU): for host-clock benchmarks of CUDA work."""
    if on_cuda(device):
        torch.cuda.synchronize(torch.device(device) if not isinstance(device, torch.Tensor) else device.device)


def elapsed(fn, device: Any = None) -> float:
    """Seconds ``fn()`` takes on ``device`` (events on CUDA, the host clock elsewhere)."""
    with timed(device) as iv:
        fn()
    return iv.seconds()
