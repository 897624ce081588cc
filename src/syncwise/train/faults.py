"""Fault injection for tests and demos: kill a rank at a step, or poison a step's loss with NaN.

Specs: ``kill:rank=R,step=S`` (rank R exits abruptly as step S begins — the elastic agent then restarts
the group, which resumes from the newest checkpoint) and ``nan:step=S[,rank=R]`` (the loss of step S is
NaN, so its gradients are too and the trainer must skip exactly that step). A kill fires once per run:
a marker file in the run directory stops it from firing again after the restart that it causes.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..specs import check_keys, parse_spec, read_int

_ACCEPTED = "kill:rank=R,step=S or nan:step=S[,rank=R] with integers R ≥ 0, S ≥ 1"
KILLED_EXIT_CODE = 71  # distinctive, so logs show an injected kill rather than a real crash


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    step: int
    rank: Optional[int] = None

    @staticmethod
    def parse(spec: str) -> "Fault":
        """A ``kill:...`` / ``nan:...`` spec (``syncwise.specs`` syntax); anything else raises ConfigError."""
        kind, options = parse_spec(spec, "inject_fault", _ACCEPTED)
        check_keys(options, ("step", "rank"), "inject_fault", spec, _ACCEPTED)
        values = {k: read_int(v, "inject_fault", spec, k, accepted=_ACCEPTED) for k, v in options.items()}
        if kind not in ("kill", "nan") or "step" not in values \
                or values["step"] < 1 or values.get("rank", 0) < 0 or (kind == "kill" and "rank" not in values):
            raise ConfigError("inject_fault", spec, _ACCEPTED)
        return Fault(kind, values["step"], values.get("rank"))

    @property
    def marker(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}.fired"


class FaultPlan:
    """The faults of one run, consulted by the trainer at the start of every step."""

    def __init__(self, specs: "list[Fault | str]", run_dir: Optional[str] = None):
        self.faults = [s if isinstance(s, Fault) else Fault.parse(s) for s in specs]
        self.marker_dir = Path(run_dir) / "faults" if run_dir else None
        self._fired: set[Fault] = set()

    def poison_loss(self, step: int, rank: int) -> bool:
        """True if the loss of ``step`` must be NaN on this rank."""
        return any(f.kind == "nan" and f.step == step and f.rank in (None, rank) for f in self.faults)

    def maybe_kill(self, step: int, rank: int) -> None:
        """Exit this process abruptly if a kill is due here and has not fired in this run before."""
        for f in self.faults:
            if f.kind != "kill" or f.step != step or f.rank != rank or self._has_fired(f):
                continue
            self._record(f)
            print(f"syncwise: injected fault: killing rank {rank} at step {step}", file=sys.stderr, flush=True)
            os._exit(KILLED_EXIT_CODE)

    def _has_fired(self, f: Fault) -> bool:
        if self.marker_dir is not None:
            return (self.marker_dir / f.marker).exists()
        return f in self._fired

    def _record(self, f: Fault) -> None:
        self._fired.add(f)
        if self.marker_dir is not None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            (self.marker_dir / f.marker).touch()
