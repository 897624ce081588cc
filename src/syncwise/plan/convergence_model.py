"""The convergence model (issue 41): steps to fp32 DDP's loss, relative to fp32 DDP's own steps, as a function of
the run's horizon (fp32 DDP's ``--steps``), per strategy — fitted from the committed time-to-loss results instead of
one table measured at one horizon.

Model, per strategy *s* of family *f* (every-step casts, every-step lossy compressors, local-step methods)::

    log(steps_s / steps_fp32)  =  a_s  +  b_f · log(H / H_ref)        (+ 0 · log(R / R_ref): see below)

``a_s`` is the strategy's log steps ratio at the reference horizon ``H_ref``; ``b_f`` is its family's horizon slope
(shared within a family: few strategies were measured at more than one horizon). A run in which the strategy never
reached the target within its cap is **censored**, not infinite: it says ``log ratio > log(cap / steps_fp32)``, and it
enters the least-squares fit as a one-sided (hinge) residual — it pulls the fit only where the fit would put the
strategy under its cap. A strategy with no uncensored point has no point prediction, only a lower bound.

Replicas: every committed run that carries steps to the target for data-parallel strategies had 2 replicas, so the
replica term cannot be fitted; the model assumes none and says so (a prediction at other replica counts is an
extrapolation: its band is widened by :data:`REPLICA_WIDEN` in log space, a stated rule, not a measurement).

The band: ``exp(± Z · sigma)`` around the point, ``sigma`` the root mean square of the leave-one-point-out errors (in
log space) of the strategy's family (else of all strategies), Z = 1.645 (90 % were the errors log-normal); beyond the
fitted horizon range ``sigma`` grows with the distance in log horizon relative to the fitted span.

The fit lives in ``benchmarks/convergence_fit.py`` (data extraction, fit, held-out check), which writes the
parameters file ``convergence-model.json`` next to this module; :func:`load_model` reads it. Pure Python, no torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..errors import SyncwiseError
from ..specs import spec_name

MODEL_PATH = Path(__file__).with_name("convergence-model.json")
#: two-sided 90 % of a normal: the band is exp(± Z sigma) of the point
Z = 1.645
#: the log-space band is multiplied by this at replica counts the model was not fitted on (no data: a stated rule)
REPLICA_WIDEN = 2.0
#: beyond the fitted horizons the log-space band grows with the distance in log horizon over the fitted span, up
#: to this factor (a stated rule: no run measured how fast it should grow)
MAX_WIDEN = 3.0

FAMILIES = {
    "cast": ("none", "fp16", "bf16", "fp8", "int8", "torch-fp16", "torch-bf16", "torch-allreduce"),
    "compressor": ("powersgd", "torch-powersgd", "topk", "demo"),
    "local-step": ("localsgd", "diloco", "sparseloco", "streaming", "torch-localsgd", "torchft-diloco"),
}


def family(spec: str) -> str:
    """The family of a spec (its horizon slope is shared): 'cast', 'compressor', 'local-step', else its own name."""
    name = spec_name(spec)
    for fam, names in FAMILIES.items():
        if name in names:
            return fam
    return name or spec


# ------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True)
class Point:
    """One strategy in one time-to-loss run: fp32 DDP's horizon (``--steps``) and its steps to its own target, the
    strategy's steps to that target (None: not within ``cap_steps``)."""

    spec: str
    preset: str
    horizon: int
    replicas: int
    fp32_steps: float
    steps: Optional[float]
    cap_steps: float
    source: str
    smoke: bool = False

    @property
    def reached(self) -> bool:
        return self.steps is not None

    @property
    def ratio(self) -> Optional[float]:
        return self.steps / self.fp32_steps if self.steps is not None else None

    @property
    def cap_ratio(self) -> float:
        return self.cap_steps / self.fp32_steps

    def key(self) -> tuple:
        return (self.spec, self.preset, self.horizon, self.replicas)


def dedupe(points: Iterable[Point]) -> list[Point]:
    """One point per (spec, preset, horizon, replicas): repeated runs of the same setting (the lab's reruns of a
    deterministic run give the same steps) are averaged over the rounds that reached; censored only if none did."""
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault(p.key(), []).append(p)
    out = []
    for ps in groups.values():
        reached = [p for p in ps if p.reached]
        first = ps[0]
        if reached:
            ratio = sum(p.ratio for p in reached) / len(reached)
            fp32 = sum(p.fp32_steps for p in reached) / len(reached)
            out.append(Point(first.spec, first.preset, first.horizon, first.replicas, fp32, ratio * fp32,
                             max(p.cap_steps for p in ps), ", ".join(sorted({p.source for p in ps})), first.smoke))
        else:
            out.append(Point(first.spec, first.preset, first.horizon, first.replicas, first.fp32_steps, None,
                             max(p.cap_steps for p in ps), ", ".join(sorted({p.source for p in ps})), first.smoke))
    return sorted(out, key=lambda p: (p.preset, p.horizon, p.replicas, p.spec))


