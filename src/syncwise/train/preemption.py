"""Preemption: a scheduler's SIGTERM / SIGUSR1 ends the run at a step boundary with a checkpoint, not a loss.

Slurm sends SIGUSR1 (``--signal=USR1@GRACE``) before a time limit and SIGTERM on ``scancel``, ``scontrol
requeue`` and preemption; Kubernetes sends SIGTERM when it evicts or deletes a pod; torchrun's agent forwards
the signals it handles to its workers. What happens then, in every worker:

1. the handler only raises a flag (a signal may land anywhere: inside a collective, during a save);
2. at each step boundary the ranks OR their flags (a 4-byte MAX all-reduce on a gloo group of its own, issued
   at the end of one step and read at the end of the next, so it never makes a rank wait): every rank stops
   after the same step, also when only one of them was signalled;
3. the trainer finishes that step, waits for a checkpoint save still in flight, saves the step it stopped at
   synchronously (published atomically: written aside, checksummed, renamed) and rank 0 writes
   ``preempted.json`` (signal, step, checkpoint) into the run directory;
4. ``train()`` raises :class:`Preempted`, a ``SystemExit`` with code :data:`EXIT_PREEMPTED`, so the process ends
   with that code and a script using the Python API does not carry on as if training had finished.

Ctrl-C (SIGINT) does the same (it used to end the workers at once, losing every step after the last periodic
checkpoint): the first one stops after the step and saves, and the process ends with exit code 130 (128 + SIGINT,
as a shell expects of Ctrl-C); a second one stops at once (the handler that was there before runs: Python's
KeyboardInterrupt, or the worker's quiet exit). Under torchrun one Ctrl-C reaches each worker twice, from the
terminal (the whole foreground process group) and forwarded by the agent, a few milliseconds apart: a SIGINT less
than :data:`SAME_CTRL_C_S` after the first counts as the same Ctrl-C. A process that ignores SIGINT keeps ignoring it.

A signal that arrives during step S stops the run after step S + 1 at the latest (the flag read lags one step).
If the stop and save have not finished ``grace_s`` seconds after the signal, the process reports where it was and
exits with :data:`EXIT_GRACE_EXPIRED`; the newest published checkpoint is intact either way (a save that did not
finish is only ever a ``.partial`` directory, never the newest checkpoint). ``resume='auto'`` continues the run
exactly (bit-identical under ``--deterministic``).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..comm import ops
from ..rundir import RunDir

#: Exit code of a process that stopped on SIGTERM/SIGUSR1 after publishing a checkpoint of its last finished step.
#: Resume (``--resume auto``; the generated Slurm script requeues itself) continues exactly.
EXIT_PREEMPTED = 83
#: Exit code when the grace period ran out before that checkpoint was published: the run resumes from the
#: newest published checkpoint, which is older (steps after it are redone).
EXIT_GRACE_EXPIRED = 84
#: The signals that ask for a checkpoint and a clean stop.
SIGNALS = ("SIGTERM", "SIGUSR1")
#: torchrun's agent handles (and forwards to the workers) SIGTERM, SIGINT, SIGHUP and SIGQUIT by default; SIGUSR1
#: must be added (``--signals-to-handle``, torch >= 2.9), or it kills the agent.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: Ctrl-C: the first stops after the step and saves (as SIGTERM), a second stops at once; exit code 130.
INTERRUPT = "SIGINT"
EXIT_INTERRUPTED = 130
#: Two SIGINTs closer than this are one Ctrl-C (the terminal's copy and the one torchrun's agent forwards).
SAME_CTRL_C_S = 1.0
#: The file rank 0 writes into the run directory when it stopped for preemption (removed when a run starts).
MARKER = RunDir(".").preempted.name  # the file name alone, for shell scripts (launch/slurm.py)


class Preempted(SystemExit):
    """Raised by ``OptimizedTrainer.train()`` after it stopped for a signal and saved: exits the process with
    :data:`EXIT_PREEMPTED` unless caught. ``step`` is the last finished (and saved) step."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[str]):
        super().__init__(exit_code(signal_name))
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint

    def __str__(self) -> str:
        return (f"stopped by {self.signal_name} after step {self.step}; checkpoint "
                f"{self.checkpoint or '(none: no checkpoint directory)'}")


def exit_code(signal_name: Optional[str]) -> int:
    """The exit code of a process that stopped and saved for ``signal_name``: 130 for Ctrl-C, else 83."""
    return EXIT_INTERRUPTED if signal_name == INTERRUPT else EXIT_PREEMPTED


