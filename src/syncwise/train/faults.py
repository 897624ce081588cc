"""Fault injection for tests, demos and ``syncwise doctor``'s planted causes.

Specs (``syncwise.specs`` syntax, one parser):

* ``kill:rank=R,step=S`` — rank R exits abruptly as step S begins (the elastic agent then restarts the group,
  which resumes from the newest checkpoint). A kill fires once per run: a marker file in the run directory
  stops it from firing again after the restart that it causes.
* ``hang:rank=R,step=S`` — rank R stops as step S begins (it sleeps until it is killed, making no further
  collective): the other ranks hang in the step's first collective until ``dist.timeout_s`` reports it and they
  dump their flight recorders (``syncwise doctor`` then names the collective rank R never entered). Once per run.
* ``nan:step=S[,rank=R]`` — the loss of step S is NaN, so its gradients are too and the trainer must skip
  exactly that step.
* ``slow:rank=R,factor=F[,step=S][,phase=backward]`` — a straggler: from step S (default 1) on, rank R's
  forward/backward is stretched to F × its measured time (before its micro-batches it sleeps (F − 1) × their last
  measured time; with ``phase=backward`` the sleep happens inside the backward instead, as the first gradient
  becomes ready: a compute straggler in the backward, which DDP's all-reduce hides in the other ranks' waits).
* ``slowdata:ms=M[,rank=R][,step=S]`` — a starved data loader: from step S on, the loader of rank R (every rank
  when left out) waits M milliseconds per optimizer step before its batches arrive.
* ``healkill:rank=R[,step=S]`` — live recovery (``ft.replicas``): rank R exits abruptly while it hands its state to
  a healing replica (a failure during the healing transfer), the first time it does so at step S or later (once).
* ``skew:experts=K`` — MoE routing skew: the first K routed experts of every MoE layer get a selection bias of
  +10 at the start of a run, so (with fewer experts than top-k choices) nearly every token picks them.
"""
from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional

from ..errors import ConfigError
from ..specs import check_keys, parse_spec, read_float, read_int

_ACCEPTED = ("kill:rank=R,step=S, hang:rank=R,step=S, nan:step=S[,rank=R], slow:rank=R,factor=F[,step=S][,phase=backward], "
             "slowdata:ms=M[,rank=R][,step=S], healkill:rank=R[,step=S] (with ft.replicas) or skew:experts=K with "
             "integers R ≥ 0, S ≥ 1, K ≥ 1, "
             "a factor F in [1, 100] and M in [0, 600000]")
KILLED_EXIT_CODE = 71  # distinctive, so logs show an injected kill rather than a real crash
SKEW_BIAS = 10.0       # added to the skewed experts' selection bias (biases move by ~1e-3 per step)

# kind -> (option keys, required keys)
_KINDS = {"kill": (("step", "rank"), ("step", "rank")), "hang": (("step", "rank"), ("step", "rank")),
          "nan": (("step", "rank"), ("step",)),
          "slow": (("rank", "factor", "step", "phase"), ("rank", "factor")),
          "slowdata": (("ms", "rank", "step"), ("ms",)), "skew": (("experts",), ("experts",)),
          "healkill": (("rank", "step"), ("rank",))}


@dataclass(frozen=True)
class Fault:
    """One injected fault. ``step`` is the step it fires at (kill, nan) or from which it lasts (slow, slowdata);
    ``value`` the slow-down factor (slow), the milliseconds (slowdata) or the number of experts (skew)."""

    kind: str
    step: int
    rank: Optional[int] = None
    value: float = 0.0
    phase: str = ""          # slow: "backward" sleeps inside the backward, "" before the forward

    @staticmethod
    def parse(spec: str) -> "Fault":
        """A fault spec (``syncwise.specs`` syntax); anything else raises ConfigError."""
        kind, options = parse_spec(spec, "inject_fault", _ACCEPTED)
        if kind not in _KINDS:
            raise ConfigError("inject_fault", spec, _ACCEPTED)
        keys, required = _KINDS[kind]
        check_keys(options, keys, "inject_fault", spec, _ACCEPTED)
        if any(k not in options for k in required):
            raise ConfigError("inject_fault", spec, _ACCEPTED)
        ints = {k: read_int(v, "inject_fault", spec, k, accepted=_ACCEPTED)
                for k, v in options.items() if k in ("step", "rank", "experts")}
        if ints.get("step", 1) < 1 or ints.get("rank", 0) < 0 or ints.get("experts", 1) < 1:
            raise ConfigError("inject_fault", spec, _ACCEPTED)
        value = float(ints.get("experts", 0))
        if kind == "slow":
            value = read_float(options["factor"], "inject_fault", spec, "factor", lo=1, hi=100, accepted=_ACCEPTED)
        elif kind == "slowdata":
            value = read_float(options["ms"], "inject_fault", spec, "ms", lo=0, hi=600_000, accepted=_ACCEPTED)
        phase = options.get("phase", "")
        if phase not in ("", "backward"):
            raise ConfigError("inject_fault", spec, _ACCEPTED)
        return Fault(kind, ints.get("step", 1), ints.get("rank"), value, phase)

    @property
    def marker(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}.fired"


