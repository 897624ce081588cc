"""Hang reports: which collective, on which process group, at which step — and which ranks did not arrive.

A collective that never completes must be *reported*, never waited out. Two mechanisms:

- every process group syncwise creates carries ``--dist.timeout_s`` (``ops.new_group``), so a blocking
  gloo/NCCL call raises after the timeout and the trainer turns that into a message (``report``);
- a :class:`Watchdog` thread per rank catches what no timeout covers (a future nobody waits on with a
  timeout, a thread stuck in a collective): a collective issued through ``syncwise.comm.ops`` that is
  still in flight ``grace_s`` after the timeout is reported from the watchdog, which then ends the
  process (exit code :data:`HANG_EXIT_CODE`) so torchrun's agent stops or restarts the job.

Before leaving, the rank that reports writes its flight recorder (``comm/flight.py``: the last collectives of
every group, their sequence numbers and issuing frames) with the report into the run directory's ``flight/``,
where ``syncwise doctor`` aligns the ranks' dumps (``doctor/flight.py``).

Which ranks did not arrive: each rank's watchdog writes a heartbeat (step, phase, time) every
``interval_s`` into ``heartbeat_dir`` (the run directory, which checkpoints already require to be shared
by all ranks). A report reads them: a rank whose heartbeat is stale is stopped or dead; a rank at an
earlier step or another phase is named with where it is. Not the rendezvous TCPStore: a client call to a
store whose host process is stopped (SIGSTOP) blocks forever whatever its timeout (measured here).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from . import flight, ops

HANG_EXIT_CODE = 75  # distinctive in the agent's logs: this rank reported a hang and left


class Watchdog:
    """Per-rank heartbeat and hang detector; the trainer calls :meth:`at` whenever its step or phase changes."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, heartbeat_dir: "str | os.PathLike | None",
                 *, interval_s: float = 1.0, grace_s: float = 2.0, flight_dump: "str | os.PathLike | None" = None):
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.flight_dump = flight_dump  # where this rank's flight recorder goes when it reports a hang (comm/flight.py)
        self.interval_s, self.grace_s = interval_s, grace_s
        self.step, self.phase = 0, "start"
        self.dir = Path(heartbeat_dir) if heartbeat_dir is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._beat()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="syncwise-watchdog", daemon=True)
        self._thread.start()

    def at(self, step: int, phase: str) -> None:
        """Where this rank is now (read by the heartbeat and by reports)."""
        self.step, self.phase = step, phase

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()
            stuck = ops.oldest_in_flight()
            if stuck is not None and time.monotonic() - stuck.started > self.timeout_s + self.grace_s:
                report = self.report(stuck)
                flight.dump(self.flight_dump, self.rank, self.world_size, report)  # before the words that end the job
                print(f"syncwise: rank {self.rank}: {report}", file=sys.stderr, flush=True)
                os._exit(HANG_EXIT_CODE)

    def _beat(self) -> None:
        if self.dir is None:
            return
        path = self.dir / f"rank_{self.rank:05d}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"step": self.step, "phase": self.phase, "time": time.time()}))
            os.replace(tmp, path)
        except OSError:  # a full disk must not stop training; the report then has older beats
            pass

    # ---- reports ------------------------------------------------------------------------------
    def report(self, collective: Optional[ops.InFlight] = None, what: Optional[str] = None) -> str:
        """One paragraph: this rank, the collective and its group, the step, and the ranks that did not
        arrive (as far as the heartbeats tell)."""
        what = what or (collective.describe() if collective is not None else "a collective")
        waited = (f"{time.monotonic() - collective.started:.0f} s" if collective is not None
                  and collective.started is not None else f"the {self.timeout_s:g} s timeout")
        return (f"{what} during {self.phase} of step {self.step} did not complete "
                f"(waited {waited}; --dist.timeout_s={self.timeout_s:g}). {self.missing_ranks()} "
                "Check those ranks' logs; raise --dist.timeout_s if steps are legitimately slow.")

    def missing_ranks(self) -> str:
        """Who is not where this rank is, from the heartbeats."""
        if self.dir is None:
            return "(No heartbeats without a run directory.)"
        now, stale_after = time.time(), 3 * self.interval_s + 1.0
        late, elsewhere = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                beat = json.loads((self.dir / f"rank_{r:05d}.json").read_text())
            except (OSError, ValueError):
                late.append(f"rank {r} (no heartbeat)")
                continue
            age = now - float(beat["time"])
            where = f"at step {beat['step']} ({beat['phase']})"
            if age > stale_after:
                late.append(f"rank {r} (silent for {age:.0f} s, last {where})")
            elif (beat["step"], beat["phase"]) != (self.step, self.phase):
                elsewhere.append(f"rank {r} is {where}")
        parts = (["Did not arrive: " + "; ".join(late) + "."] if late else []) + (
            ["Not at the same place: " + "; ".join(elsewhere) + "."] if elsewhere else [])
        return " ".join(parts) or "Every other rank is alive at the same step and phase (a collective mismatch?)."
