"""Profiler traces of chosen steps: ``--profile.steps=A:B`` / ``--profile.every=N`` (``profile_steps=`` /
``profile_every=`` of ``OptimizedTrainer``).

:class:`StepProfiler` is one collaborator of the training loop: made before the loop, told after every step
(:meth:`StepProfiler.step_done`), closed with the loop's cleanup. It drives ``torch.profiler.profile`` with a
schedule that maps the profiler's own step counter onto the trainer's step number, so a resumed run profiles the
steps it was asked for. Each recorded window is written by ``on_trace_ready`` as Chrome/Kineto JSON to
``RUN_DIR/traces/rank{R}.step{A}-{B}.json`` on every rank (torch adds ``distributedInfo``: backend, rank, world,
process groups); syncwise adds a ``"syncwise"`` key: rank, world size, the trainer steps in the file, the
trainer step of ``ProfilerStep#0`` (``ProfilerStep#k`` is step ``first_step + k``), and ``"collectives"``: the
flight recorder's entries created while the window recorded (process group, sequence id, op, sizes, dtypes,
creation time; ``comm.arrivals.window``). ``syncwise doctor`` reads them (``syncwise.doctor.trace``).

Shapes are not recorded (``record_shapes=False``): recording every operator's input shapes made this machine's CPU
forward and backward of ``small-dense`` 12 % slower (2 % without), which stretched the very overlap the trace is
read for. A collective's size and process group come from the flight recorder instead, which torch keeps anyway.

Off by default: without a schedule no profiler is made, and the loop's one call is a method that returns at once.
When on, the steps before the window run under an idle profiler (a flag test per op); the step before the window is
a warm-up step (Kineto starts collecting), and the recorded steps pay the profiler's cost (docs/doctor.md states
it; ``benchmarks/profile_cost.py`` measures it).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from ..profiling import profiled
from ..rundir import RunDir

log = logging.getLogger(__name__)

class StepProfiler:
    """The loop's profiler (see the module's docstring). ``enabled`` False: every method returns at once."""

    def __init__(self, run_dir: "str | os.PathLike | None", rank: int, world_size: int, device_type: str,
                 steps: Optional[tuple[int, int]], every: int, start_step: int = 0):
        self.rank, self.world_size = rank, world_size
        self.steps, self.every = steps, every
        self.first = start_step + 1                 # the trainer step of ProfilerStep#0
        self.dir = RunDir(run_dir).traces if run_dir else None
        self.written: list[Path] = []
        self._recording: list[int] = []
        self._prof: Any = None
        self.enabled = self.dir is not None and (steps is not None or bool(every))
        if steps is not None and steps[1] < self.first:
            self.enabled = False                    # resumed past the window
        if not self.enabled:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device_type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # every thread, not only those that inherit the profiler's thread-local state (c10d's workers do): the gradient
        # compressor's worker thread (its labelled work, its collectives) is a Python thread started on its own
        try:
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # a torch without the option: the threads that inherit the state only
            config = None
        self._prof = profile(activities=activities, schedule=self._action, on_trace_ready=self._ready,
                             record_shapes=False, acc_events=False, experimental_config=config)
        self._prof.start()

    def _action(self, k: int):
        """The profiler's action for its step ``k`` (trainer step ``first + k``)."""
        from torch.profiler import ProfilerAction

        step = self.first + k
        if profiled(step, self.steps, self.every):
            return ProfilerAction.RECORD_AND_SAVE if not profiled(step + 1, self.steps, self.every) \
                else ProfilerAction.RECORD
        if profiled(step + 1, self.steps, self.every):
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def step_done(self, step: int) -> None:
        """Trainer step ``step`` ended (the loop's one call)."""
        if self._prof is None:
            return
        if profiled(step, self.steps, self.every):
            self._recording.append(step)
        self._prof.step()
        if self.steps is not None and step >= self.steps[1]:
            self.close()                           # past the window: no profiler for the rest of the run

    def _ready(self, prof: Any) -> None:
        """Write the window just recorded (``on_trace_ready``); a trace never ends a run."""
        steps, self._recording = self._recording, []
        if not steps or self.dir is None:
            return
        path = self.dir / f"rank{self.rank}.step{steps[0]}-{steps[-1]}.json"
        try:
            prof.export_chrome_trace(str(path))
            data = json.loads(path.read_text())
            data["syncwise"] = {"rank": self.rank, "world_size": self.world_size, "steps": steps,
                                "first_step": self.first, "collectives": _collectives(data)}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
            self.written.append(path)
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("profiler trace %s not written: %s", path, e)

    def close(self) -> None:
        """Stop the profiler (a window cut short by the run's end is written as far as it got)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()


def _collectives(data: dict) -> Optional[list[dict]]:
    """The flight recorder's entries created while ``data`` (an exported trace) recorded, or None where the trace
    has no wall-clock base or torch no recorder. Kineto's ``ts`` is microseconds after ``baseTimeNanoseconds`` on
    the wall clock, the recorder's ``time_created_ns`` the same clock (checked on torch 2.13: each entry's creation
    lies inside its ``c10d::`` operator's span)."""
    from ..comm.arrivals import window

    base = data.get("baseTimeNanoseconds")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in data.get("traceEvents", [])
             if e.get("ph") == "X" and "ts" in e]
    if not isinstance(base, int) or not spans:
        return None
    return window(base + int(min(a for a, _ in spans) * 1e3), base + int(max(b for _, b in spans) * 1e3) + 1)