def replicas_of(where: str) -> Optional[int]:
    """Data-parallel replicas from a results file's ``where`` ('2 local workers over loopback', 'lab: 2 nodes × 2
    workers ...'); None when it does not say."""
    import re

    grid = re.search(r"(\d+)\s*(?:lab\s+)?nodes?\s*[×x]\s*(\d+)", where)
    if grid:
        return int(grid.group(1)) * int(grid.group(2))
    one = re.search(r"(\d+)\s*(?:local\s+)?workers?", where)
    return int(one.group(1)) if one else None


def _option(command: str, flag: str) -> Any:
    """The value after ``flag`` in a results file's command line (an int where it is one), or None."""
    parts = command.split()
    if flag in parts and parts.index(flag) + 1 < len(parts):
        value = parts[parts.index(flag) + 1]
        return int(value) if value.isdigit() else value
    return None


def points_from_results(data: Any, source: str) -> tuple[list[Point], str]:
    """The points of one benchmarks/time_to_loss.py results file (``rows`` with fp32 DDP first and
    ``rounds[].steps_to_target``; horizon = fp32 DDP's ``--steps``, cap = ``--cap`` or twice it, replicas from
    ``where``), or ([], why it carries none). Rounds are paired: a strategy's round against fp32 DDP's same round."""
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return [], "no per-strategy rows"
    if not any(isinstance(r, dict) and "rounds" in r for r in rows):
        return [], "rows without rounds of steps to the target (final loss at one horizon only)"
    if rows[0].get("name") != "none":
        return [], f"reference is {rows[0].get('name')!r}, not fp32 DDP (FSDP compression: another baseline)"
    command = data.get("command", "")
    steps, preset = _option(command, "--steps"), _option(command, "--preset") or "small"
    cap = _option(command, "--cap") or (2 * steps if isinstance(steps, int) else None)
    replicas = replicas_of(data.get("where", ""))
    if not (isinstance(steps, int) and isinstance(cap, int) and replicas):
        return [], "horizon, cap or replicas not stated"
    base = [r.get("steps_to_target") for r in rows[0]["rounds"]]
    out = []
    for row in rows:
        for rnd, b in zip(row["rounds"], base):
            if not isinstance(b, (int, float)):
                continue
            got = rnd.get("steps_to_target")
            out.append(Point(row["name"], str(preset), steps, replicas, float(b),
                             float(got) if isinstance(got, (int, float)) else None, float(cap), source,
                             bool(data.get("smoke"))))
    return out, ""


# ------------------------------------------------------------------------------------------------ the fit
def fit_params(points: Sequence[Point], h_ref: float, iterations: int = 400) -> tuple[dict[str, float],
                                                                                       dict[str, float]]:
    """(a per strategy, b per family) by censored least squares on log ratios (see the module's text), alternating
    the closed-form updates. A family without two distinct horizons among its points gets b = 0 (not identified);
    a strategy with only censored points gets the smallest a its bounds allow (a lower bound)."""
    pts = [p for p in points if p.spec != "none"]
    specs = sorted({p.spec for p in pts})
    fams = sorted({family(s) for s in specs})
    x = {id(p): math.log(p.horizon / h_ref) for p in pts}
    y = {id(p): math.log(p.ratio if p.reached else p.cap_ratio) for p in pts}
    identified = {f for f in fams if len({p.horizon for p in pts if family(p.spec) == f}) >= 2}
    a = {s: 0.0 for s in specs}
    b = {f: 0.0 for f in fams}

    def active(p: Point) -> bool:   # a censored point pulls only where the fit is under its bound
        return p.reached or a[p.spec] + b[family(p.spec)] * x[id(p)] < y[id(p)]

    for _ in range(iterations):
        for s in specs:
            mine = [p for p in pts if p.spec == s]
            reached = [p for p in mine if p.reached]
            f = family(s)
            if reached:
                # the mean over reached points, then raised until no active censored bound is violated in mean
                act = [p for p in mine if active(p)]
                a[s] = sum(y[id(p)] - b[f] * x[id(p)] for p in act) / len(act)
            else:
                a[s] = max(y[id(p)] - b[f] * x[id(p)] for p in mine)
        for f in identified:
            act = [p for p in pts if family(p.spec) == f and active(p)]
            sxx = sum(x[id(p)] ** 2 for p in act)
            if sxx > 0:
                b[f] = sum(x[id(p)] * (y[id(p)] - a[p.spec]) for p in act) / sxx
    return a, b