class FaultPlan:
    """The faults of one run, consulted by the trainer at the start of every step."""

    def __init__(self, specs: "list[Fault | str]", run_dir: Optional[str] = None):
        self.faults = [s if isinstance(s, Fault) else Fault.parse(s) for s in specs]
        self.marker_dir = Path(run_dir) / "faults" if run_dir else None
        self._fired: set[Fault] = set()
        self._micro_s = 0.0  # the last forward/backward time (slow)
        self._backward_sleep = 0.0  # slow with phase=backward: what the backward hook sleeps this step
        self._slept = 0.0           # ... and what it slept (left out of the measured time)

    def has(self, *kinds: str) -> bool:
        """Whether the plan holds a fault of any of ``kinds`` (on any rank, at any step)."""
        return any(f.kind in kinds for f in self.faults)

    def poison_loss(self, step: int, rank: int) -> bool:
        """True if the loss of ``step`` must be NaN on this rank."""
        return any(f.kind == "nan" and f.step == step and f.rank in (None, rank) for f in self.faults)

    def maybe_kill(self, step: int, rank: int) -> None:
        """Exit this process abruptly if a kill is due here, or stop it for good if a hang is (each once per run)."""
        for f in self.faults:
            if f.kind not in ("kill", "hang") or f.step != step or f.rank != rank or self._has_fired(f):
                continue
            self._record(f)
            if f.kind == "hang":
                print(f"syncwise: injected fault: rank {rank} stops at step {step} (a hang)", file=sys.stderr,
                      flush=True)
                while True:  # until the launcher kills it: the other ranks' timeout reports the hang
                    time.sleep(3600)
            print(f"syncwise: injected fault: killing rank {rank} at step {step}", file=sys.stderr, flush=True)
            os._exit(KILLED_EXIT_CODE)

    def maybe_kill_healing(self, step: int, rank: int) -> None:
        """``healkill``: exit abruptly while this rank hands its state to a healing replica (once per run)."""
        for f in self.faults:
            if f.kind != "healkill" or step < f.step or f.rank != rank or self._has_fired(f):
                continue
            self._record(f)
            print(f"syncwise: injected fault: killing rank {rank} during a healing transfer at step {step}",
                  file=sys.stderr, flush=True)
            os._exit(KILLED_EXIT_CODE)

    def delay_data(self, step: int, rank: int) -> None:
        """``slowdata``: wait as a starved loader would (called where the step waits for its batches)."""
        ms = sum(f.value for f in self.faults if f.kind == "slowdata" and step >= f.step and f.rank in (None, rank))
        if ms > 0:
            time.sleep(ms / 1000)

    def straggling(self, step: int, rank: int) -> ContextManager[None]:
        """``slow``: around the step's forward/backward. Before it, sleep (factor − 1) × the last measured
        forward/backward time (the sleep comes before the gradient sync, so the other ranks wait for it there, as
        for a slow GPU); after it, keep its time for the next stretch. A no-op context without a ``slow`` fault."""
        if not any(f.kind == "slow" for f in self.faults):
            return nullcontext()
        return self._stretch(step, rank)

    @contextmanager
    def _stretch(self, step: int, rank: int) -> Iterator[None]:
        for f in self.faults:
            if f.kind == "slow" and step >= f.step and f.rank == rank and f.value > 1:
                if f.phase == "backward":
                    self._backward_sleep += (f.value - 1) * self._micro_s
                else:
                    time.sleep((f.value - 1) * self._micro_s)
        start, self._slept = time.perf_counter(), 0.0
        yield
        self._backward_sleep = 0.0
        self._micro_s = time.perf_counter() - start - self._slept  # the work alone, not the injected sleep

    def attach(self, model: Any) -> None:
        """``slow`` with ``phase=backward``: a hook on the parameter whose gradient the backward makes first (the
        last one registered) sleeps the step's stretch there — inside the backward, before any bucket is ready."""
        if not any(f.kind == "slow" and f.phase == "backward" for f in self.faults):
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return

        def stall(_p: Any) -> None:
            if self._backward_sleep > 0:
                time.sleep(self._backward_sleep)
                self._slept += self._backward_sleep
                self._backward_sleep = 0.0

        params[-1].register_post_accumulate_grad_hook(stall)

    def poison_stage(self, model: Any) -> None:
        """``nan`` on a pipeline stage without the loss (a NaN weight reaches only the last stage's loss): make one
        gradient of this stage NaN, before the stage's replicas sync, so the whole step is skipped everywhere."""
        next(p for p in model.parameters() if p.grad is not None).grad.mul_(math.nan)

    def skew_router(self, model: Any) -> None:
        """``skew``: raise the selection bias of the first K routed experts of every MoE layer (once, at the start
        of a run; the bias is part of the model, so a resumed run keeps it)."""
        k = int(max((f.value for f in self.faults if f.kind == "skew"), default=0))
        if not k:
            return
        import torch

        with torch.no_grad():
            for module in model.modules():
                bias = getattr(module, "expert_bias", None)
                if isinstance(bias, torch.Tensor):
                    bias[:k] += SKEW_BIAS

    def _has_fired(self, f: Fault) -> bool:
        if self.marker_dir is not None:
            return (self.marker_dir / f.marker).exists()
        return f in self._fired

    def _record(self, f: Fault) -> None:
        self._fired.add(f)
        if self.marker_dir is not None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            (self.marker_dir / f.marker).touch()
