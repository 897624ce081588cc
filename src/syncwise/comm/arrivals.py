"""When this rank arrived at each collective: PyTorch's flight recorder, read in batches, written per step.

PyTorch's flight recorder (c10d's ``FlightRecorder``, ``TORCH_FR_BUFFER_SIZE`` entries, on by default in torch
2.13 and kept for gloo as well as NCCL) records every collective a process group issues: its process group,
its per-group sequence number (``collective_seq_id``, the same on every rank for the same collective), the op
and its sizes, and ``time_created_ns`` — the wall-clock moment this rank enqueued it, i.e. *arrived* at it. The
rank that arrives last at a collective is the one every other rank waits for there, whatever its step time says
(under DDP the all-reduce evens out the ranks' step times: a compute straggler in the backward is hidden in the
others' waits). ``syncwise doctor`` compares the ranks' arrivals (syncwise.doctor.arrivals).

The recorder costs syncwise nothing per collective (torch keeps it anyway); reading it is a dump of the ring
(~5 µs per entry, measured: 5.5 ms for 1,046 entries on this machine's CPU), so :class:`ArrivalLog` reads it
only every ``every_s`` seconds or before the ring can wrap (half of ``TORCH_FR_BUFFER_SIZE`` new entries at the
last rate), never per step, and writes ``RUN_DIR/ranks/arrivals{R}.jsonl``: one line per step,

    {"step": 12, "start_ns": ..., "end_ns": ..., "c": [[pg, seq, op, numel, offset_ns], ...]}

(offset from the step's start; at most ``max_per_step`` collectives a step, the rest counted in ``"more"``).
Wall clocks agree between ranks of one host (and the network lab's nodes); across hosts they agree to NTP's
precision, which doctor states. Where the recorder is missing or empty (another torch, a disabled buffer) the
log stays empty and doctor falls back to per-rank step times.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Optional

from ..rundir import RunDir

log = logging.getLogger(__name__)

DEFAULT_BUFFER = 2000           # torch's default TORCH_FR_BUFFER_SIZE when the variable is unset


def _dump() -> Optional[list[dict[str, Any]]]:
    """The flight recorder's entries (no stack traces), or None where this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    try:
        return pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])
    except Exception:  # a recorder that is off or broken: no arrivals, doctor falls back to step times
        return None


def window(lo_ns: int, hi_ns: int) -> Optional[list[dict[str, Any]]]:
    """The collectives this rank issued between ``lo_ns`` and ``hi_ns`` (wall clock), from the flight recorder, in
    the order they were created: process group (name, description), per-group sequence id, op, input sizes and
    dtypes, and the creation time. The profiler stores them beside a trace recorded without shapes (the sizes of
    its collectives, ``syncwise.train.profile``); None where this torch has no recorder."""
    entries = _dump()
    if entries is None:
        return None
    rows = []
    for e in sorted(entries, key=lambda e: e.get("time_created_ns", 0)):
        t = int(e.get("time_created_ns") or 0)
        if lo_ns <= t <= hi_ns:
            pg = list(e.get("process_group") or ("", ""))
            rows.append({"pg": str(pg[0]), "desc": str(pg[1]) if len(pg) > 1 else "",
                         "seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
                         "op": str(e.get("profiling_name", "")), "sizes": e.get("input_sizes") or [],
                         "dtypes": e.get("input_dtypes") or [], "t_ns": t})
    return rows


def buffer_size() -> int:
    value = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", ""))
    try:
        return int(value) if value else DEFAULT_BUFFER
    except ValueError:
        return DEFAULT_BUFFER


def _numel(sizes: Any) -> int:
    total = 0
    for shape in sizes or ():
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