@dataclass(frozen=True)
class Prediction:
    """Steps to fp32 DDP's loss / fp32 DDP's steps at a horizon: ``ratio`` (None: no point prediction, only
    ``at_least``) and its band ``low``..``high``; ``words``: what it rests on."""

    spec: str
    horizon: int
    ratio: Optional[float]
    low: Optional[float]
    high: Optional[float]
    at_least: Optional[float] = None
    measured_never: Optional[int] = None   # a run at >= this horizon never reached the target (its cap below)
    extrapolated: str = ""                 # '' inside the fitted range; else what is outside it
    sigma: float = 0.0                     # the log-space spread the band is exp(± Z sigma) of

    @property
    def expected(self) -> Optional[float]:
        """The mean of the log-normal band: what ranking by expected time to the loss uses."""
        return self.ratio * math.exp(self.sigma ** 2 / 2) if self.ratio is not None else None

    @property
    def reached(self) -> bool:
        return self.ratio is not None and self.measured_never is None


@dataclass
class ConvergenceModel:
    """The fitted parameters (``convergence-model.json``) and the points they were fitted on."""

    a: dict[str, float]
    b: dict[str, float]
    sigma: dict[str, float]          # per family (and '*' pooled): RMS of leave-one-point-out log errors
    h_ref: float
    points: list[Point]
    source: str = ""                 # the parameters file, or the fit's command
    command: str = ""
    holdout: dict[str, Any] = field(default_factory=dict)

    # -- what it stands on
    @property
    def horizons(self) -> list[int]:
        return sorted({p.horizon for p in self.points})

    @property
    def replicas(self) -> list[int]:
        return sorted({p.replicas for p in self.points})

    @property
    def presets(self) -> list[str]:
        return sorted({p.preset for p in self.points})

    def basis(self) -> str:
        """'convergence model: 31 points (tiny preset), horizons 300–1000 steps, 2 replicas, band ±1.645 sigma'."""
        hs, rs = self.horizons, self.replicas
        reached = sum(p.reached for p in self.points)
        return (f"convergence model fitted on {len(self.points)} points ({reached} reached, "
                f"{len(self.points) - reached} censored; {', '.join(self.presets)} preset), horizons "
                f"{hs[0]}–{hs[-1]} steps, {'/'.join(map(str, rs))} replicas, 90 % band from leave-one-out errors")

    def sigma_of(self, spec: str) -> float:
        return self.sigma.get(family(spec), self.sigma.get("*", 0.0))

    def measured(self, spec: str) -> list[Point]:
        return [p for p in self.points if p.spec == spec]

    # -- prediction
    def predict(self, spec: str, horizon: Optional[int] = None, replicas: Optional[int] = None) -> Prediction:
        """The steps ratio of ``spec`` at ``horizon`` steps (default: the reference horizon) and ``replicas``."""
        h = int(horizon or self.h_ref)
        if spec == "none":
            return Prediction(spec, h, 1.0, 1.0, 1.0)
        mine = self.measured(spec)
        if spec not in self.a or not mine:
            return Prediction(spec, h, None, None, None, extrapolated="not in the fitted data")
        f = family(spec)
        log_r = self.a[spec] + self.b.get(f, 0.0) * math.log(h / self.h_ref)
        lo_h, hi_h = min(p.horizon for p in mine), max(p.horizon for p in mine)
        span = max(math.log(hi_h / lo_h), math.log(2.0))
        out = []
        s = self.sigma_of(spec)
        if h > hi_h or h < lo_h:
            edge = hi_h if h > hi_h else lo_h
            s *= min(MAX_WIDEN, 1.0 + abs(math.log(h / edge)) / span)
            out.append(f"horizon {h} outside {lo_h}–{hi_h}" if lo_h != hi_h else f"horizon {h}, measured at {lo_h}")
        if replicas and replicas not in {p.replicas for p in mine}:
            s *= REPLICA_WIDEN
            out.append(f"{replicas} replicas, fitted at {'/'.join(str(r) for r in sorted({p.replicas for p in mine}))}")
        # a measurement at this horizon or longer in which it never reached: the data beat the model
        never = [p for p in mine if not p.reached and p.horizon >= h and (not replicas or p.replicas == replicas)]
        never_h = min((p.horizon for p in never), default=None)
        if not any(p.reached for p in mine):
            return Prediction(spec, h, None, None, None, at_least=math.exp(log_r), measured_never=never_h,
                              extrapolated="; ".join(out))
        r = math.exp(log_r)
        return Prediction(spec, h, r, r * math.exp(-Z * s), r * math.exp(Z * s), measured_never=never_h,
                          extrapolated="; ".join(out), sigma=s)

    # -- the parameters file
    def to_json(self) -> dict[str, Any]:
        return {"about": "steps to fp32 DDP's loss / fp32 DDP's steps: log r = a[strategy] + b[family] * "
                         "log(horizon / h_ref); censored least squares; sigma: RMS of leave-one-point-out log errors "
                         "(syncwise.plan.convergence_model; regenerate: python benchmarks/convergence_fit.py)",
                "command": self.command, "h_ref": self.h_ref, "z": Z, "a": self.a, "b": self.b, "sigma": self.sigma,
                "families": {s: family(s) for s in self.a},
                "points": [p.__dict__ for p in self.points], "holdout": self.holdout}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "") -> "ConvergenceModel":
        return cls({k: float(v) for k, v in data["a"].items()}, {k: float(v) for k, v in data["b"].items()},
                   {k: float(v) for k, v in data["sigma"].items()}, float(data["h_ref"]),
                   [Point(**p) for p in data["points"]], source, data.get("command", ""), data.get("holdout", {}))


