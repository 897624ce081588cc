"""The one way a steady step's device values reach the host (issue 39 N2; docs/gpu.md "Host reads").

On a GPU the host runs ahead of the device. ``float(t)``, ``bool(t)``, ``t.item()`` or ``t.tolist()`` of a CUDA tensor
copies it on the *current* stream, so the host waits for every kernel queued there — by the time a step's row is read
that is the whole next step: the GPU queue drains. :class:`HostCopy` is the reader every step value goes through
instead: the values (0-d tensors) are stacked and copied into pinned host memory behind *one* event, recorded where
they were produced; reading waits for that event only, which has long completed when the read comes a step later
(the loss, the gradient norm, the non-finite flag, the MoE imbalance, a compressor bucket's verdict).

Strict mode (``SYNCWISE_STRICT_SYNCS=1``): :func:`step_region` (the trainer's step, the compressor's worker) then
fails any scalar read — ``item``, ``bool``, ``float``, ``int``, ``tolist``, ``numpy``, ``__index__``, ``__format__``
— of a tensor outside :class:`HostCopy` and outside a :func:`designed` read, with :class:`HostReadError`. It runs on
the CPU, where every read is free, and fails exactly where a GPU run would drain its queue. Designed reads name their
reason (docs/gpu.md lists them); :data:`DESIGNED` counts them per reason (a test can check a steady step makes none).
Reads by ``torch.optim`` are exempt: its step counters live on the host unless the optimizer is fused or capturable
(then it reads none).
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.overrides import TorchFunctionMode

STRICT_ENV = "SYNCWISE_STRICT_SYNCS"


class HostReadError(RuntimeError):
    """A step read a device value on the host outside the event-guarded reader (strict mode)."""


def strict() -> bool:
    """True when ``SYNCWISE_STRICT_SYNCS`` is set to a true value (1/true/yes/on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_tls = threading.local()
#: designed reads made so far, per reason (every run; strict mode or not)
DESIGNED: "collections.Counter[str]" = collections.Counter()


def _allowed() -> bool:
    return getattr(_tls, "allowed", 0) > 0


class designed:
    """``with designed(reason):`` a host read by design (``reason``: why the host needs the value now; listed in
    docs/gpu.md). A plain class, not a generator: it is on every step's path (the non-fused optimizer's skip)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __enter__(self) -> None:
        DESIGNED[self.reason] += 1
        _tls.allowed = getattr(_tls, "allowed", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _tls.allowed -= 1


@contextlib.contextmanager
def _reader() -> Iterator[None]:
    _tls.allowed = getattr(_tls, "allowed", 0) + 1
    try:
        yield
    finally:
        _tls.allowed -= 1


class HostCopy:
    """Named step values (0-d tensors, or plain numbers) readable later without draining the device's queue.

    CUDA: stacked into one fp64 vector, copied with ``non_blocking`` into pinned memory, one event recorded on the
    current stream after the copy; :meth:`read` waits for that event only. CPU: the stacked values are host memory
    already. Another accelerator: read when needed (a sync there)."""

    __slots__ = ("names", "_plain", "_host", "_event")

    def __init__(self, values: Mapping[str, Any]):
        tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
        self._plain = {k: v for k, v in values.items() if not torch.is_tensor(v)}
        self.names = list(tensors)
        self._host: Optional[torch.Tensor] = None
        self._event: Any = None
        if not tensors:
            return
        stacked = torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors.values()])
        if stacked.device.type == "cuda":
            self._host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(stacked.device))
        else:
            self._host = stacked

    def ready(self) -> bool:
        """True if :meth:`read` would not wait for the device."""
        if self._event is not None:
            return bool(self._event.query())
        return self._host is None or self._host.device.type == "cpu"

    def read(self) -> dict[str, Any]:
        """The values as Python floats (plain numbers as given); waits for this copy's event only."""
        out = dict(self._plain)
        if self._host is None:
            return out
        if self._event is not None:
            self._event.synchronize()
        with _reader():
            out.update(zip(self.names, self._host.tolist()))
        return out


_READS = frozenset(getattr(torch.Tensor, n) for n in ("item", "__bool__", "__float__", "__int__", "tolist", "numpy",
                                                    "__index__", "__format__"))
_OPTIM = os.sep + os.path.join("torch", "optim") + os.sep


class _StrictSyncs(TorchFunctionMode):
    """Fails a scalar read of a tensor outside :class:`HostCopy` / :func:`designed` (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and not _allowed() and args and torch.is_tensor(args[0]):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename == __file__:
                caller = caller.f_back
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
            if _OPTIM not in where:
                t = args[0]
                raise HostReadError(
                    f"{getattr(func, '__name__', func)}() of a {tuple(t.shape)} {t.dtype} tensor at {where} inside a "
                    f"step: on a GPU this waits for every kernel queued so far. Read step values through "
                    f"syncwise.comm.hostread.HostCopy (pinned, behind one event), or mark a read the host needs now "
                    f"with hostread.designed('why') and list it in docs/gpu.md. [{STRICT_ENV}=1]")
        return func(*args, **(kwargs or {}))


def step_region() -> Any:
    """The strict check around a step's work on this thread (a no-op context unless :func:`strict`)."""
    return _StrictSyncs() if strict() else contextlib.nullcontext()