class ArrivalLog:
    """Per-step arrivals of this rank at its collectives under ``RUN_DIR/ranks/``; a no-op without a run dir."""

    def __init__(self, run_dir: "str | Path | None", rank: int, every_s: float = 5.0, max_per_step: int = 512,
                 start_step: int = 0):
        self.rank, self.every_s, self.max_per_step = rank, every_s, max_per_step
        self.path = RunDir(run_dir).arrivals(rank) if run_dir else None
        self._steps: list[tuple[int, int, int]] = []      # (step, start_ns, end_ns) not yet written
        self._last_record = -1
        self._last_dump = time.monotonic()
        self._per_step = 1.0                                # collectives per step seen at the last read
        self._budget = max(1, buffer_size() // 2)
        self._start: Optional[int] = None
        self.read_s = 0.0                                   # time spent reading the recorder (measured)
        self.reads = self.steps_logged = 0
        self.enabled = self.path is not None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a fresh run drops an old run's rows; a resumed one keeps the steps before it
            keep = []
            if start_step:
                for line in self.path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if row.get("step", 0) <= start_step:
                        keep.append(line + "\n")
            self.path.write_text("".join(keep))
        entries = _dump()
        if entries is None:
            self.enabled = False
            return
        self._last_record = max((e.get("record_id", -1) for e in entries), default=-1)

    def begin(self) -> None:
        """The step starts now."""
        if self.enabled:
            self._start = time.time_ns()

    def end(self, step: int) -> None:
        """Step ``step`` ended now; read the recorder when it is time (every ``every_s`` s, or before it wraps)."""
        if not self.enabled or self._start is None:
            return
        self._steps.append((step, self._start, time.time_ns()))
        self._start = None
        if (time.monotonic() - self._last_dump >= self.every_s
                or len(self._steps) * self._per_step >= self._budget):
            self.flush()

    def flush(self) -> None:
        """Read the recorder and write the steps seen since the last read."""
        if not self.enabled or not self._steps:
            return
        t0 = time.perf_counter()
        entries = _dump() or []
        new = sorted((e for e in entries if e.get("record_id", -1) > self._last_record),
                     key=lambda e: e.get("time_created_ns", 0))
        if new:
            self._last_record = max(e.get("record_id", -1) for e in new)
        lines, i = [], 0
        for step, start, end in self._steps:
            while i < len(new) and new[i].get("time_created_ns", 0) < start:
                i += 1                                    # issued between steps (a checkpoint, a validation)
            row: list[list[Any]] = []
            more = 0
            while i < len(new) and new[i].get("time_created_ns", 0) <= end:
                e = new[i]
                i += 1
                if e.get("is_p2p"):
                    continue
                if len(row) >= self.max_per_step:
                    more += 1
                    continue
                name = str(e.get("profiling_name", "")).split(":", 1)[-1]
                row.append([int(e.get("pg_id", 0)), int(e.get("collective_seq_id", 0)), name,
                            _numel(e.get("input_sizes")), int(e["time_created_ns"]) - start])
            out: dict[str, Any] = {"step": step, "start_ns": start, "end_ns": end, "c": row}
            if more:
                out["more"] = more
            lines.append(json.dumps(out, separators=(",", ":")) + "\n")
        self._per_step = max(1.0, len(new) / len(self._steps))
        self._steps.clear()
        if not self._write("".join(lines), "a"):
            return
        self._last_dump = time.monotonic()
        self.reads += 1
        self.steps_logged += len(lines)
        self.read_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Write the last steps, and what reading the recorder cost (``arrivals{R}.cost.json``: reads, seconds,
        steps) — the log's only cost beyond two clock reads a step."""
        self.flush()
        if self.enabled:
            cost = {"reads": self.reads, "read_s": self.read_s, "steps": self.steps_logged}
            self._write(json.dumps(cost) + "\n", "w", self.path.with_suffix(".cost.json"))

    def _write(self, text: str, mode: str, path: Optional[Path] = None) -> bool:
        """Append or write; a diagnostics log never ends a run (nor hides the error that is ending it): on a
        full disk or a lost directory it warns once and stops logging."""
        try:
            with open(path or self.path, mode) as f:
                f.write(text)
            return True
        except OSError as e:
            log.warning("arrival log %s: %s; no more arrivals are logged in this run", path or self.path, e)
            self.enabled = False
            return False