class StopSignal(BaseException):
    """A launcher process got SIGTERM/SIGUSR1 (see :func:`signals_raise`): like KeyboardInterrupt, it unwinds
    the launcher so it can pass the signal on to the workers it started and wait for them."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside: SIGTERM/SIGUSR1 raise :class:`StopSignal` in the main thread (a launcher that is not a torchrun agent,
    e.g. the lab's, then stops its nodes gracefully). Outside a main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stop(signum: int, frame: Any) -> None:
        raise StopSignal(signal.Signals(signum).name)

    previous = {}
    for name in SIGNALS:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, raise_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def marker_path(run_dir: "str | os.PathLike") -> Path:
    return RunDir(run_dir).preempted


def read_marker(run_dir: "str | os.PathLike | None") -> Optional[dict[str, Any]]:
    """The ``preempted.json`` of ``run_dir`` (None if there is none or it does not parse)."""
    if not run_dir:
        return None
    try:
        value = json.loads(marker_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_marker(run_dir: "str | os.PathLike", record: dict[str, Any]) -> None:
    """Write ``preempted.json`` atomically (aside, fsynced, renamed): a reader never sees half of it."""
    path = marker_path(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def clear_marker(run_dir: "str | os.PathLike | None") -> None:
    if run_dir:
        try:
            marker_path(run_dir).unlink()
        except FileNotFoundError:
            pass


def describe(record: dict[str, Any], run_dir: "str | os.PathLike") -> str:
    """The plain-words report of a preemption for the launcher: where it stopped, what is saved, how to resume."""
    sig, step = record.get("signal", "a signal"), record.get("step", "?")
    if record.get("saved"):
        saved = f"checkpoint of step {step} saved ({record.get('checkpoint')})"
    else:
        last = record.get("checkpoint")
        saved = (f"the grace period ran out before a new checkpoint was published; the newest is {last}" if last
                 else "the grace period ran out before a checkpoint was published")
    what = "stopped by Ctrl-C (SIGINT)" if sig == INTERRUPT else f"preempted ({sig})"
    return (f"{what} after step {step}; {saved}; resume with: syncwise train --run-dir {run_dir} "
            f"--resume auto (exit code {record.get('exit_code', EXIT_PREEMPTED)})")


class PreemptionGuard:
    """Turns SIGTERM/SIGUSR1 into a stop at a step boundary agreed by every rank (see the module docstring).

    ``install()`` (main thread only; elsewhere the signals keep their old handlers) and ``uninstall()`` around
    the loop; ``stop_after(step)`` after every step, on every rank, returns the same answer on every rank.
    ``grace_s`` None or 0 turns the guard off (the signals keep their default effect).
    """

    def __init__(self, grace_s: Optional[float], rank: int = 0, world_size: int = 1, stats: Any = None):
        self.grace_s = float(grace_s) if grace_s else 0.0
        self.stats = stats  # where the flag's all-reduce is counted (the run's ledger.signals: not gradient traffic)
        self.rank, self.world_size = rank, world_size
        self.signal_name: Optional[str] = None  # the first signal this process got
        self.signalled_at: Optional[float] = None
        self.stopping_step: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._ctrl_c_at: Optional[float] = None  # when this process itself first got SIGINT
        self._timer: Optional[threading.Timer] = None
        self._group = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work = None  # the flag all-reduce issued at the end of the previous step
        self.marker_dir: Optional[Path] = None  # where rank 0 writes preempted.json
        self.checkpoint_dir: Optional[Path] = None

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    @property
    def requested(self) -> bool:
        """This process got a stop signal."""
        return self.signal_name is not None

    # ------------------------------------------------------------------------------------------ handlers
    def install(self, marker_dir: "str | os.PathLike | None" = None,
                checkpoint_dir: "str | os.PathLike | None" = None) -> "PreemptionGuard":
        """Handle SIGTERM/SIGUSR1 from now on (collective when distributed: every rank calls it). Rank 0 removes
        a ``preempted.json`` of an earlier attempt from ``marker_dir``: the file always describes this run."""
        self.marker_dir = Path(marker_dir) if marker_dir else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.signal_name = self.signalled_at = self.stopping_step = self._ctrl_c_at = None
        if self.rank == 0:
            clear_marker(self.marker_dir)
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return self
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a process that ignores Ctrl-C keeps doing so
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        if self.world_size > 1 and self._group is None:
            # A gloo group of its own: the flag is a CPU tensor whatever the training backend (no device sync),
            # and its all-reduce never interleaves with the training's collectives.
            self._group = ops.new_group(backend="gloo", desc="preemption")
        self._work = None
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers, finish an outstanding flag all-reduce, stop the grace timer."""
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError:
                pass  # the run is failing anyway (a peer died): its own error is the one to report
            self._work = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._timer is not None and self.stopping_step is None:  # a stop keeps its deadline until the exit
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and frame is not None:  # this process's own Ctrl-C (not another rank's flag)
            now = time.monotonic()
            if self._ctrl_c_at is not None and now - self._ctrl_c_at >= SAME_CTRL_C_S:
                self._stop_now(frame)  # a second Ctrl-C
                return
            if self._ctrl_c_at is None:
                self._ctrl_c_at = now
                if self.rank == 0 and self.signal_name is None:
                    sys.stderr.write("\nsyncwise: Ctrl-C: stopping after this step and saving it; "
                                     "press Ctrl-C again to stop at once\n")
                    sys.stderr.flush()
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        self.signalled_at = time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _stop_now(self, frame: Any) -> None:
        """A second Ctrl-C: hand SIGINT back to the handler that was there before and run it."""
        previous = self._previous.pop(signal.SIGINT, None)
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if callable(previous):
            previous(signal.SIGINT, frame)
        raise KeyboardInterrupt

    def _expire(self) -> None:
        msg = (f"syncwise: rank {self.rank}: the preemption grace of {self.grace_s:g} s ({self.signal_name}) ran out "
               "before the run stopped and saved; exiting now (the newest published checkpoint is intact; resume "
               f"redoes the steps after it). Exit code {EXIT_GRACE_EXPIRED}.\n")
        try:
            if self.rank == 0 and self.marker_dir is not None:
                from ..checkpoint.storage import published_checkpoints

                newest = published_checkpoints(self.checkpoint_dir) if self.checkpoint_dir else []
                write_marker(self.marker_dir, self._record(False, str(newest[0]) if newest else None,
                                                           EXIT_GRACE_EXPIRED))
        except OSError:
            pass
        finally:
            sys.stderr.write(msg)
            sys.stderr.flush()
            os._exit(EXIT_GRACE_EXPIRED)

    # ------------------------------------------------------------------------------------------ agreement
    def stop_after(self, step: int) -> bool:
        """Call after every step but the run's last, on every rank: True when every rank must stop now.

        Alone, the local flag decides at once. Distributed, the answer is the OR of every rank's flag as it was at
        the end of the previous step (the all-reduce issued then is read now; the flag carries the signal's
        number, so every rank can name it), and the next one is issued.
        """
        if not self.enabled:
            return False
        if self.world_size <= 1 or self._group is None:
            stop = self.requested
        else:
            seen = 0
            if self._work is not None:
                self._work.wait()
                seen = int(self._flag.item())
                self._work = None
            stop = seen > 0
            if stop and self.signal_name is None:  # another rank was signalled: the grace starts now here
                self._handle(seen, None)
            if not stop:
                self._flag.fill_(int(getattr(signal, self.signal_name)) if self.requested else 0)
                self._work = ops.all_reduce(self._flag, "max", group=self._group, async_op=True, stats=self.stats)
        if stop:
            self.stopping_step = step
        return stop


    # ------------------------------------------------------------------------------------------ the outcome
    def _record(self, saved: bool, checkpoint: Optional[str], code: int) -> dict[str, Any]:
        return {"signal": self.signal_name, "step": self.stopping_step, "saved": saved, "checkpoint": checkpoint,
                "exit_code": code, "grace_s": self.grace_s, "time": time.time(),
                "stop_s": round(time.monotonic() - self.signalled_at, 3) if self.signalled_at else None}

    def record(self, checkpointer: Any = None) -> dict[str, Any]:
        """After the stop's checkpoint is published: what happened (for the summary); rank 0 writes it to
        ``preempted.json``, which launchers and the generated Slurm script read."""
        last = checkpointer.last_save if checkpointer is not None else None
        saved = last is not None and last.step == self.stopping_step
        record = self._record(saved, str(last.path) if last is not None and last.path else None,
                              exit_code(self.signal_name))
        if self.rank == 0 and self.marker_dir is not None:
            write_marker(self.marker_dir, record)
        return record

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary``, or :class:`Preempted` raised when the run stopped for a signal."""
        if self.stopping_step is None:
            return summary
        if self._timer is not None:  # stopped and saved within the grace: the deadline is met
            self._timer.cancel()
            self._timer = None
        record = summary.get("preempted") or {}
        raise Preempted(self.signal_name or "a signal", self.stopping_step, record.get("checkpoint"))