def loo_errors(points: Sequence[Point], h_ref: float) -> list[tuple[Point, float, float]]:
    """Leave-one-point-out: each reached point (not fp32 DDP's) predicted by the fit without it, where the rest
    still give its strategy a point prediction: (point, predicted ratio, log error = log(predicted / measured))."""
    out = []
    for p in points:
        if not p.reached or p.spec == "none":
            continue
        rest = [q for q in points if q is not p]
        if not any(q.spec == p.spec and q.reached for q in rest):
            continue
        a, b = fit_params(rest, h_ref)
        pred = math.exp(a[p.spec] + b.get(family(p.spec), 0.0) * math.log(p.horizon / h_ref))
        out.append((p, pred, math.log(pred / p.ratio)))
    return out


#: the log-space sigma when no leave-one-out error sizes it (one horizon per strategy): a stated prior, about ±50 %
#: at 90 % — wider than any family's measured spread (benchmarks/results/convergence-fit.json)
UNSIZED_SIGMA = 0.25


def sigmas(errors: Sequence[tuple[Point, float, float]], floor: float = 0.02) -> dict[str, float]:
    """RMS of the log errors per family with at least 3 of them, and pooled ('*'); never below ``floor``; with no
    error at all, :data:`UNSIZED_SIGMA`."""
    def rms(v: list[float]) -> float:
        return max(floor, math.sqrt(sum(e * e for e in v) / len(v))) if v else UNSIZED_SIGMA

    out = {"*": rms([e for _, _, e in errors])}
    for f in sorted({family(p.spec) for p, _, _ in errors}):
        v = [e for p, _, e in errors if family(p.spec) == f]
        if len(v) >= 3:
            out[f] = rms(v)
    return out


def fit(points: Sequence[Point], h_ref: Optional[float] = None, command: str = "") -> ConvergenceModel:
    """The model fitted on ``points`` (deduplicated) with its leave-one-out band."""
    pts = dedupe(points)
    if not pts:
        raise SyncwiseError("no time-to-loss points to fit the convergence model on")
    if h_ref is None:   # the geometric mean of the horizons: slope and intercept least correlated
        hs = sorted({p.horizon for p in pts})
        h_ref = round(math.exp(sum(math.log(h) for h in hs) / len(hs)))
    a, b = fit_params(pts, h_ref)
    return ConvergenceModel(a, b, sigmas(loo_errors(pts, h_ref)), float(h_ref), pts, command=command)


def load_model(path: "str | Path | None" = None) -> ConvergenceModel:
    p = Path(path) if path is not None else MODEL_PATH
    try:
        return ConvergenceModel.from_json(json.loads(p.read_text()), str(p))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SyncwiseError(f"the convergence model {p} cannot be read ({e}); regenerate it: "
                            "python benchmarks/convergence_fit.py") from None
