"""Side streams for communication, and the handoff rules (issue 24). On the CPU every function is a no-op.

Rules, as torch's own NCCL work and CUDA-aware futures follow them:

1. Communication runs on a side stream of its own (:func:`side_stream`), never on the stream the backward
   pass queues its kernels on: with NCCL a blocking collective makes the *current* stream wait for it, so a
   collective issued on the default stream holds every later backward kernel behind it.
2. Handoff in: the side stream waits for an event recorded on the producer's stream where the tensors were
   produced (:func:`ready_event` on the producing thread, ``side.wait_event`` on the consuming one).
3. Handoff out: results are handed back through a CUDA-aware ``torch.futures.Future(devices=[...])``
   (:func:`device_future`) completed while the side stream is current: ``set_result`` records events on it and
   the consumer's ``wait()`` (DDP's reducer) makes its own current stream wait for them; no host sync.
4. A tensor allocated on one stream and used on another gets ``tensor.record_stream(other)``
   (:func:`keep_for_current_stream`): the caching allocator otherwise hands its block out again as soon as
   the Python reference dies, while the other stream may still read it (the fp8 residual of issue 24).
"""
from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

import torch

_side: dict = {}
_lock = threading.Lock()


def is_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def side_stream(device: torch.device, name: str = "comm") -> "Optional[torch.cuda.Stream]":
    """One cached side stream per (device, name); None for a non-CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        s = _side.get((device, name))
        if s is None:
            s = _side[(device, name)] = torch.cuda.Stream(device=device)
        return s


def ready_event(device: torch.device) -> "Optional[torch.cuda.Event]":
    """An event recorded on ``device``'s current stream (the producer's), or None off CUDA."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def device_future(device: torch.device) -> "torch.futures.Future":
    """A future that carries stream dependencies on CUDA (rule 3), a plain one elsewhere."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.futures.Future(devices=[torch.device(device)])
    return torch.futures.Future()


def keep_for_stream(tensors: Iterable[Any], stream: "Optional[torch.cuda.Stream]") -> None:
    """``record_stream(stream)`` for every CUDA tensor in ``tensors`` (rule 4); no-op without a stream."""
    if stream is None:
        return
    for t in tensors:
        if is_cuda(t):
            t.record_stream(stream)


def keep_for_current_stream(tensors: Iterable[Any]) -> None:
    """``record_stream`` on the current stream of each CUDA tensor's device (inside a future's callback, which
    torch runs on a pool stream)."""
    for t in tensors:
        if is_cuda(t):
            t.record_stream(torch.cuda.current_stream(t.device))
