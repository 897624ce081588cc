"""Who arrives last at the collectives: straggler attribution from every rank's flight-recorder arrivals.

Each rank writes ``ranks/arrivals{R}.jsonl`` (syncwise.comm.arrivals): per step, its collectives as
``[pg, seq, op, numel, offset_ns]`` — process group, per-group sequence number (the same on every rank for the
same collective), op, elements, and when this rank enqueued it (ns after its step started; the step's start is
wall-clock ``start_ns``). Per collective that every rank issued, a rank's *lateness* is its arrival minus the
earliest rank's; a step's lateness of a rank is the most it was behind at any of the step's collectives
(the others wait for it once, where they block; after that the ranks are level). The rank that is last
by a margin is the one the others wait for in that step — under DDP its slowness is otherwise spread over every
rank's step time (the all-reduce evens them out).

:func:`attribute` then says, over the steady steps: which rank, by how much (the median margin over the steps it
was late in), whether it is *persistent* (late in ≥ 75 % of the steps since it first was) or *transient* (a few
steps: which), and whether its lateness is *input* (its own wait for batches in those steps explains at least
half of it) or *compute* (the rest). With no rank late but collectives waiting, the cause is the link.
Also: gradient collectives per step (DDP's buckets as the ranks actually issued them). Pure Python.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..rundir import RunDir

PERSISTENT = 0.75        # late in this share of the steps since its onset: a persistent straggler
MIN_LATE_S = 0.5e-3      # a margin below this is clock noise and scheduling, not a straggler
LATE_SHARE = 0.05        # ... and below this share of the step too
DOMINANCE = 2           # a straggler is last at least this many times as often as any other rank
SCALAR = 16              # collectives of at most this many elements are control traffic (the loss, flags)


@dataclass
class Arrivals:
    """Every rank's arrivals, matched by (process group, sequence number)."""

    ranks: list[int]
    steps: list[int]                                   # steps every rank logged
    late: dict[int, dict[int, float]]                  # step -> rank -> lateness (s, most behind at any collective)
    span: dict[int, tuple[int, int]]                   # step -> (earliest start_ns, latest end_ns) over ranks
    rows: dict[int, dict[int, dict[str, Any]]]         # rank -> step -> its row (for the timeline)
    grad_calls: dict[int, int]                         # step -> non-scalar collectives (median over ranks)
    matched: dict[int, int]                            # step -> collectives matched on every rank

    def step_late(self, step: int) -> tuple[int, float]:
        """(last rank, its margin over the next-latest) in ``step``."""
        late = self.late.get(step, {})
        if len(late) < 2:
            return (next(iter(late), -1), 0.0)
        order = sorted(late, key=late.get, reverse=True)
        return order[0], late[order[0]] - late[order[1]]


def load(run_path: "str | Path", ranks: list[int]) -> Optional[Arrivals]:
    """The run's arrivals, or None when fewer than two ranks logged any."""
    rows: dict[int, dict[int, dict[str, Any]]] = {}
    for r in ranks:
        path = RunDir(run_path).arrivals(r)
        if not path.is_file():
            continue
        per: dict[int, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line of a live run
            if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("c"), list):
                per[row["step"]] = row
        if per:
            rows[r] = per
    if len(rows) < 2:
        return None
    present = sorted(rows)
    steps = sorted(set.intersection(*(set(v) for v in rows.values())))
    late: dict[int, dict[int, float]] = {}
    span: dict[int, tuple[int, int]] = {}
    calls: dict[int, int] = {}
    matched: dict[int, int] = {}
    for s in steps:
        times: dict[tuple[int, int], dict[int, int]] = {}
        for r in present:
            row = rows[r][s]
            for c in row["c"]:
                times.setdefault((int(c[0]), int(c[1])), {})[r] = int(row["start_ns"]) + int(c[4])
        full = [t for t in times.values() if len(t) == len(present)]
        matched[s] = len(full)
        span[s] = (min(int(rows[r][s]["start_ns"]) for r in present), max(int(rows[r][s]["end_ns"]) for r in present))
        calls[s] = int(statistics.median(sum(1 for c in rows[r][s]["c"] if int(c[3]) > SCALAR) for r in present))
        if not full:
            continue
        # the most this rank was behind at any of the step's collectives: the others enqueue their buckets without
        # blocking and wait once, at the end of the backward, for its last one; after that sync the ranks are
        # level again (the loss all-reduce), so a median over collectives would halve the wait
        late[s] = {r: max((t[r] - min(t.values())) / 1e9 for t in full) for r in present}
    return Arrivals(present, steps, late, span, rows, calls, matched)


@dataclass
class Verdict:
    """What the arrivals say about stragglers over the steady steps."""

    rank: Optional[int] = None
    kind: str = ""                       # "compute" | "input" | "" (no straggler)
    persistent: bool = False
    lost_s: float = 0.0                  # the others' wait for it per step (over all steady steps)
    margin_s: float = 0.0                # median margin in the steps it was late
    data_s: float = 0.0                  # its median wait for batches in those steps
    late_steps: list[int] = field(default_factory=list)
    onset: Optional[int] = None
    steps: int = 0
    last_counts: dict[int, int] = field(default_factory=dict)   # rank -> steps it arrived last by a margin

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "persistent": self.persistent, "lost_s": self.lost_s,
                "margin_s": self.margin_s, "data_wait_s": self.data_s, "late_steps": self.late_steps,
                "onset_step": self.onset, "steady_steps": self.steps,
                "last_counts": {str(k): v for k, v in self.last_counts.items()}}


def attribute(arr: Arrivals, use: list[int], step_s: float,
              data_wait: Optional[dict[int, dict[int, float]]] = None) -> Verdict:
    """The straggler verdict over the steps ``use`` (steady steps) with a mean step of ``step_s`` seconds;
    ``data_wait``: rank -> step -> that rank's wait for its batches (its own rank log)."""
    steps = [s for s in use if s in arr.late]
    v = Verdict(steps=len(steps))
    if not steps:
        return v
    threshold = max(MIN_LATE_S, LATE_SHARE * step_s)
    per_step = {s: arr.step_late(s) for s in steps}
    for s, (r, margin) in per_step.items():
        if margin >= threshold:
            v.last_counts[r] = v.last_counts.get(r, 0) + 1
    if not v.last_counts:
        return v
    rank = max(v.last_counts, key=lambda r: (v.last_counts[r], -r))
    if v.last_counts[rank] < DOMINANCE * max((n for r, n in v.last_counts.items() if r != rank), default=0):
        return v            # the last place moves between ranks: jitter (shared cores, the OS), no straggler
    late_steps = [s for s, (r, margin) in per_step.items() if r == rank and margin >= threshold]
    onset = late_steps[0]
    since = [s for s in steps if s >= onset]
    v.rank, v.late_steps, v.onset = rank, late_steps, onset
    v.persistent = len(late_steps) >= PERSISTENT * len(since)
    v.margin_s = statistics.median(per_step[s][1] for s in late_steps)
    # what the others wait per step, over every steady step (a transient straggler costs only in its steps)
    v.lost_s = sum(per_step[s][1] for s in late_steps) / len(steps)
    if data_wait is not None and rank in data_wait:
        v.data_s = statistics.median(data_wait[rank].get(s, 0.0) for s in late_steps)
    v.kind = "input" if v.data_s >= 0.5 * v.margin_s else "compute"
    return v
