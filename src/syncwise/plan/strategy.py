"""``--compress auto`` / ``--sync auto`` and ``syncwise plan --strategy``: the communication strategy predicted to
reach fp32 DDP's loss soonest on this cluster (issue 28, item 5).

Time to fp32 DDP's target loss, relative to fp32 DDP, is predicted as

    (predicted step time of the strategy / predicted step time of fp32 DDP)   — the planner's cost model
                                                                                (``syncwise.plan.cost.predict``)
  × (steps the strategy needed to reach fp32 DDP's target / steps fp32 DDP needed)
                                                                              — MEASURED by
                                                                                benchmarks/time_to_loss.py

The second factor is the *convergence cost* of each strategy: data, not a guess. By default it is the convergence
model (``syncwise.plan.convergence_model``, parameters in ``convergence-model.json`` next to this module), fitted by
``python benchmarks/convergence_fit.py`` on every committed time-to-loss result: the steps ratio as a function of the
horizon (the job's steps), with a band from its leave-one-out errors; ranking uses the expected time over that band.
A strategy measured never to reach the target within its cap at the job's horizon or a longer one is listed but not
chosen; one that "never" reached within a *shorter* horizon is a candidate when the model predicts it reaches at the
job's. The single measured table (``convergence.json``; ``python -m syncwise.plan.strategy RESULTS.json`` or
``syncwise plan --convergence-from RESULTS.json`` regenerates it) is still read when passed explicitly, and by doctor.

Assumption, stated in the start-up line: the steps ratios fitted on the benchmark's model (``tiny``), batch and
2 replicas carry over to the job (at other replica counts the band is widened, a stated rule). The choice is
resolved here, once, before any worker starts (``resolve_auto``); the layout owner (``syncwise.layout``) parses
``auto`` and refuses conflicting options.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError, SyncwiseError
from .. import layout as owner
from ..layout import METHODS, SyncSpec, parse_compress, parse_sync
from ..specs import spec_name
from .cloud import CloudConfig
from .convergence_model import MODEL_PATH, ConvergenceModel, _option, load_model as load_convergence_model, replicas_of
from .cost import CODEC_COST, COMPUTE_TERMS, PIPELINE_IDLE_TERMS, predict
from .layout import SYNCWISE, Layout, Training
from .model import ModelSpec
from .search import human_time

TABLE_PATH = Path(__file__).with_name("convergence.json")
#: the step parts no communication strategy changes: the compute floor a step cannot beat
FLOOR_TERMS = COMPUTE_TERMS + PIPELINE_IDLE_TERMS
#: peers that run outside syncwise (their rows are measured, but syncwise cannot run them as a strategy)
NOT_RUNNABLE = ("torchft-diloco",)


# ------------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class ConvergenceCost:
    """One strategy's measured convergence cost: ``steps_ratio`` = its steps to fp32 DDP's target / fp32 DDP's
    (mean over the rounds that reached it; None: never reached within ``cap_ratio`` × fp32 DDP's steps)."""

    spec: str
    steps_ratio: Optional[float]
    cap_ratio: float
    reached_in: int
    repeats: int

    @property
    def reached(self) -> bool:
        return self.steps_ratio is not None

    def parsed(self) -> tuple[owner.Compress, Optional[SyncSpec]]:
        """(compressor, sync strategy) of the spec as ``syncwise bench`` runs it: a ``--sync`` method runs
        uncompressed, anything else is a compressor every step."""
        if spec_name(self.spec) in METHODS:
            return owner.NO_COMPRESS, parse_sync(self.spec)
        return parse_compress(self.spec), None


@dataclass(frozen=True)
class ConvergenceTable:
    costs: dict[str, ConvergenceCost]
    source: str          # the time-to-loss results file
    command: str         # the command that produced it
    preset: str
    where: str
    fp32_steps: float    # fp32 DDP's steps to its own target
    smoke: bool = False
    replicas: Optional[int] = None   # data-parallel replicas of the runs it was measured on

    @property
    def reference(self) -> str:
        return f"{Path(self.source).name}, {self.preset} preset"

    @property
    def horizon(self) -> Optional[int]:
        """fp32 DDP's run length (``--steps``) the ratios were measured at."""
        steps = _option(self.command, "--steps")
        return steps if isinstance(steps, int) else None

    def basis(self) -> str:
        """What the table's step ratios were measured on, in words: model, horizon, replicas."""
        horizon = f"{self.horizon}-step horizon" if self.horizon else "horizon unknown"
        reps = f"{self.replicas} replicas" if self.replicas else "replicas unknown"
        return (f"{self.reference}, {horizon} (fp32 DDP reached its loss at step {self.fp32_steps:.0f}), {reps}"
                + (" SMOKE" if self.smoke else ""))


def table_from_results(results: dict[str, Any], source: str) -> dict[str, Any]:
    """The convergence table (``convergence.json``'s content) from a benchmarks/time_to_loss.py results file."""
    rows = results.get("rows")
    if not isinstance(rows, list) or not rows or rows[0].get("name") != "none":
        raise ConfigError("results", source, "a benchmarks/time_to_loss.py results file (rows, fp32 DDP first)")
    ratios_fp32 = []
    for rnd in rows[0]["rounds"]:
        ratios_fp32.append(rnd.get("steps_to_target"))
    if not all(isinstance(v, (int, float)) and v > 0 for v in ratios_fp32):
        raise ConfigError("results", source, "a results file in which fp32 DDP reached its own target every round")
    fp32_steps = sum(ratios_fp32) / len(ratios_fp32)
    command = results.get("command", "")
    steps = _option(command, "--steps")
    cap = _option(command, "--cap") or (2 * steps if isinstance(steps, int) else None)   # time_to_loss's default
    costs = {}
    for row in rows:
        # ratios formed within each round (paired), then averaged over the rounds that reached the target
        per = [r["steps_to_target"] / b for r, b in zip(row["rounds"], ratios_fp32)
               if isinstance(r.get("steps_to_target"), (int, float))]
        cap_steps = cap if isinstance(cap, int) else 0
        costs[row["name"]] = {"steps_ratio": sum(per) / len(per) if per else None,
                              "cap_ratio": cap_steps / fp32_steps if cap_steps else None,
                              "reached_in": row.get("reached_in", len(per)), "repeats": row.get("repeats", 1),
                              "final_gap": row.get("final_gap")}
    return {"about": "steps to fp32 DDP's target validation loss, relative to fp32 DDP's own steps, per strategy "
                     "(syncwise.plan.strategy; regenerate: python -m syncwise.plan.strategy RESULTS.json)",
            "source": source, "command": command, "where": results.get("where", ""), "smoke": bool(results.get("smoke")),
            "preset": _option(command, "--preset") or "small", "target_val_loss": results.get("target_val_loss"),
            "replicas": replicas_of(results.get("where", "")),
            "fp32_steps_to_target": fp32_steps, "costs": costs}


def load_table(path: "str | Path | None" = None) -> ConvergenceTable:
    """The convergence table (default: ``convergence.json`` next to this module)."""
    p = Path(path) if path is not None else TABLE_PATH
    try:
        data = json.loads(p.read_text())
        costs = {name: ConvergenceCost(name, c["steps_ratio"], c.get("cap_ratio") or 0.0, c["reached_in"],
                                       c["repeats"]) for name, c in data["costs"].items()}
        return ConvergenceTable(costs, data["source"], data["command"], data["preset"], data.get("where", ""),
                                data["fp32_steps_to_target"], bool(data.get("smoke")),
                                data.get("replicas") or replicas_of(data.get("where", "")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SyncwiseError(f"the convergence table {p} cannot be read ({e}); regenerate it: "
                            "python -m syncwise.plan.strategy RESULTS.json") from None


# ------------------------------------------------------------------------------------------------ the basis
#: how far a predicted step time is off on a calibrated cluster: the calibrated lab's data-parallel jobs were within
#: -6.0 % .. +6.9 %, 9.9 % mean absolute error over the rows other than FSDP2 on gloo (benchmarks/RESULTS.md §12);
#: a ratio of two step times compounds it: the band is (1 - e) / (1 + e) .. (1 + e) / (1 - e) of the figure
CALIBRATED_ERROR = 0.10
#: on the catalog (no ``--calibrate``), a figure below which the measured ratio fell at held-out lab points: the
#: catalog predicted 9.99× and 6.49× where 1.98× and 1.49× came (2 nodes × 2 workers at 45 and 100 Mbit/s, before
#: shared cores were priced): factors of 5.0 and 4.4. The band reaches down to figure / CATALOG_SPREAD
CATALOG_SPREAD = 5.0
#: the least error a probed step ratio is given (auto's start-up probe, :func:`probed`): a few steps measured on the
#: job's own cluster stand for the whole run's (a link's token bucket, caches and warm-up differ over a short
#: window), so the band is never narrower than the calibrated planner's error; wider where the probe's own steps
#: spread more (1.645 standard errors of the ratio: a 90 % band)
PROBE_ERROR = 0.10


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity; else ``os.cpu_count()``)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Basis:
    """What a prediction stands on: a calibrated cluster (``syncwise plan --calibrate``: the speeds workers get
    together) or the catalog's figures, and — on a catalog CPU job — how many workers compute on one host's cores at
    once (the lab's nodes all share this machine). Workers beyond the cores share them: each computes at
    cores / workers of the catalog's one-worker speed, so the step's compute floor rises and caps what any
    strategy can gain (:func:`job_cloud` prices it)."""

    calibrated: bool
    workers_per_host: int = 0   # workers computing on one host at once (0: not known)
    cores: int = 0              # that host's cores (0: not known)
    probe: str = ""             # auto's start-up probe: what it measured, in words ('' = not probed)

    @property
    def share(self) -> float:
        """Workers per core (1: a core each, or not known)."""
        if not (self.cores and self.workers_per_host):
            return 1.0
        return max(1.0, self.workers_per_host / self.cores)

    def band(self, r: "Ranked") -> tuple[float, float]:
        """The range the measured '× sooner' of ``r`` is expected in: the calibrated planner's error each way, or on
        the catalog down to figure / CATALOG_SPREAD; never above the compute-floor ceiling (:func:`ceiling`)."""
        sooner = r.sooner or 0.0
        if r.spec == "none":   # fp32 DDP against itself: exactly 1
            return 1.0, 1.0
        e = r.step_error or CALIBRATED_ERROR
        low = sooner * (1 - e) / (1 + e) if self.calibrated or r.step_error else sooner / CATALOG_SPREAD
        high = sooner * (1 + e) / (1 - e)
        top = ceiling(r)
        if r.steps_ratio and r.steps_low and r.steps_high:   # the convergence model's band on the steps, too
            low *= r.steps_ratio / r.steps_high
            high *= r.steps_ratio / r.steps_low
            top = top * r.steps_ratio / r.steps_low if top else top
        return low, min(high, top) if top else high

    def words(self) -> str:
        """The basis in words, for the start-up line."""
        if self.probe:
            return self.probe
        what = ("calibrated cluster (step times within ±10 %)" if self.calibrated else
                "catalog figure, not calibrated (`syncwise plan --calibrate` narrows the band)")
        if self.share > 1:
            what += (f"; {self.workers_per_host} workers share {self.cores} cores: compute priced at "
                     f"1/{self.share:.3g} speed")
        return what


def basis_of(cloud: CloudConfig) -> Basis:
    """The basis of a cluster as given (a calibrated TOML is named 'calibrated-NxP' by ``syncwise plan --calibrate``;
    anything else is the catalog's), without host cores: a GPU cluster's workers do not share them."""
    return Basis(calibrated=cloud.name.startswith("calibrated-"))


def ceiling(r: "Ranked") -> Optional[float]:
    """The most '× sooner' ``r`` could be at its predicted fp32 DDP step: fp32 DDP's time over ``r``'s compute
    floor times its steps (communication free); None when not known."""
    if not (r.time_ratio and r.floor_s and r.steps_ratio):
        return None
    t_none = r.step_time_s * r.steps_ratio / r.time_ratio
    return t_none / (r.floor_s * r.steps_ratio)


# ------------------------------------------------------------------------------------------------ ranking
@dataclass(frozen=True)
class Ranked:
    """One candidate: its spec, predicted step time, measured steps ratio and predicted time to fp32 DDP's target
    relative to fp32 DDP (``time_ratio`` < 1: sooner); ``sooner`` = 1 / time_ratio."""

    spec: str
    compress: owner.Compress
    sync: Optional[SyncSpec]
    step_time_s: float
    steps_ratio: Optional[float]
    time_ratio: Optional[float]
    cap_ratio: float = 0.0
    why_not: str = ""      # why it is not a candidate (never reached the target / cannot run on this layout)
    floor_s: float = 0.0   # the step's compute floor (no communication): what no strategy can beat
    steps_low: Optional[float] = None    # the convergence model's band of the steps ratio (None: a measured table)
    steps_high: Optional[float] = None
    steps_sigma: float = 0.0             # its log-space spread: ranking uses the expected ratio, exp(sigma^2/2) up
    steps_note: str = ""                 # what the steps prediction extrapolates ('' inside the fitted data)
    step_error: float = 0.0              # a probed step ratio's relative error (0: the step time is predicted)

    @property
    def expected_time_ratio(self) -> Optional[float]:
        """The time ratio at the steps band's mean (log-normal): what candidates are ranked by."""
        import math

        return self.time_ratio * math.exp(self.steps_sigma ** 2 / 2) if self.time_ratio else None

    @property
    def sooner(self) -> Optional[float]:
        return 1.0 / self.time_ratio if self.time_ratio else None


def _allowed(lay: owner.Layout, c: owner.Compress, s: Optional[SyncSpec], world: Optional[int]) -> str:
    """'' when the candidate (c, s) is in auto's space for ``lay`` and the layout owner accepts it; else why not."""
    choose_c, choose_s = lay.auto_choices() if lay.auto else (True, True)
    if not c.is_none and not choose_c:
        return "a compressor (compress.method is not auto)"
    if s is not None and not choose_s:
        return "a sync strategy (parallel.sync is not auto)"
    try:
        dataclasses.replace(lay, compress=c, sync=s).check(world)
    except ConfigError as e:
        return f"not on this layout ({e.accepted})"
    return ""


def rank(cloud: CloudConfig, model: ModelSpec, lay: owner.Layout, global_batch: int, seq_len: Optional[int] = None,
         table: "Optional[ConvergenceTable | ConvergenceModel]" = None, training: Training = SYNCWISE,
         micro_batch: int = 0, microbatches: int = 0, horizon: Optional[int] = None,
         replicas: Optional[int] = None) -> list[Ranked]:
    """Every strategy of the convergence table that syncwise can run (PyTorch's hooks included, torchft's DiLoCo not),
    best first: candidates (in auto's space for ``lay``, reached the target) by predicted time to fp32 DDP's target,
    then the others with ``why_not``. fp32 DDP (``none``) is always first among equals at ratio 1."""
    table = table or load_convergence()
    if isinstance(table, ConvergenceModel):
        return _rank_model(cloud, model, lay, global_batch, seq_len, table, training, micro_batch, microbatches,
                           horizon, replicas)
    if "none" not in table.costs:
        raise SyncwiseError(f"the convergence table ({table.source}) has no fp32 DDP ('none') row")
    world = cloud.world_size
    base = dataclasses.replace(lay, compress=owner.NO_COMPRESS, sync=None)

    def step(c: owner.Compress, s: Optional[SyncSpec]) -> tuple[float, float]:
        planned = Layout.of_owner(dataclasses.replace(base, compress=c, sync=s).resolve(world),
                                  micro_batch=micro_batch, microbatches=microbatches)
        pred = predict(cloud, model, planned, global_batch, seq_len, training=training, syncwise_rules=False)
        return pred.step_time_s, sum(pred.breakdown.get(k, 0.0) for k in FLOOR_TERMS)

    t_none = step(owner.NO_COMPRESS, None)[0]
    out: list[Ranked] = []
    for name, cost in table.costs.items():
        if spec_name(name) in NOT_RUNNABLE:
            continue
        try:
            c, s = cost.parsed()
        except ConfigError:
            continue  # a spec this syncwise no longer parses (an old table): not a candidate
        if c.name not in CODEC_COST:
            continue
        why = _allowed(lay, c, s, world)
        if not cost.reached and not why:
            why = f"never reached fp32 DDP's loss within {cost.cap_ratio:.1f}× its steps"
        t, floor = step(c, s)
        ratio = (t * cost.steps_ratio / t_none) if cost.reached else None
        out.append(Ranked(name, c, s, t, cost.steps_ratio, ratio, cost.cap_ratio, why, floor))
    # ties broken by a stated rule (issue 43 row 9): the exact predicted time to the loss, then the shorter step,
    # then the name; `render` marks rows that tie at the precision it shows
    out.sort(key=lambda r: (bool(r.why_not), r.time_ratio if r.time_ratio is not None else float("inf"),
                            r.step_time_s, r.spec))
    return out


def _stepper(cloud: CloudConfig, model: ModelSpec, lay: owner.Layout, global_batch: int, seq_len: Optional[int],
             training: Training, micro_batch: int, microbatches: int):
    base = dataclasses.replace(lay, compress=owner.NO_COMPRESS, sync=None)

    def step(c: owner.Compress, s: Optional[SyncSpec]) -> tuple[float, float]:
        planned = Layout.of_owner(dataclasses.replace(base, compress=c, sync=s).resolve(cloud.world_size),
                                  micro_batch=micro_batch, microbatches=microbatches)
        pred = predict(cloud, model, planned, global_batch, seq_len, training=training, syncwise_rules=False)
        return pred.step_time_s, sum(pred.breakdown.get(k, 0.0) for k in FLOOR_TERMS)
    return step


def _rank_model(cloud: CloudConfig, model: ModelSpec, lay: owner.Layout, global_batch: int, seq_len: Optional[int],
                conv: ConvergenceModel, training: Training, micro_batch: int, microbatches: int,
                horizon: Optional[int], replicas: Optional[int]) -> list[Ranked]:
    """:func:`rank` with the convergence model: each strategy's steps ratio predicted at ``horizon`` (fp32 DDP's
    steps; default the model's reference) and ``replicas``, with its band. Not a candidate: a strategy measured never
    to reach the loss within its cap at this horizon or a longer one (the data beat the model), or one that never
    reached it in any fitted run (the model then has only a lower bound). A strategy that 'never' reached within a
    *shorter* horizon is a candidate when the model predicts it reaches at this one."""
    step = _stepper(cloud, model, lay, global_batch, seq_len, training, micro_batch, microbatches)
    t_none = step(owner.NO_COMPRESS, None)[0]
    h = int(horizon or conv.h_ref)
    out: list[Ranked] = []
    for name in sorted(set(conv.a) | {"none"}):
        if spec_name(name) in NOT_RUNNABLE:
            continue
        cost = ConvergenceCost(name, None, 0.0, 0, 0)
        try:
            c, s = cost.parsed()
        except ConfigError:
            continue
        if c.name not in CODEC_COST:
            continue
        pr = conv.predict(name, h, replicas)
        why = _allowed(lay, c, s, cloud.world_size)
        never = [p for p in conv.measured(name) if not p.reached and pr.measured_never == p.horizon]
        if not why and pr.measured_never is not None and never:
            why = (f"never reached fp32 DDP's loss within {never[0].cap_ratio:.1f}× its steps in a "
                   f"{never[0].horizon}-step run")
        elif not why and pr.ratio is None:
            why = ("never reached fp32 DDP's loss in any fitted run"
                   + (f" (at least {pr.at_least:.1f}× its steps at {h} steps)" if pr.at_least else ""))
        t, floor = step(c, s)
        ratio = t * pr.ratio / t_none if pr.ratio is not None and not why.startswith("never") else None
        out.append(Ranked(name, c, s, t, pr.ratio, ratio, 0.0, why, floor, pr.low, pr.high, pr.sigma,
                          pr.extrapolated))
    out.sort(key=_by_expected_time)
    return out


def _by_expected_time(r: Ranked) -> tuple:
    """Candidates first, by the expected time to the loss over the steps band (the log-normal mean), then as
    :func:`rank` breaks ties (the shorter step, the name)."""
    return (bool(r.why_not), r.expected_time_ratio if r.time_ratio is not None else float("inf"), r.step_time_s,
            r.spec)


@dataclass(frozen=True)
class Measured:
    """One strategy's step time as auto's start-up probe measured it on the job's own cluster: the mean over whole
    sync periods after its warm-up, and the mean's relative standard error."""

    step_s: float
    rel_se: float
    steps: int


def probed(ranked: Sequence[Ranked], measured: dict[str, Measured]) -> list[Ranked]:
    """The candidates re-priced by the probe: a measured one's time ratio = its measured step / fp32 DDP's measured
    step × its steps ratio (the convergence model's, unchanged), its step error the larger of :data:`PROBE_ERROR`
    and the 90 % band of the two means' standard errors; its compute floor is not known (no ceiling). A candidate
    the probe did not run is listed and not chosen: its predicted step is not comparable with measured ones."""
    import math

    base = measured["none"]
    out: list[Ranked] = []
    for r in ranked:
        m = measured.get(r.spec)
        if r.why_not:
            out.append(r)
        elif m is None:
            out.append(dataclasses.replace(r, why_not="not probed (below the catalog's top candidates)"))
        elif r.spec == "none":
            out.append(dataclasses.replace(r, step_time_s=m.step_s, time_ratio=1.0, floor_s=0.0))
        else:
            err = max(PROBE_ERROR, 1.645 * math.hypot(m.rel_se, base.rel_se))
            out.append(dataclasses.replace(r, step_time_s=m.step_s, floor_s=0.0, step_error=err,
                                           time_ratio=m.step_s / base.step_s * (r.steps_ratio or 1.0)))
    out.sort(key=_by_expected_time)
    return out


def load_convergence() -> ConvergenceModel:
    """The convergence model auto ranks with (``convergence-model.json``, :data:`MODEL_PATH`)."""
    return load_convergence_model(MODEL_PATH)


def priced_fit(cloud: CloudConfig, model: ModelSpec, lay: owner.Layout, global_batch: int,
               seq_len: Optional[int] = None, training: Training = SYNCWISE, micro_batch: int = 0,
               microbatches: int = 0) -> str:
    """'' when the layout the strategies are priced on fits in memory; else what does not fit, e.g. 'the priced
    layout dp=32 does not fit: 727 GiB > 77 GiB usable per GPU' (its step times are then not reachable)."""
    planned = Layout.of_owner(dataclasses.replace(lay, compress=owner.NO_COMPRESS, sync=None).resolve(
        cloud.world_size), micro_batch=micro_batch, microbatches=microbatches)
    pred = predict(cloud, model, planned, global_batch, seq_len, training=training, syncwise_rules=False)
    if pred.fits:
        return ""
    return (f"the priced layout {planned.text()} does not fit: {pred.memory_gb_per_gpu:,.0f} GiB > "
            f"{pred.memory_limit_gb:,.0f} GiB usable per GPU; its step times below are not reachable as they are")


def link_words(cloud: CloudConfig) -> str:
    """The link the data-parallel sync crosses, in words: 'N Mbit/s' between nodes, else the intra-node fabric."""
    fabric = cloud.inter_node if cloud.nodes > 1 else cloud.intra_node
    bits = fabric.bandwidth * 8
    rate = f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"{rate} ({fabric.name}{', between nodes' if cloud.nodes > 1 else ', one node'})"


def job_cloud(nodes: int, per_node: int, inter_bps: Optional[float] = None, accelerator: str = "cpu-lab",
              burst_bytes: float = 0.0, basis: Optional[Basis] = None) -> CloudConfig:
    """The cluster a job runs on when no calibrated cluster TOML is given: ``nodes`` × ``per_node`` workers of the
    catalog's ``accelerator`` (cpu-lab: the lab's measured CPU worker), the intra-node loopback, and between nodes
    the network lab's link at ``inter_bps`` bit/s (its tbf rate) with its tbf bucket of ``burst_bytes``. ``basis``:
    where workers share a host's cores (``Basis.share`` > 1), each computes (and encodes) at 1/share of the
    catalog's one-worker speed, as ``--calibrate`` would have measured it."""
    from .cloud import cluster

    cloud = cluster(accelerator, nodes, per_node)
    share = basis.share if basis is not None else 1.0
    if share > 1:
        acc = cloud.accelerator
        cloud = dataclasses.replace(cloud, accelerator=dataclasses.replace(
            acc, peak_bf16_flops=acc.peak_bf16_flops / share, peak_fp16_flops=acc.peak_fp16_flops / share,
            peak_fp8_flops=acc.peak_fp8_flops / share, hbm_bandwidth=acc.hbm_bandwidth / share, shared_by=share,
            codec_cost=tuple((n, e * share, t * share) for n, e, t in acc.codec_cost)))
    if nodes > 1 and inter_bps:
        cloud = dataclasses.replace(cloud, inter_node=dataclasses.replace(cloud.inter_node, bandwidth=inter_bps / 8,
                                                                          burst_bytes=float(burst_bytes)))
    return cloud


#: a strategy replaces fp32 DDP only when predicted at least this much sooner (time ratio ≤ MIN_GAIN): closer than
#: that is inside the planner's error (benchmarks/RESULTS.md §11-12), and fp32 DDP changes nothing
MIN_GAIN = 0.97


def choose(ranked: Sequence[Ranked]) -> Ranked:
    """The first candidate, unless fp32 DDP (``none``) is a candidate and it is not ≥ 3 % sooner (:data:`MIN_GAIN`)."""
    candidates = [r for r in ranked if not r.why_not]
    if not candidates:
        raise ConfigError("compress.method", owner.AUTO, "a strategy chosen explicitly: no strategy of the "
                          "convergence table can run on this layout")
    none = next((r for r in candidates if r.spec == "none"), None)
    if none is not None and candidates[0].expected_time_ratio > MIN_GAIN:
        return none
    return candidates[0]


def ratio_words(r: Ranked, basis: Basis, what: str = "") -> str:
    """'1.93×{what} (band 1.6–2.4×)' calibrated; '~2.4×{what} (band 0.48–2.8×)' on the catalog, whose figure is not
    precise enough for two decimals."""
    if r.spec == "none":
        return f"1×{what}"
    lo, hi = basis.band(r)
    point = f"{r.sooner:.2f}×" if basis.calibrated or r.step_error else f"~{r.sooner:.2g}×"
    return f"{point}{what} (band {lo:.2g}–{hi:.2g}×)"


def convergence_words(table: "ConvergenceTable | ConvergenceModel", horizon: Optional[int] = None,
                      replicas: Optional[int] = None) -> str:
    """What the steps ratios stand on: the table's one measurement, or the model's fitted points and the horizon and
    replicas it was asked at."""
    if isinstance(table, ConvergenceModel):
        h = int(horizon or table.h_ref)
        return (f"{table.basis()}; predicted at {h} steps" + (f", {replicas} replicas" if replicas else "")
                + ("" if horizon else " (the model's reference horizon: the job's was not given)"))
    return table.basis()


def explain(ranked: Sequence[Ranked], cloud: CloudConfig, table: "ConvergenceTable | ConvergenceModel",
            basis: Optional[Basis] = None, horizon: Optional[int] = None, replicas: Optional[int] = None) -> str:
    """The one start-up line: what auto chose and why, with its basis and uncertainty, e.g. 'auto: fp8 (predicted
    ~2.4× sooner (band 0.48–2.8×) to fp32 DDP's loss than none on 45 Mbit/s ...; basis: catalog figure ...; 4 workers
    share 2 cores ...; ceiling 2.8×; next: int8 ~2.2× ...; convergence: ..., 300-step horizon ..., 2 replicas)'."""
    basis = basis if basis is not None else basis_of(cloud)
    best = choose(ranked)
    others = [r for r in ranked if not r.why_not and r is not best][:2]

    def steps(r: Ranked) -> str:
        if not r.steps_ratio or (abs(r.steps_ratio - 1) < 0.005 and not r.steps_high):
            return ""
        band = (f" (band {r.steps_low:.2f}–{r.steps_high:.2f}"
                + (f"; {r.steps_note}" if r.steps_note else "") + ")") if r.steps_low and r.steps_high else ""
        return f", needs {r.steps_ratio:.2f}× the steps{band}" if r.spec != "none" else ""

    def part(r: Ranked) -> str:
        return f"{r.spec} {ratio_words(r, basis)}" + steps(r)

    excluded = sum(1 for r in ranked if r.why_not.startswith("never reached"))
    head = (f"auto: {best.spec} (predicted {ratio_words(best, basis, ' sooner')} to fp32 DDP's loss than none"
            if best.spec != "none" else "auto: none (fp32 DDP predicted soonest to its own loss, within "
            f"{100 * (1 - MIN_GAIN):.0f} %")
    top = ceiling(best)
    return (f"{head} on {link_words(cloud)}{steps(best)}; basis: {basis.words()}"
            + (f"; ceiling {top:.2g}× (compute floor, communication free)" if top and best.spec != "none" else "")
            + "; next: " + ("; ".join(part(r) for r in others) or "-")
            + (f"; {excluded} never reached the loss" if excluded else "")
            + f"; convergence: {convergence_words(table, horizon, replicas)})")


def resolve_auto(lay: owner.Layout, cloud: CloudConfig, model: ModelSpec, global_batch: int,
                 seq_len: Optional[int] = None, table: "Optional[ConvergenceTable | ConvergenceModel]" = None,
                 training: Training = SYNCWISE, micro_batch: int = 0, microbatches: int = 0,
                 basis: Optional[Basis] = None, horizon: Optional[int] = None,
                 replicas: Optional[int] = None) -> tuple[owner.Layout, str, list[Ranked]]:
    """The one place ``auto`` is resolved: (the layout with the chosen compressor and sync strategy, the start-up
    line, the ranked candidates). A layout without ``auto`` comes back as it is. ``basis``: what ``cloud`` stands
    on (default: :func:`basis_of`), said in the line with the band it gives. ``table``: default the convergence
    model (:func:`load_convergence`), asked at ``horizon`` (the job's steps) and ``replicas``; a measured
    :class:`ConvergenceTable` is used as it is (one horizon)."""
    if not lay.auto:
        return lay, "", []
    lay.auto_choices()   # a conflicting explicit option: ConfigError naming it
    table = table or load_convergence()
    ranked = rank(cloud, model, lay, global_batch, seq_len, table, training, micro_batch, microbatches, horizon,
                  replicas)
    best = choose(ranked)
    return (dataclasses.replace(lay, compress=best.compress, sync=best.sync),
            explain(ranked, cloud, table, basis, horizon, replicas), ranked)


def places(ranked: Sequence[Ranked]) -> list[str]:
    """The '#' column: 1, 2, ... for candidates, with '=' on every row of a tie (the same time to fp32's loss at
    the two decimals shown: '1=', '1=', '3'), '-' for the others."""
    out, shown = [], [f"{r.time_ratio:.2f}" if not r.why_not and r.time_ratio else None for r in ranked]
    for i, r in enumerate(ranked):
        if shown[i] is None:
            out.append("-")
            continue
        first = i
        while first > 0 and shown[first - 1] == shown[i]:
            first -= 1
        tied = shown.count(shown[i]) > 1
        out.append(f"{first + 1}=" if tied else str(i + 1))
    return out


def render(ranked: Sequence[Ranked], cloud: CloudConfig, table: "ConvergenceTable | ConvergenceModel", title: str,
           basis: Optional[Basis] = None, horizon: Optional[int] = None, replicas: Optional[int] = None) -> None:
    """``syncwise plan --strategy``'s table."""
    from rich.console import Console
    from rich.table import Table

    basis = basis if basis is not None else basis_of(cloud)
    measured = not isinstance(table, ConvergenceModel)
    t = Table(title=title, title_justify="left", caption=(
              f"steps: measured by benchmarks/time_to_loss.py ({table.basis()})" if measured else
              f"steps: {convergence_words(table, horizon, replicas)} (benchmarks/convergence_fit.py)")
              + f"; step time: the planner's cost model on {link_words(cloud)}, {basis.words()}; "
              "sooner than none: the prediction and the band the measured ratio is expected in; "
              "'=': a tie at the precision shown (time to fp32's loss), ordered by the exact prediction"
              + ("" if measured else " (the expected time over the steps band: the log-normal mean)")
              + ", then the shorter step")
    for col in ("#", "strategy", "step (predicted)", f"steps to fp32's loss ({'measured' if measured else 'model'})",
                "time to fp32's loss",
                "sooner than none", "not a candidate"):
        t.add_column(col, justify="left" if col in ("strategy", "not a candidate") else "right", overflow="fold")
    for r, place in zip(ranked, places(ranked)):
        steps = f"{r.steps_ratio:.2f}×" if r.steps_ratio else (f"> {r.cap_ratio:.1f}×" if r.cap_ratio else "-")
        if r.steps_ratio and r.steps_low and r.steps_high and r.spec != "none":
            steps += f" ({r.steps_low:.2f}–{r.steps_high:.2f})"
        t.add_row(place, r.spec, human_time(r.step_time_s), steps,
                  f"{r.time_ratio:.2f}×" if r.time_ratio else "-", ratio_words(r, basis) if r.sooner else "-",
                  r.why_not)
    Console(file=sys.stdout, width=160).print(t)


def write_table(results_path: "str | Path", out: "str | Path | None" = None) -> Path:
    """Regenerate the convergence table from a time-to-loss results file; returns where it was written."""
    src = Path(results_path)
    try:
        results = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("results", str(src), f"a readable benchmarks/time_to_loss.py results file ({e})") from None
    try:
        shown = str(src.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(src)
    data = table_from_results(results, shown)
    dest = Path(out) if out is not None else TABLE_PATH
    dest.write_text(json.dumps(data, indent=1) + "\n")
    return dest


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m syncwise.plan.strategy",
                                description="regenerate the convergence table from a time-to-loss results file")
    p.add_argument("results", help="a benchmarks/time_to_loss.py results JSON")
    p.add_argument("--out", default=None, help=f"where to write it (default {TABLE_PATH})")
    args = p.parse_args(argv)
    try:
        dest = write_table(args.results, args.out)
    except (ConfigError, SyncwiseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
