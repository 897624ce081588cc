"""Counters of the collectives syncwise issues: :class:`CommStats` (one kind of traffic) and :class:`CommLedger`
(a run's, one CommStats per kind).

No counter is process-wide: a run's ledger is made by ``syncwise.parallel.parallelize`` (``Parallelized.ledger``)
and handed to everything it builds; each ``syncwise.comm.ops`` collective records into the ``stats=`` it is given
(none given: counted nowhere); objects usable on their own (``CommContext``, a compressor, a sync strategy) own a
CommStats of their own until a run hands them its ledger's. Two runs in one process never share a count.

Cheap by design: a record is a few dict updates. On the CPU synchronous collectives are timed by wall clock
and asynchronous ones from issue to completion through a future callback; on CUDA by events
(:mod:`.timing`), whose durations are added when they are read and complete (``settle``), so nothing adds a
synchronisation point. The trainer's step meter reads bytes and seconds per step from its run's ledger.

Hops: every record also says which hop its bytes crossed, by the one rule of ``syncwise.comm.ops`` (``split_bytes``
/ ``cross_share``): a ring collective (all-reduce, all-gather, reduce-scatter) over a group spanning N_g nodes with W
ranks counts N_g / W of its bytes ``cross`` and the rest ``intra``; an all-to-all its chunks for ranks on other nodes;
a group inside one node all ``intra``; a broadcast's group as a whole (``hop_of``); unknown where no topology is
known, or a collective issued outside syncwise.comm whose group is not known. ``CommStats.hops`` keeps the bytes
per hop, so a run's cross-node bytes — the ones the slow link carries — are read apart from its node-local ones.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class OpTotals:
    """Running totals for one collective kind."""

    calls: int = 0
    bytes: int = 0
    time_s: float = 0.0


#: the hops a byte can cross: inside one node, or between nodes (bytes of neither are counted as "unknown")
HOPS = ("intra", "cross")
UNKNOWN_HOP = "unknown"


@dataclass
class CommStats:
    """Counters of collectives issued by this process (bytes = this rank's input payload), per op and per hop."""

    by_op: dict[str, OpTotals] = field(default_factory=dict)
    hops: dict[str, int] = field(default_factory=dict)  # bytes per hop: 'intra', 'cross', 'unknown' (see module doc)
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

    def record(self, op: str, nbytes: int, seconds: float = 0.0, hop: "Optional[str | dict]" = None) -> None:
        """Count one collective of ``nbytes`` payload; ``seconds`` if already known; ``hop``: where its bytes went —
        'intra' or 'cross' (all of them), the bytes split ``{'intra': .., 'cross': ..}`` (``syncwise.comm.ops.
        split_bytes``: a ring's N_g / W across, an all-to-all's chunks for other nodes; what the split does not
        account for is unknown), or None (unknown)."""
        n = int(nbytes)
        if isinstance(hop, dict):
            parts = {h: int(hop.get(h, 0)) for h in HOPS if h in hop}
            rest = n - sum(parts.values())
            if rest:
                parts[UNKNOWN_HOP] = rest
        else:
            parts = {hop if hop in HOPS else UNKNOWN_HOP: n}
        with self._lock:
            t = self.by_op.setdefault(op, OpTotals())
            t.calls += 1
            t.bytes += n
            t.time_s += seconds
            for key, m in parts.items():
                self.hops[key] = self.hops.get(key, 0) + m

    def add_time(self, op: str, seconds: float) -> None:
        """Add completion time for an asynchronous collective recorded earlier."""
        with self._lock:
            self.by_op.setdefault(op, OpTotals()).time_s += seconds

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.by_op.values())

    def hop_bytes(self) -> dict[str, int]:
        """Bytes per hop so far (a copy): 'intra', 'cross', and 'unknown' where some were not classified."""
        with self._lock:
            return dict(self.hops)

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
            self.hops.clear()
            self._pending.clear()


class CommLedger:
    """A run's communication counters: one :class:`CommStats` per kind of traffic, each fed where it is issued.

    * ``dp`` — the gradient sync syncwise issues itself: DDP's comm hook (or the bytes of DDP's built-in all-reduce),
      the compressors, the reduced-sync strategies, a pipeline stage's replicas, the expert gradients' sum over
      their copies, live recovery's cross-replica average. The step's ``comm_bytes_dp`` / ``comm_s_dp``;
    * ``ep`` — the expert-parallel all-to-alls (``comm_bytes_ep``);
    * ``control`` — collectives that are not a step's traffic: the logged loss's mean, validation, router loads;
    * ``norm`` — the gradient norm's combination across tensor-parallel / pipeline ranks;
    * ``pp`` — the pipeline's batched sends (the step's ``comm_bytes_pp`` is the pipeline's own count of them);
    * ``signals`` — the preemption flag's agreement.

    ``ledger.dp`` (or ``ledger["dp"]``) is the CommStats of one kind.
    """

    KINDS = ("dp", "ep", "control", "norm", "pp", "signals")

    def __init__(self) -> None:
        self._by_kind: dict[str, CommStats] = {k: CommStats() for k in self.KINDS}

    def __getitem__(self, kind: str) -> CommStats:
        return self._by_kind[kind]

    def __getattr__(self, kind: str) -> CommStats:
        try:
            return self.__dict__["_by_kind"][kind]
        except KeyError:
            raise AttributeError(f"CommLedger has no kind {kind!r} (kinds: {', '.join(self.KINDS)})") from None

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """Every kind's :meth:`CommStats.snapshot` (kinds with nothing counted left out)."""
        return {k: snap for k, s in self._by_kind.items() if (snap := s.snapshot())}

    def reset(self) -> None:
        for s in self._by_kind.values():
            s.reset()

    def __repr__(self) -> str:
        return "CommLedger(" + ", ".join(f"{k}={s.total_bytes}B" for k, s in self._by_kind.items()) + ")"


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
