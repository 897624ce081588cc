"""Process-wide counters for every collective syncwise issues.

Cheap by design: a record is a few dict updates. On the CPU synchronous collectives are timed by wall clock
and asynchronous ones from issue to completion through a future callback; on CUDA by events
(:mod:`.timing`), whose durations are added when they are read and complete (``settle``), so nothing adds a
synchronisation point. The trainer reads bytes and counts per step from here.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class OpTotals:
    """Running totals for one collective kind."""

    calls: int = 0
    bytes: int = 0
    time_s: float = 0.0


@dataclass
class CommStats:
    """Counters of collectives issued by this process (bytes = this rank's input payload)."""

    by_op: dict[str, OpTotals] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pending: list = field(default_factory=list, repr=False)  # (op, timing.Interval) not yet added

    def add_interval(self, op: str, interval: object) -> None:
        """Add the duration of ``interval`` (a :class:`~.timing.Interval`) to ``op`` once it has completed."""
        with self._lock:
            self._pending.append((op, interval))

    def settle(self, wait: bool = False) -> None:
        """Fold the durations of completed intervals into the totals (all of them, waiting, with ``wait``)."""
        if not self._pending:
            return
        with self._lock:
            keep = []
            for op, iv in self._pending:
                if wait or iv.done():
                    self.by_op.setdefault(op, OpTotals()).time_s += iv.seconds()
                else:
                    keep.append((op, iv))
            self._pending = keep

    def record(self, op: str, nbytes: int, seconds: float = 0.0) -> None:
        """Count one collective of ``nbytes`` payload; ``seconds`` if already known."""
        with self._lock:
            t = self.by_op.setdefault(op, OpTotals())
            t.calls += 1
            t.bytes += int(nbytes)
            t.time_s += seconds

    def add_time(self, op: str, seconds: float) -> None:
        """Add completion time for an asynchronous collective recorded earlier."""
        with self._lock:
            self.by_op.setdefault(op, OpTotals()).time_s += seconds

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.by_op.values())

    @property
    def total_calls(self) -> int:
        return sum(t.calls for t in self.by_op.values())

    @property
    def total_time_s(self) -> float:
        """Seconds spent in (synchronous) or until completion of (asynchronous) every collective so far."""
        self.settle()
        return sum(t.time_s for t in self.by_op.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A plain-dict copy, for logging."""
        self.settle()
        with self._lock:
            return {k: {"calls": v.calls, "bytes": v.bytes, "time_s": v.time_s} for k, v in self.by_op.items()}

    def since(self, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """What was counted after ``before`` (an earlier :meth:`snapshot`), per op."""
        out = {}
        for op, now in self.snapshot().items():
            was = before.get(op, {})
            delta = {k: now[k] - was.get(k, 0) for k in now}
            if delta["calls"] or delta["bytes"] or delta["time_s"]:
                out[op] = delta
        return out

    def reset(self) -> None:
        with self._lock:
            self.by_op.clear()
            self._pending.clear()


STATS = CommStats()


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
