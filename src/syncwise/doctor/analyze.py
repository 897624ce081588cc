"""Where a run's step goes, what lost it efficiency, and what change the cost model predicts helps most.

The step is split (seconds per optimizer step, steady steps: the first ones are warm-up) into

* ``compute`` — forward, backward and optimizer of the median rank, without waits (the useful work);
* ``straggler_wait`` — how much longer the slowest rank computes than the others (they wait for it): the median
  over steps, so a few noisy steps do not make a straggler;
* ``data_wait`` — the longest wait of any rank for its batches (its median step: a loader that cannot keep up is slow every step, a blip is not) (the others wait for that rank);
* ``compress`` — compression compute on the critical path (the hook's encode/decode after the last bucket);
* ``comm_dp`` — exposed gradient communication on the wire (the least any rank waited: waiting for a peer is
  the peer's cause, not the link's);
* ``comm_ep`` / ``expert_wait`` — expert all-to-all time, and how much longer some ranks wait in it than others
  (the experts they wait for got more tokens);
* ``pp_bubble`` — the pipeline's idle share;
* ``checkpoint`` — what saves blocked training, per step (saves happen between steps);
* ``other`` — the rest (Python overhead, the loss all-reduce, noise).

Parallel efficiency = compute / (step + checkpoint stall per step). Each cause is then a :class:`Finding` with the
time it loses per step, the evidence in numbers, and a recommendation whose gain is predicted — by
``syncwise.plan.whatif`` (the cost model calibrated on this run) where the change is one the model covers
(compressor, bucket size, pipeline micro-batches), else by removing the measured loss.

What-if is given what the run measured, not an ideal: the overlap of gradient communication with the backward the
run supports (``facts['overlap']``: none on a CPU over loopback, the measured hidden share where the collectives
were timed, else unknown) and a micro-batch's fixed host cost (``facts['microbatch_fixed']``: fitted from recorded
micro-batch sizes, else bracketed). What it cannot tell is bracketed (:class:`_Model`), and a change is recommended
only where every end of the bracket predicts it faster; else the finding says it is predicted slower or that the
run cannot tell, with no flag. Rebalanced experts are not predicted (their per-expert calls are not recorded). The
link finding is split by parallel dimension (``comm_exposed_s_<dim>``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from . import arrivals as arrival_log
from .dimensions import DIMENSIONS, WORDS, by_dimension
from .rundir import Run
from ..errors import ConfigError, SyncwiseError
from ..layout import BUCKET_CAP_MB, names_torch_hook
from ..metrics.figures import hop_means
from ..specs import spec_name

PARTS = ("compute", "straggler_wait", "data_wait", "compress", "comm_dp", "comm_ep", "expert_wait", "pp_bubble",
         "checkpoint", "other")
PART_WORDS = {"compute": "compute", "straggler_wait": "waiting for a slow rank", "data_wait": "waiting for data",
              "compress": "compression compute", "comm_dp": "exposed gradient communication",
              "comm_ep": "expert all-to-all", "expert_wait": "waiting for overloaded experts",
              "pp_bubble": "pipeline bubble", "checkpoint": "checkpoint stall", "other": "other"}
CAUSES = ("straggler", "data_loader", "checkpoint", "pipeline_bubble", "expert_imbalance", "compression",
          "buckets_too_small", "buckets_too_large", "link")
MIN_SHARE = 0.05          # a cause losing less than this share of the step is not reported
STRAGGLER_RATIO = 0.25    # the slowest rank computes this much longer than the others
ARRIVAL_RATIO = 0.10      # ... or arrives at the collectives this much (of the compute) after the others
SMALL_CALLS = 8           # gradient collectives per step from which their per-call cost is weighed (MIN_SHARE decides)
COMPRESSORS = ("bf16", "fp8", "powersgd:rank=4")  # what the link finding asks the cost model about


@dataclass
class Finding:
    """One cause of lost efficiency."""

    cause: str
    title: str
    lost_s: float
    evidence: str
    recommendation: str = ""
    flag: str = ""                          # the command-line change, e.g. "--compress fp8"
    predicted_step_s: Optional[float] = None
    predicted_efficiency: Optional[float] = None
    predicted_by: str = ""                  # "cost model" | "measured loss removed"
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, wall: float) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "lost_s": self.lost_s,
                "lost_share": self.lost_s / wall if wall else 0.0, "evidence": self.evidence,
                "recommendation": self.recommendation, "flag": self.flag, "predicted_step_s": self.predicted_step_s,
                "predicted_efficiency": self.predicted_efficiency, "predicted_by": self.predicted_by,
                "details": self.details}


@dataclass
class Diagnosis:
    """What doctor found in one run."""

    run: Run
    steps: int
    steady_steps: list[int]
    world_size: int
    step_s: float                     # mean step time (rank 0, steady steps)
    wall_s: float                     # step + checkpoint stall per step
    parts: dict[str, float]           # seconds per step by PARTS
    per_rank: dict[int, dict[str, float]]
    findings: list[Finding]
    facts: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    arrivals: Any = None              # syncwise.doctor.arrivals.Arrivals, where the ranks logged them
    trace: Optional[dict[str, Any]] = None  # syncwise.doctor.trace.summarize, where --profile.* recorded traces
    verdict: Any = None               # its straggler Verdict over the steady steps

    @property
    def efficiency(self) -> float:
        return self.parts["compute"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def top(self) -> Optional[Finding]:
        return self.findings[0] if self.findings else None

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return {"run": str(self.run.path), "steps": self.steps, "steady_steps": len(self.steady_steps),
                "world_size": self.world_size, "step_time_s": self.step_s, "wall_step_s": self.wall_s,
                "efficiency": self.efficiency, "breakdown_s": self.parts,
                "breakdown_share": {k: v / self.wall_s if self.wall_s else 0.0 for k, v in self.parts.items()},
                "per_rank": {str(r): v for r, v in self.per_rank.items()},
                "findings": [f.as_dict(self.wall_s) for f in self.findings],
                "top_cause": self.top.cause if self.top else None, "facts": self.facts, "notes": self.notes}


# ---------------------------------------------------------------------------------------------- helpers
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _num(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def steady(steps: list[int]) -> list[int]:
    """The steps rates are taken over: the first ones (allocator warm-up, DDP's bucket rebuild) are left out."""
    n = len(steps)
    skip = 0 if n < 3 else 1 if n < 6 else max(2, n // 10)
    return steps[skip:]


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


# ---------------------------------------------------------------------------------------------- the diagnosis
def diagnose(run: Run, predict: bool = True) -> Diagnosis:
    """Analyse ``run``: the step's breakdown, the causes of lost efficiency ranked by time lost, and the predicted
    gain of each recommendation (``predict=False``: without the cost model)."""
    summary = run.summary
    by_rank = {r: {row["step"]: row for row in rows} for r, rows in run.ranks.items()}
    common = sorted(set.intersection(*(set(d) for d in by_rank.values())))
    if not common:
        common = sorted(by_rank[min(by_rank)])
        by_rank = {min(by_rank): by_rank[min(by_rank)]}
    use = steady(common)
    ranks = sorted(by_rank)
    world = int(summary.get("world_size") or len(ranks))

    def m(r: int, key: str) -> float:
        return _mean([_num(by_rank[r][s], key) for s in use])

    per_rank: dict[int, dict[str, float]] = {}
    own: dict[int, float] = {}
    for r in ranks:
        step_r = m(r, "step_time_s")
        vals = {k: m(r, k) for k in ("step_time_s", "compute_s", "data_wait_s", "comm_exposed_s", "compress_s",
                                     "ep_comm_s", "pp_bubble", "expert_imbalance")}
        # a loader that cannot keep up makes every step wait: the median step's wait, so that one step's blip (a
        # page fault, a descheduled rank on shared cores) is not reported as a slow loader
        vals["data_wait_s"] = statistics.median(_num(by_rank[r][s], "data_wait_s") for s in use) if use else 0.0
        own[r] = max(0.0, vals["compute_s"] - vals["ep_comm_s"] - vals["pp_bubble"] * step_r)
        vals["own_compute_s"] = own[r]
        per_rank[r] = vals
    ref_rank = 0 if 0 in per_rank else ranks[0]
    step = per_rank[ref_rank]["step_time_s"]

    # the slowest rank against the others (with 2 ranks: against the other one); its excess is the median over
    # steps of how much longer it computed, so a rank that was slow in a few noisy steps is not a straggler
    slowest = max(ranks, key=lambda r: own[r])
    others = [own[r] for r in ranks if r != slowest]
    reference = statistics.median(others) if others else own[slowest]
    excess = 0.0
    if others:
        def own_at(r: int, s: int) -> float:
            row = by_rank[r][s]
            return _num(row, "compute_s") - _num(row, "ep_comm_s") - _num(row, "pp_bubble") * _num(row, "step_time_s")
        excess = max(0.0, statistics.median(
            own_at(slowest, s) - statistics.median(own_at(r, s) for r in ranks if r != slowest) for s in use))
    data_rank = max(ranks, key=lambda r: per_rank[r]["data_wait_s"])
    data_wait = per_rank[data_rank]["data_wait_s"]
    comm_min = min(per_rank[r]["comm_exposed_s"] for r in ranks)
    compress_total = _mean([per_rank[r]["compress_s"] for r in ranks])
    compress_exposed = min(compress_total, comm_min)
    wire = comm_min - compress_exposed
    ep_values = [per_rank[r]["ep_comm_s"] for r in ranks]
    ep_wire = min(ep_values)
    expert_wait = max(ep_values) - ep_wire
    bubble = _mean([per_rank[r]["pp_bubble"] for r in ranks]) * step
    imbalance = max(per_rank[r]["expert_imbalance"] for r in ranks)
    # Arrival order at the collectives (torch's flight recorder, ranks/arrivals{R}.jsonl) decides where the ranks
    # do the same work (pp 1): the rank the others wait for is the last to arrive, whatever the step times show
    # (under DDP the all-reduce evens them out). Its lost time is the margin by which it arrives last.
    verdict = None
    arr = arrival_log.load(run.path, ranks) if len(ranks) > 1 and int(run.cfg("parallel", "pp", 1) or 1) == 1 \
        else None
    if arr is not None:
        waits = {r: {s: _num(by_rank[r][s], "data_wait_s") for s in use} for r in ranks}
        verdict = arrival_log.attribute(arr, use, step, waits)
        if verdict.steps:
            if verdict.kind == "compute":
                slowest, excess = verdict.rank, verdict.lost_s
            else:   # no straggler, or one its loader explains (the data_loader finding names it)
                excess = 0.0
    if len(ranks) > 1 and imbalance > 1.5 and expert_wait > 0 and per_rank[slowest]["ep_comm_s"] == ep_wire:
        # the slow rank is the one holding the overloaded experts: its extra compute is what the others wait for
        # in the all-to-alls (counted there), not a straggler
        excess = 0.0

    steps_done = int(summary.get("steps") or common[-1])
    saves = max((t.get("checkpoint_saves") or [] for t in run.totals.values()),
                key=lambda s: sum(x.get("blocking_s", 0) for x in s), default=None)
    if saves is None:
        saves = summary.get("checkpoint_saves") or []
    # the final save happens after the last step: it delays the end of the run, not the steps
    during = [s for s in saves if isinstance(s, dict) and s.get("step", 0) < steps_done]
    stall = sum(float(s.get("blocking_s", 0.0)) for s in during) / max(steps_done, 1)
    inflight = _inflight_cost(by_rank[ref_rank], use)
    ckpt = stall + inflight

    parts = {"compute": reference if others else own[slowest], "straggler_wait": max(0.0, excess),
             "data_wait": data_wait, "compress": compress_exposed, "comm_dp": wire, "comm_ep": ep_wire,
             "expert_wait": expert_wait, "pp_bubble": bubble, "checkpoint": ckpt}
    # the others' wait for a straggler found by arrival order is also inside their exposed-communication and
    # compute timers: where the parts would pass the step, the overlap is taken off the straggler's share
    over = sum(parts.values()) - (step + stall)
    if verdict is not None and over > 0:
        parts["straggler_wait"] = max(0.0, parts["straggler_wait"] - over)
    parts["other"] = max(0.0, step + stall - sum(parts.values()))
    wall = step + stall

    # the gradient (dp) share of the exposed communication, where the ranks logged it per dimension (tp's and
    # FSDP2's exposed time is in comm_exposed_s too): what the gradient link is calibrated on
    dp_exposed = [_mean([_num(by_rank[r][s], "comm_exposed_s_dp") for s in use]) for r in ranks
                  if all("comm_exposed_s_dp" in by_rank[r][s] for s in use)]
    wire_dp = max(0.0, min(min(dp_exposed) - compress_exposed, wire)) if len(dp_exposed) == len(ranks) else wire
    facts = _facts(run, per_rank, use, world, wire_dp)
    facts["dp_exposed_s"] = wire_dp
    facts.update(slowest_rank=slowest, slowest_excess_s=excess, data_rank=data_rank,
                 checkpoint_saves_during_run=len(during), checkpoint_blocking_per_save_s=(
                     stall * max(steps_done, 1) / len(during) if during else 0.0), checkpoint_inflight_s=inflight)
    if verdict is not None:
        facts["arrivals"] = verdict.as_dict()
    if arr is not None:
        calls = [arr.grad_calls[s] for s in use if s in arr.grad_calls]
        if calls:
            facts["grad_calls_per_step"] = statistics.median(calls)
    facts["by_dimension"] = by_dimension(run.ranks, use)
    facts["overlap"] = _overlap_evidence(run, facts)
    facts["microbatch_fixed"] = _microbatch_evidence(run, by_rank[ref_rank], use, facts)
    diag = Diagnosis(run, steps_done, use, world, step, wall, parts, per_rank, [], facts)
    diag.arrivals, diag.verdict = arr, verdict
    diag.findings = _findings(diag, by_rank, use, predict)
    from .trace import cite, name_causes, summarize  # the profiled steps, where --profile.* recorded them
    diag.trace = summarize(run.path, facts.get("effective_bandwidth_bytes_s"))
    if diag.trace is not None:  # what the trace alone names (the findings above are the step timers')
        diag.trace["causes"] = name_causes(diag.trace, pp=facts["pp"], compressor=facts["compressor"],
                                           grad_bytes=facts["grad_bytes"], min_share=MIN_SHARE,
                                           wait_ratio=ARRIVAL_RATIO, small_calls=SMALL_CALLS,
                                           bucket_cap_mb=BUCKET_CAP_MB)
    for finding in diag.findings:
        cite(finding, diag.trace)
    return diag


def _inflight_cost(rows: dict[int, dict], use: list[int]) -> float:
    """Extra step time while an asynchronous save is in flight, spread over all steps."""
    flagged = [s for s in use if rows[s].get("ckpt_in_flight")]
    clear = [s for s in use if not rows[s].get("ckpt_in_flight")]
    if not flagged or not clear:
        return 0.0
    extra = _mean([rows[s]["step_time_s"] for s in flagged]) - _mean([rows[s]["step_time_s"] for s in clear])
    return max(0.0, extra) * len(flagged) / len(use)


def _overlap_evidence(run: Run, f: dict[str, Any]) -> dict[str, Any]:
    """How much of the gradient sync this run hid behind its backward, from its own numbers: ``credit`` is the
    fraction of the cost model's overlap what-if may count on (None: this run cannot tell), ``why`` says from what.

    * a CPU run without a shaped link (gloo over loopback): 0 — gloo's reductions and copies run on the cores the
      backward uses, so a reduction that "hides" slows the backward by as much (smaller buckets measured 0.64× on
      the lab's CPUs, benchmarks/RESULTS.md §11b); the measured hidden share is reported beside it;
    * else, where the run timed its gradient collectives (``comm_s_dp``) and the step's wait for them
      (``comm_exposed_s_dp``) and sent more than one per step: the measured hidden seconds (total − exposed),
      turned into a fraction of the model's own hidden time by ``_Model``;
    * else (DDP's built-in all-reduce is not timed; one bucket cannot show overlap): None."""
    dp = (f.get("by_dimension") or {}).get("dp") or {}
    took, exposed = dp.get("comm_s"), dp.get("exposed_s")
    hidden = max(0.0, took - exposed) if took is not None and exposed is not None and took > 0 else None
    share = hidden / took if hidden is not None else None
    calls = f.get("grad_calls_per_step") or f.get("buckets") or 0
    device = str(run.summary.get("device") or run.summary.get("accelerator") or run.cfg("dist", "device", "") or "")
    out = {"credit": None, "hidden_s": hidden, "hidden_share": share, "device": device or None, "why": ""}
    seen = f"measured {share:.0%} of the gradient communication hidden" if share is not None else \
        "its hidden share not measured (DDP's own all-reduce is not timed)"
    if device.startswith("cpu") and not f.get("lab"):
        out["credit"] = 0.0
        out["why"] = ("a CPU run over loopback: gloo's reductions run on the cores the backward uses, so what hides "
                      f"behind the backward slows it as much ({seen})")
    elif hidden is not None and calls > 1:
        out["measured"] = True
        out["why"] = f"{seen} in this run ({calls:g} collectives per step)"
    else:
        out["why"] = (f"this run cannot show it ({seen}" + ("; one collective per step cannot overlap" if calls <= 1
                                                            else "") + ")")
    return out


def _microbatch_evidence(run: Run, rows: dict[int, dict], use: list[int], f: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch's fixed host cost (seconds per micro-batch per stage rank, forward + backward), from the run:
    where its rows record two or more micro-batch sizes (``micro_batch``: DynamicBatcher at a constant batch), the
    slope of the step's compute over the number of micro-batches (compute = n × fixed + rows × per-row + the
    optimizer). Else ``fixed_s`` None (``_Model`` then brackets it)."""
    batch = int(f.get("batch_size") or 0)
    pts = [(math.ceil(batch / int(rows[s]["micro_batch"])), _num(rows[s], "compute_s")) for s in use
           if batch and isinstance(rows[s].get("micro_batch"), int) and rows[s]["micro_batch"] > 0]
    ns = {n for n, _ in pts}
    if len(ns) >= 2:
        mx = _mean([n for n, _ in pts])
        my = _mean([c for _, c in pts])
        var = sum((n - mx) ** 2 for n, _ in pts)
        slope = sum((n - mx) * (c - my) for n, c in pts) / var
        return {"fixed_s": max(0.0, slope), "by": f"the step's compute over {len(ns)} recorded micro-batch counts "
                f"({', '.join(str(n) for n in sorted(ns))}; {len(pts)} steps)"}
    return {"fixed_s": None, "by": "one micro-batch size recorded: fixed and per-sequence cost cannot be told apart"}


def _facts(run: Run, per_rank: dict, use: list[int], world: int, wire: float) -> dict[str, Any]:
    """The run's layout and its gradient traffic (bytes, buckets, effective bandwidth)."""
    from ..plan.whatif import moved_bytes

    rows0 = {r["step"]: r for r in run.rows}
    dp_bytes = _mean([_num(rows0[s], "comm_bytes_dp") or _num(rows0[s], "comm_bytes") for s in use if s in rows0])
    params = run.summary.get("params")
    compressor = str(run.summary.get("compressor") or run.cfg("compress", "method", "none"))
    cap = float(run.cfg("dist", "bucket_cap_mb", BUCKET_CAP_MB))
    grad_bytes = 4.0 * params if isinstance(params, (int, float)) and params else (
        dp_bytes if compressor == "none" else 0.0)
    pp = int(run.cfg("parallel", "pp", 1) or 1)
    dp = max(1, world // pp)
    buckets = math.ceil(grad_bytes / (cap * 2**20)) if grad_bytes else None
    # collective time and bytes moved per step, from every rank's totals (the fastest rank waited least)
    steps = max(int(run.summary.get("steps") or 1), 1)
    moved, timed = None, None
    for t in run.totals.values() if compressor != "none" else ():  # DDP's own all-reduce is not timed
        comm = t.get("comm") or {}
        b = sum(moved_bytes(op, v.get("bytes", 0) / steps, dp) for op, v in comm.items())
        s = sum(v.get("time_s", 0.0) for v in comm.values()) / steps
        if b and (moved is None or b > moved):
            moved = b
        if s > 0 and (timed is None or s < timed):
            timed = s
    if moved is None and dp_bytes:
        moved = moved_bytes("all_reduce", dp_bytes, dp)
    if timed is None and buckets is not None and buckets <= 2 and wire > 0:
        timed = wire  # one bucket, sent after the backward: the whole all-reduce is exposed
    bandwidth = moved / timed if moved and timed else None
    return {"compressor": compressor, "sync": run.summary.get("sync"), "layout": run.summary.get("layout"),
            "preset": run.cfg("model", "preset"), "lab": bool(run.cfg("dist", "lab", False)),
            "bucket_cap_mb": cap, "grad_bytes": grad_bytes or None, "buckets": buckets, "dp": dp, "pp": pp,
            "ep": int(run.cfg("parallel", "ep", 1) or 1), "dp_bytes_per_step": dp_bytes or None,
            "moved_bytes_per_step": moved, "wire_time_s": timed, "effective_bandwidth_bytes_s": bandwidth,
            # rank 0's bytes per step by hop (metrics.figures.hop_means: None on one node or an unknown topology,
            # which comm_hops says)
            "hop_bytes_per_step": hop_means([rows0[s] for s in use if s in rows0]),
            "comm_hops": run.summary.get("comm_hops"),
            "params": params, "grad_accum": int(run.cfg("train", "grad_accum", 1) or 1),
            "batch_size": run.cfg("data", "batch_size"), "seq_len": run.cfg("data", "seq_len"),
            "ckpt_async": run.cfg("ckpt", "async_save"), "ckpt_interval": run.cfg("ckpt", "interval"),
            "microbatches": run.cfg("parallel", "microbatches"), "pp_schedule": run.cfg("parallel", "pp_schedule"),
            "expert_imbalance": max((per_rank[r]["expert_imbalance"] for r in per_rank), default=0.0)}


# ---------------------------------------------------------------------------------------------- findings
def _findings(d: Diagnosis, by_rank: dict, use: list[int], predict: bool) -> list[Finding]:
    p, f, wall = d.parts, d.facts, d.wall_s
    out: list[Finding] = []
    model = _Model(d) if predict else None
    if model is not None and model.error:
        d.notes.append(f"no cost-model predictions for this run: {model.error}")

    def removed(lost: float) -> tuple[float, float]:
        after = max(1e-9, wall - lost)
        return after, p["compute"] / after

    # a straggler
    v = d.verdict
    if v is not None and v.steps:
        if v.kind == "compute" and p["straggler_wait"] > ARRIVAL_RATIO * max(p["compute"], 1e-9) \
                and p["straggler_wait"] >= MIN_SHARE * wall:
            out.append(_arrival_straggler(d, v, removed))
    elif d.world_size > 1 and p["straggler_wait"] > STRAGGLER_RATIO * max(p["compute"], 1e-9):
        r = f["slowest_rank"]
        slow_steps = 0
        for s in use:
            owns = {q: _num(by_rank[q][s], "compute_s") - _num(by_rank[q][s], "ep_comm_s") for q in by_rank}
            others = [v for q, v in owns.items() if q != r]
            if owns[r] == max(owns.values()) and owns[r] > (1 + STRAGGLER_RATIO) * statistics.median(others):
                slow_steps += 1
        frac = slow_steps / max(len(use), 1)
        stays = "it stays slow" if frac >= 0.75 else "it is slow only at times"
        after, eff = removed(p["straggler_wait"])
        out.append(Finding(
            "straggler", f"rank {r} is a straggler", p["straggler_wait"],
            f"rank {r} computes {_ms(d.per_rank[r]['own_compute_s'])} per step against {_ms(p['compute'])} on the "
            f"others (+{_pct(p['straggler_wait'] / max(p['compute'], 1e-9))}); it was the slow one in {slow_steps} "
            f"of {len(use)} steady steps: {stays}; the other ranks wait for it in the gradient sync",
            f"find out why rank {r} is slow (its device's clocks or temperature, another job on its node) and "
            "replace or leave out that node (an elastic restart with --nnodes MIN:MAX continues without it)",
            predicted_step_s=after, predicted_efficiency=eff, predicted_by="measured loss removed",
            details={"rank": r, "slow_steps": slow_steps, "steady_steps": len(use), "stays_slow": frac >= 0.75}))
    # the data loader
    if p["data_wait"] > 0:
        r = f["data_rank"]
        waiting = [q for q in d.per_rank if d.per_rank[q]["data_wait_s"] > 0.5 * p["data_wait"]]
        who = f"rank {r}" if len(waiting) == 1 and d.world_size > 1 else "the ranks"
        after, eff = removed(p["data_wait"])
        out.append(Finding(
            "data_loader", "the data loader cannot keep up", p["data_wait"],
            f"{who} wait{'s' if who.startswith('rank') else ''} {_ms(p['data_wait'])} per step for batches "
            f"({_pct(p['data_wait'] / wall)} of the step)" + (", and the other ranks wait for it" if
                                                              who.startswith("rank") else ""),
            "make the loader keep up: a deeper prefetch (--data.prefetch), more loader workers, pre-tokenized or "
            "local data", "--data.prefetch=8", after, eff, "measured loss removed", {"ranks": waiting}))
    # checkpoint stalls
    if p["checkpoint"] > 0:
        out.append(_checkpoint_finding(d, removed))
    # the pipeline bubble
    if p["pp_bubble"] > 0:
        out.append(_bubble_finding(d, model, removed))
    # expert load imbalance
    if f["expert_imbalance"] > 1.5 or p["expert_wait"] > 0:
        e = f["expert_imbalance"]
        cost = (f"ranks wait {_ms(p['expert_wait'])} longer than others in the expert all-to-alls"
                if f["ep"] > 1 else "with every expert on every rank (ep 1) it costs no waiting, but it would "
                "under expert parallel")
        # Rebalanced routing gives tokens to experts that had few or none: their per-expert GEMM calls (each with a
        # fixed host cost) come back, and the ranks that waited compute more. The runs record the all-to-alls
        # (calls, bytes, seconds) but not the per-expert calls or their cost, so no speed-up is predicted: the wait
        # is the most it can save.
        ep_calls = sum(((t.get("ep") or {}).get("all_to_all") or {}).get("calls", 0) for t in d.run.totals.values())
        out.append(Finding(
            "expert_imbalance", "load imbalance across MoE experts", p["expert_wait"],
            f"the most loaded expert gets {e:.1f}× the mean load (max/mean over routed tokens); {cost}",
            "balance the routing: keep the router's bias update on (model bias_update_rate > 0) and give it "
            "steps to act, or fewer experts per expert-parallel rank — at most "
            f"{_ms(p['expert_wait'])} per step saved (the wait); not predicted: the per-expert calls rebalancing "
            "adds are not recorded, so their cost cannot be priced", "", None, None, "not priced",
            {"imbalance": e, "max_saving_s": p["expert_wait"], "ep_all_to_all_calls": ep_calls}))
    # compression compute on the critical path
    if p["compress"] > 0:
        out.append(_compression_finding(d, model, removed))
    # gradient buckets and the link
    out.extend(_bucket_and_link_findings(d, model, removed))
    out = [x for x in out if x.lost_s >= MIN_SHARE * wall or (x.cause == "expert_imbalance" and
                                                               f["expert_imbalance"] > 1.5 and x.lost_s > 0)]
    out.sort(key=lambda x: (-x.lost_s, CAUSES.index(x.cause)))
    return out


def _arrival_straggler(d: Diagnosis, v, removed) -> Finding:
    """A compute straggler found by arrival order (syncwise.doctor.arrivals)."""
    r, n = v.rank, v.steps
    after, eff = removed(d.parts["straggler_wait"])
    since = sum(1 for s in d.steady_steps if s >= v.onset)
    how = (f"persistent, it stays slow: late in {len(v.late_steps)} of the {since} steady steps since step "
           f"{v.onset}" if v.persistent else
           f"transient: late only in step{'s' if len(v.late_steps) > 1 else ''} "
           + ", ".join(str(s) for s in v.late_steps[:8]) + (" …" if len(v.late_steps) > 8 else ""))
    evidence = (f"rank {r} arrives last at the collectives, a median {_ms(v.margin_s)} after the next rank "
                f"(flight recorder: enqueue times of the same collective on every rank), in {len(v.late_steps)} of "
                f"{n} steady steps — {how}; its own wait for batches in those steps is {_ms(v.data_s)}, so the "
                f"lateness is compute, not input; the others wait {_ms(d.parts['straggler_wait'])} per step for it "
                "inside the gradient sync, where their step times hide it")
    rec = (f"find out why rank {r} is slow (its device's clocks or temperature, another job on its node) and replace "
           "or leave out that node (an elastic restart with --nnodes MIN:MAX continues without it)" if v.persistent
           else f"rank {r} was slow only at times (steps {v.late_steps[0]}–{v.late_steps[-1]}): watch it; if it "
           "comes back, look for another job or a throttled device on its node")
    return Finding("straggler", f"rank {r} is a {'persistent' if v.persistent else 'transient'} compute straggler",
                   d.parts["straggler_wait"], evidence, rec, predicted_step_s=after, predicted_efficiency=eff,
                   predicted_by="measured loss removed",
                   details={"rank": r, "slow_steps": len(v.late_steps), "steady_steps": n,
                            "stays_slow": v.persistent, "onset_step": v.onset, "by": "arrival order"})


def _checkpoint_finding(d: Diagnosis, removed) -> Finding:
    p, f, wall = d.parts, d.facts, d.wall_s
    per_save = f["checkpoint_blocking_per_save_s"]
    saves = f["checkpoint_saves_during_run"]
    sync = f["ckpt_async"] is False
    evidence = (f"{saves} save(s) in {d.steps} steps blocked training {_ms(per_save)} each"
                + (" (synchronous saves)" if sync else "")
                + f": {_ms(p['checkpoint'])} per step, {_pct(p['checkpoint'] / wall)} of the step")
    if f["checkpoint_inflight_s"] > 0:
        evidence += f" (of which {_ms(f['checkpoint_inflight_s'])} are steps slowed while a save was in flight)"
    # Young/Daly: interval sqrt(2 δ M) for the run's MTBF (the checkpointer's 'dynamic'); the stall shrinks by the
    # ratio of intervals
    mtbf = float(d.run.cfg("ckpt", "mtbf_s", 14400.0) or 14400.0)
    interval_s = math.sqrt(2 * max(per_save, 1e-6) * mtbf)
    interval_steps = max(1.0, interval_s / max(d.step_s, 1e-9))
    predicted = per_save / interval_steps
    flag = "--ckpt.interval=dynamic" + (" --ckpt.async_save=true" if sync else "")
    after = max(1e-9, wall - p["checkpoint"] + min(predicted, p["checkpoint"]))
    return Finding("checkpoint", "checkpoint stalls", p["checkpoint"], evidence,
                   "save less often — Young/Daly's interval for this save cost and an MTBF of "
                   f"{mtbf / 3600:.0f} h is {interval_s:,.0f} s (~{interval_steps:,.0f} steps)"
                   + (" — and in the background" if sync else ""), flag, after, d.parts["compute"] / after,
                   "Young/Daly interval (syncwise.checkpoint's 'dynamic')",
                   {"blocking_per_save_s": per_save, "saves": saves, "synchronous": sync})


#: the share of a run's busy time its FLOPs at the accelerator's peak may explain before that peak is taken for an
#: effective rate that bounds no fixed cost (see _Model: the micro-batch bracket)
PEAK_EXPLAINS_ALL = 0.9


def _verdict(span: Optional[tuple[float, float]], wall: float) -> str:
    """'faster' where every end of a predicted range is below the measured step, 'slower' where none is, else
    'unknown' (the run's evidence allows either)."""
    if span is None:
        return "unknown"
    return "faster" if span[1] < wall else "slower" if span[0] >= wall else "unknown"


def _range_words(span: tuple[float, float]) -> str:
    return _ms(span[0]) if abs(span[1] - span[0]) < 5e-4 else f"{_ms(span[0])}–{_ms(span[1])}"


def _bubble_finding(d: Diagnosis, model: "Optional[_Model]", removed) -> Finding:
    """The pipeline bubble. More micro-batches shrink it as (p − 1)/(M + p − 1) but each pays a fixed host cost
    (Python, kernel dispatch, the schedule's sends): the change is recommended only where the cost model, with the
    run's fixed cost per micro-batch (measured, or bracketed where the run cannot tell it), predicts it faster."""
    p, f, wall = d.parts, d.facts, d.wall_s
    M = int(f["microbatches"] or 0) or 2 * f["pp"]
    batch = int(f["batch_size"] or M)
    options = [m for m in (2 * M, 4 * M, 8 * M) if m <= batch and batch % m == 0]
    evidence = (f"the pipeline's {f['pp']} stages idle {_pct(p['pp_bubble'] / max(d.step_s, 1e-9))} of the step "
                f"({_ms(p['pp_bubble'])}) with {M} micro-batches ({f['pp_schedule'] or '1f1b'}); "
                f"the bubble shrinks as (p − 1)/(M + p − 1)")
    finding = Finding("pipeline_bubble", "pipeline bubble", p["pp_bubble"], evidence,
                      "more micro-batches per step (or a zero-bubble schedule: --parallel.pp_schedule=interleaved-zb "
                      "with 2 stages per rank; not priced)")
    mb = f.get("microbatch_fixed") or {}
    fixed = mb.get("fixed_s")
    cost = (f"a micro-batch's fixed host cost of {_ms(fixed)} ({mb.get('by')})" if fixed is not None else
            f"a micro-batch's fixed host cost between 0 and {_ms(mb.get('bound_s') or 0.0)} ({mb.get('by', '')}; "
            f"at most {mb.get('bound_by') or 'its time beyond its FLOPs at the accelerator peak'})")
    spans = {m: model.span(microbatches=m) for m in options} if model is not None and model.measured else {}
    spans = {m: v for m, v in spans.items() if v is not None}
    finding.details = {"microbatch_fixed_s": fixed, "microbatch_fixed_bound_s": mb.get("bound_s"),
                       "predicted_range_s": {str(m): list(v) for m, v in spans.items()}}
    if not spans:
        finding.recommendation += (" — not predicted: without the cost model the fixed cost per micro-batch cannot "
                                   "be weighed against the bubble")
        finding.predicted_by = "not priced"
        return finding
    best = min(spans, key=lambda m: spans[m][1])
    verdict = _verdict(spans[best], wall)
    finding.details["verdict"] = verdict
    if verdict == "faster":
        finding.flag = f"--parallel.microbatches={best}"
        finding.recommendation = f"split the batch into {best} micro-batches instead of {M} (priced with {cost})"
        finding.predicted_step_s, finding.predicted_by = spans[best][1], "cost model + micro-batch host cost"
        finding.predicted_efficiency = p["compute"] / finding.predicted_step_s
    elif verdict == "slower":
        finding.recommendation = (f"not more micro-batches: with {cost}, {best} micro-batches are predicted slower "
                                  f"({_range_words(spans[best])} against {_ms(wall)}); a zero-bubble schedule "
                                  "(--parallel.pp_schedule=interleaved-zb, not priced) or fewer stages")
        finding.predicted_by = "cost model + micro-batch host cost (predicted slower: not recommended)"
    else:
        finding.recommendation = (f"cannot tell from this run whether more micro-batches help: with {cost}, {best} "
                                  f"micro-batches are predicted at {_range_words(spans[best])} against {_ms(wall)} "
                                  f"now; try --parallel.microbatches={best} and compare the runs (syncwise doctor A B)")
        finding.predicted_by = "cost model: cannot tell (fixed cost per micro-batch unknown)"
    return finding


def _compression_finding(d: Diagnosis, model: "Optional[_Model]", removed) -> Finding:
    p, f, wall = d.parts, d.facts, d.wall_s
    finding = Finding("compression", "compression compute on the critical path", p["compress"],
                      f"the {f['compressor']} compressor computes {_ms(p['compress'])} per step after the backward "
                      f"({_pct(p['compress'] / wall)} of the step) while the wire time is {_ms(p['comm_dp'])}",
                      "a cheaper compressor (or none) for this link and model size")
    best = model.best_compressor(exclude=f["compressor"], also=("none",)) if model is not None else None
    if best is not None:
        spec, step = best
        finding.flag, finding.predicted_step_s, finding.predicted_by = f"--compress {spec}", step, "cost model"
        finding.recommendation = f"compress with {spec} instead of {f['compressor']}" + model.to_loss_words(spec, step)
    else:
        finding.predicted_step_s, finding.predicted_by = removed(p["compress"])[0], "measured loss removed"
    finding.predicted_efficiency = p["compute"] / finding.predicted_step_s
    return finding


def _bucket_and_link_findings(d: Diagnosis, model: "Optional[_Model]", removed) -> list[Finding]:
    p, f, wall = d.parts, d.facts, d.wall_s
    out = []
    wire = p["comm_dp"]
    ov = f.get("overlap") or {}
    if f["dp"] <= 1:
        return out
    buckets, cap = f["buckets"], f["bucket_cap_mb"]
    fixable = 0.0
    grad_mb = (f["grad_bytes"] or 0) / 2**20
    # the gradient collectives the ranks issued per step (flight recorder), else the buckets the cap makes
    calls = f.get("grad_calls_per_step") or buckets
    target = BUCKET_CAP_MB  # DDP's default bucket, the one syncwise's options default to
    after_calls = max(1, math.ceil(grad_mb / target)) if grad_mb else 1
    too_small = calls is not None and calls > max(SMALL_CALLS, 2 * after_calls)
    if too_small:
        from ..plan.whatif import DDP_CALL_S

        w = model.full(bucket_cap_mb=target) if model is not None else None
        step = w.step_after_s if w is not None else None
        call_s = w.per_call_s if w is not None and w.per_call_s else DDP_CALL_S
        # DDP's per-bucket cost lands inside the backward (it is counted as compute): each collective's host cost,
        # measured per call on this kind of machine (slower as the run's compute is), times the calls a 25 MB
        # cap saves (the bytes stay the same: the wire time does not shrink with fewer buckets); the model's
        # answer (at the slow end of the overlap the run supports: one bucket hides nothing) bounds it
        per_call = (calls - after_calls) * call_s
        lost = min(max(0.0, wall - step), per_call) if step is not None else per_call
        fixable = min(lost, wire)
        seen = "the ranks issued" if f.get("grad_calls_per_step") else "the cap makes"
        out.append(Finding(
            "buckets_too_small", "gradient buckets too small", lost,
            f"bucket_cap_mb={cap:g} splits {grad_mb:.2f} MB of gradients into {calls:g} collectives per step ({seen}; "
            f"at least one per parameter tensor); each costs ~{call_s * 1e6:.0f} µs of host time inside the "
            f"backward (measured per call, scaled to this run's speed), ~{_ms((calls - after_calls) * call_s)} per "
            "step that the step's "
            f"compute hides, beside {_ms(wire)} of exposed communication for "
            f"{(f['dp_bytes_per_step'] or 0) / 2**20:.2f} MB",
            f"larger buckets: --dist.bucket_cap_mb={target:g} ({after_calls} collective"
            f"{'s' if after_calls > 1 else ''} per step)", f"--dist.bucket_cap_mb={target:g}",
            max(1e-9, wall - lost), p["compute"] / max(1e-9, wall - lost),
            "cost model" if step is not None else "measured per-call cost",
            {"buckets": buckets, "calls": calls, "overlap_credit": ov.get("credit")}))
    if wire <= 0:
        return out
    if not too_small and buckets is not None and buckets <= 2 and grad_mb >= 1.0 and f.get("dp_exposed_s", wire) > 0:
        out.append(_buckets_too_large(d, model, target=max(1.0, round(grad_mb / 4, 1)), grad_mb=grad_mb))
        fixable = out[-1].lost_s
    out.append(_link_finding(d, model, max(0.0, wire - fixable)))
    return out


def _buckets_too_large(d: Diagnosis, model: "Optional[_Model]", target: float, grad_mb: float) -> Finding:
    """All gradients in one or two buckets: the all-reduce starts after the backward. What that exposes is the
    finding's loss; whether smaller buckets win it back depends on the overlap this run's machine supports
    (``facts['overlap']``): smaller buckets are recommended only where the model, at that overlap and with the
    extra calls' host cost, predicts them faster; else the cheaper way to shorten the exposed all-reduce (fewer
    bytes: the cost model's best compressor) where it is predicted faster, else nothing."""
    p, f, wall = d.parts, d.facts, d.wall_s
    wire, buckets, cap = f.get("dp_exposed_s", p["comm_dp"]), f["buckets"], f["bucket_cap_mb"]
    ov = f.get("overlap") or {}
    backward = 2 / 3 * p["compute"] / max(f["grad_accum"], 1)
    span = model.span(bucket_cap_mb=target) if model is not None else None
    verdict = _verdict(span, wall)
    # what the layout exposes: all but the last of ~4 buckets could run during the backward
    exposed_by_layout = min(wire * (1 - 1 / 4), backward, wire)
    lost = min(max(0.0, wall - span[1]), wire) if verdict == "faster" else exposed_by_layout
    evidence = (f"bucket_cap_mb={cap:g} puts all {grad_mb:.1f} MB of gradients in {buckets} bucket"
                f"{'s' if buckets > 1 else ''}: the all-reduce starts only when the backward has ended, so none of "
                f"its {_ms(wire)} hides behind the ~{_ms(backward)} backward; overlap on this machine: "
                f"{ov.get('why') or 'unknown'}")
    # the title names what the recommendation acts on: the buckets where smaller ones are predicted to help, else the
    # exposed all-reduce itself (issue 43 row 4: "buckets too large" then "smaller buckets are predicted slower")
    title = ("gradient buckets too large" if verdict == "faster" else
             "gradient all-reduce exposed after the backward (one or two buckets; smaller ones would not hide it here)"
             if verdict == "slower" else "gradient all-reduce exposed after the backward (one or two buckets)")
    finding = Finding("buckets_too_large", title, lost, evidence,
                      details={"buckets": buckets, "overlap_credit": ov.get("credit"), "verdict": verdict,
                               "smaller_buckets_range_s": list(span) if span else None})
    if verdict == "faster":
        finding.recommendation = f"smaller buckets, so all but the last overlap the backward: --dist.bucket_cap_mb=" \
            f"{target:g}"
        finding.flag, finding.predicted_step_s, finding.predicted_by = f"--dist.bucket_cap_mb={target:g}", span[1], \
            "cost model (overlap as measured)"
    else:
        why = (f"smaller buckets (--dist.bucket_cap_mb={target:g}) are predicted slower here "
               f"({_range_words(span)} against {_ms(wall)}: their reductions would not hide, and each adds a call)"
               if verdict == "slower" and span else
               f"this run cannot show whether smaller buckets (--dist.bucket_cap_mb={target:g}) would hide behind "
               "the backward" + (f" (predicted {_range_words(span)} against {_ms(wall)})" if span else ""))
        best = model.best_compressor(exclude=f["compressor"]) if model is not None else None
        if best is not None:
            spec, step = best
            finding.recommendation = (f"{why}; fewer bytes shorten the exposed all-reduce: --compress {spec}"
                                      + model.to_loss_words(spec, step))
            finding.flag, finding.predicted_step_s, finding.predicted_by = f"--compress {spec}", step, "cost model"
        else:
            finding.recommendation = why + "; no change is predicted to help"
            finding.predicted_by = "cost model: no change predicted to help" if span else "not priced"
    if finding.predicted_step_s is not None:
        finding.predicted_efficiency = p["compute"] / finding.predicted_step_s
    return finding


def _link_finding(d: Diagnosis, model: "Optional[_Model]", link_lost: float) -> Finding:
    """The exposed communication the buckets do not explain, split by parallel dimension (dp, fsdp, tp make up the
    exposed communication; the pipeline's and the expert all-to-alls' waits are shown beside them): the title names
    the dimension whose traffic is exposed most; a compressor is recommended for gradient (dp) traffic, which is
    what it shrinks."""
    p, f, wall = d.parts, d.facts, d.wall_s
    wire = p["comm_dp"]
    bw = f["effective_bandwidth_bytes_s"]
    where = "the network lab's shaped link" if f["lab"] else "the link between the ranks"
    dims = f.get("by_dimension") or {}
    exposed = {k: v["exposed_s"] for k, v in dims.items() if k in ("dp", "fsdp", "tp") and v.get("exposed_s")}
    total = sum(exposed.values())
    split = {k: link_lost * v / total for k, v in exposed.items()} if total > 0 else {"dp": link_lost}
    top = max(split, key=split.get)
    per_dim = []
    for k in DIMENSIONS:
        v = dims.get(k)
        if not v or not (v.get("exposed_s") or v.get("bytes_per_step")):
            continue
        text = f"{k} ({WORDS[k]}) {_ms(v['exposed_s'] or 0.0)} exposed"
        if v.get("comm_s") is not None:
            text += f" of {_ms(v['comm_s'])}"
        if v.get("bytes_per_step") is not None:
            text += f", {v['bytes_per_step'] / 2**20:.2f} MB"
        per_dim.append(text)
    evidence = (f"exposed communication is {_ms(wire)} per step ({_pct(wire / wall)} of the step) for "
                f"{(f['dp_bytes_per_step'] or 0) / 2**20:.2f} MB of gradients sent per rank")
    if per_dim:
        evidence += "; by dimension (mean rank, per step): " + "; ".join(per_dim)
    if bw:
        evidence += f"; {where} moves {bw * 8 / 1e6:,.0f} Mbit/s effective ({bw / 2**20:,.1f} MiB/s)"
    names = [k for k in sorted(split, key=split.get, reverse=True) if split[k] >= 0.1 * link_lost] or [top]
    title = "slow or saturated link: " + " and ".join(f"{k} ({WORDS[k]})" for k in names) + " traffic exposed"
    rec = {"dp": "send fewer gradient bytes (a gradient compressor), or a faster / less shared link",
           "fsdp": "FSDP2's gathers and reduce-scatters are exposed: shard over fewer ranks (HSDP: --parallel."
                   "dp_shard within a node, replicas across), or a faster link",
           "tp": "tensor-parallel collectives are exposed: keep tp within the fastest link (a node), or a lower "
                 "--parallel.tp"}[top]
    finding = Finding("link", title, link_lost, evidence, rec,
                      details={"effective_bandwidth_bytes_s": bw, "dimension": top,
                               "lost_by_dimension_s": split, "by_dimension": dims})
    change = _fsdp_change(d, split["fsdp"]) if top == "fsdp" else None
    if change is not None:
        finding.details["fsdp_change"] = change
        finding.evidence += "; " + change["attributed"]
    best = model.best_compressor(exclude=f["compressor"]) if model is not None and top == "dp" else None
    if change is not None and change.get("flag"):
        finding.flag, finding.predicted_step_s = change["flag"], change["predicted_step_s"]
        finding.predicted_by = change["predicted_by"]
        finding.recommendation = change["words"]
    elif best is not None:
        spec, step = best
        finding.flag, finding.predicted_step_s, finding.predicted_by = f"--compress {spec}", step, "cost model"
        finding.recommendation = f"compress the gradients: --compress {spec}" + model.to_loss_words(spec, step)
    else:
        if model is not None and model.measured is not None and top == "dp":
            finding.recommendation = (f"no compressor is predicted ≥ 3 % sooner to fp32 DDP's loss than "
                                      f"{f['compressor']} here (--compress auto's terms: step × steps needed); "
                                      "a faster or less shared link")
        finding.predicted_step_s, finding.predicted_by = max(1e-9, wall - link_lost), "measured loss removed"
    finding.predicted_efficiency = p["compute"] / finding.predicted_step_s
    return finding


def _fsdp_change(d: Diagnosis, lost_s: float) -> Optional[dict[str, Any]]:
    """FSDP2's exposed traffic (the link finding's 'fsdp' share, ``lost_s``): its bytes per step by hop as the
    planner prices them for the run's layout (``plan.cost.fsdp_plan`` / ``fsdp_hop_bytes``, the runtime's rules),
    and the compression change predicted to help most — the quantized reduce-scatter (``--compress int8``, hierarchical
    on nodes × ranks), int8 weight gathers (``--parallel.fsdp_gather=int8``), backward's gathers inside the node
    (``--parallel.fsdp_reshard=node``), or all of them — among those the layout owner accepts. Predicted: the exposed
    FSDP2 time scales with the bytes on the hop that carries it (cross-node on > 1 node, all bytes on one), the rest
    of the step as measured; codec time is not priced here (the cost model's on a catalog accelerator is not this
    run's). Recommended when ≥ 3 % sooner (``plan.strategy.MIN_GAIN``). None when the run's layout is not FSDP2's or
    cannot be read."""
    import dataclasses

    from .. import layout as owner
    from ..plan.cost import fsdp_hop_bytes, fsdp_plan
    from ..plan.layout import SYNCWISE, Layout
    from ..plan.strategy import MIN_GAIN, job_cloud

    f, world = d.facts, d.world_size
    par = d.run.config.get("parallel", {}) or {}
    keys = {fl.name for fl in dataclasses.fields(owner.Layout)} - {"dp_replicate", "compress", "sync"}
    try:
        lay = owner.Layout.of(compress=f["compressor"], **{k: v for k, v in par.items() if k in keys})
        lay = dataclasses.replace(lay, dp_replicate=max(1, world // (lay.pp * lay.tp * lay.dp_shard))).check(world)
    except (ConfigError, TypeError, ValueError):
        return None
    if lay.dp_shard < 2 or lay.pp > 1:
        return None
    hops = str(f.get("comm_hops") or "")
    nodes = int(hops.split()[0]) if hops[:1].isdigit() and world % int(hops.split()[0]) == 0 else 1
    cloud = job_cloud(nodes, world // nodes)
    M = int(f.get("grad_accum") or 1)
    hop = "cross" if nodes > 1 else None

    def carried(o: owner.Layout) -> float:
        planned = Layout.of_owner(o)
        b = fsdp_hop_bytes(fsdp_plan(cloud, planned, SYNCWISE), planned, SYNCWISE, 1.0, M)
        return b[hop] if hop else b["intra"] + b["cross"]

    before = carried(lay)
    base = fsdp_hop_bytes(fsdp_plan(cloud, Layout.of_owner(lay), SYNCWISE), Layout.of_owner(lay), SYNCWISE, 1.0, M)
    where = f"{nodes} nodes × {world // nodes}" if nodes > 1 else "one node"
    out: dict[str, Any] = {"layout_nodes": nodes, "priced_share_cross": base["cross"] / max(base["cross"] +
                                                                                           base["intra"], 1e-30)}
    out["attributed"] = (f"FSDP2 (dp_shard {lay.dp_shard}, {where}): {_pct(out['priced_share_cross'])} of its "
                         "bytes cross nodes as the planner prices its rings and all-to-alls")
    steps: dict[str, dict] = {}
    if lay.dp_replicate == 1 and lay.compress.name in owner.FSDP_REDUCE_DTYPES:
        steps["--compress int8"] = {"compress": owner.parse_compress("int8")}
    if lay.fsdp_gather in ("fp32", "bf16"):
        steps["--parallel.fsdp_gather=int8"] = {"fsdp_gather": "int8"}
    if nodes > 1 and lay.fsdp_reshard == "all":
        steps["--parallel.fsdp_reshard=node"] = {"fsdp_reshard": "node"}
    if len(steps) > 1:
        steps[" ".join(steps)] = {k: v for c in list(steps.values()) for k, v in c.items()}
    best = None
    for flag, kw in steps.items():
        try:
            o = dataclasses.replace(lay, **kw).check(world)
            if kw.get("fsdp_reshard") == "node":
                owner.node_reshard(o, world // nodes)
        except ConfigError:
            continue
        ratio = carried(o) / before if before > 0 else 1.0
        step = max(1e-9, d.wall_s - lost_s * (1.0 - ratio))
        if best is None or step < best[1]:
            best = (flag, step, ratio)
    if best is None:
        return out
    flag, step, ratio = best
    out.update(predicted_step_s=step, bytes_ratio=ratio, predicted_by="cost model: the exposed FSDP2 time × the "
               f"priced {'cross-node ' if hop else ''}byte ratio (plan.cost.fsdp_hop_bytes); codec time not priced")
    if step <= MIN_GAIN * d.wall_s:
        out["flag"] = flag
        out["words"] = (f"compress FSDP2's collectives: {flag} — {1 / ratio:.1f}× fewer "
                        f"{'cross-node ' if hop else ''}bytes priced for its gathers and reduce-scatter, predicted "
                        f"{_ms(step)} per step (int8 rounds the gradients and the computed weights once each, with "
                        "fp32 sums and fp32 master weights: docs/parallelism.md's bounds)")
    return out


# ---------------------------------------------------------------------------------------------- the cost model
class _Model:
    """``syncwise.plan.whatif`` on this run (None predictions when the run cannot be described to it).

    What the run cannot tell the model is bracketed, and a prediction is the range over the bracket's ends:
    the overlap credit (``facts['overlap']``; unknown: 0 and 1) and, for a change of micro-batches, a micro-batch's
    fixed host cost (``facts['microbatch_fixed']``; unknown: 0 and the most the run's micro-batch time leaves
    beyond its FLOPs at the accelerator's peak). ``whatif`` answers the range's slow end, so a change is
    recommended only where every end the measurements allow predicts it faster."""

    def __init__(self, d: Diagnosis):
        self.d, self.error, self.measured = d, "", None
        self.overlaps: list[float] = [0.0, 1.0]
        self.fixed: list[float] = [0.0]
        self.fixed_known = False
        try:
            self.measured = _measured(d)
            self._calibrate()
        except Exception as e:  # a user model, an old config: doctor still diagnoses, without predictions
            self.error = f"{type(e).__name__}: {e}"
            self.measured = None

    def _calibrate(self) -> None:
        """The overlap credit and the micro-batch cost bracket from the run's evidence (facts)."""
        import dataclasses

        from ..plan.whatif import _compute_part, calibrated_cloud, predict, whatif

        f, m = self.d.facts, self.measured
        ov = f["overlap"]
        if ov["credit"] is None and ov.get("measured"):
            before = whatif(m, self.d.wall_s).before
            model_hidden = max(0.0, before.info.get("dp_comm_total", 0.0) - before.breakdown["dp_comm_exposed"])
            ov["credit"] = min(1.0, ov["hidden_s"] / model_hidden) if model_hidden > 0 else 1.0
            ov["why"] += f": {ov['credit']:.0%} of the {model_hidden * 1e3:,.1f} ms the cost model would hide"
        if ov["credit"] is not None:
            self.overlaps = [ov["credit"]]
        mb = f["microbatch_fixed"]
        if mb["fixed_s"] is not None:
            self.fixed, self.fixed_known = [mb["fixed_s"]], True
        else:
            # at most: the run's busy time per micro-batch beyond its FLOPs at the accelerator's peak (where the
            # model cannot say, all of it)
            M = max(m.layout.microbatches or 1, 1)
            try:
                cloud, training = calibrated_cloud(m)
                p = predict(cloud, m.model, m.layout, m.global_batch, m.seq_len, training=training,
                            syncwise_rules=False, matmul_efficiency=1.0)
                flops_s = _compute_part(p)
            except Exception:
                flops_s = 0.0
            # A peak that explains (nearly) all the busy time bounds nothing: the catalog's cpu-lab peak is the
            # measured training throughput, not a hardware peak, so "beyond its FLOPs" collapses to 0 there and the
            # bracket would price extra micro-batches as free (pipeline_bubble row of benchmarks/doctor_fixes.py:
            # 8 micro-batches predicted 91 ms, measured 143 -> 163 ms). Then the bound is all of it.
            if flops_s >= PEAK_EXPLAINS_ALL * m.compute_s:
                flops_s, mb["bound_by"] = 0.0, "all of its busy time: the accelerator's peak is an effective rate"
            else:
                mb["bound_by"] = "its time beyond its FLOPs at the accelerator's peak"
            mb["bound_s"] = max(0.0, (m.compute_s - flops_s) / M)
            self.fixed = [0.0, mb["bound_s"]]
        self.measured = dataclasses.replace(m, overlap=self.overlaps[0], microbatch_fixed_s=self.fixed[0])

    def _scenarios(self, change: dict[str, Any]) -> list:
        import dataclasses

        fixed = self.fixed if "microbatches" in change else self.fixed[:1]
        return [dataclasses.replace(self.measured, overlap=o, microbatch_fixed_s=c)
                for o in self.overlaps for c in fixed]

    def _all(self, **change: Any) -> list:
        """The cost model's ``WhatIf`` for ``change`` at every end of the bracket ([] when it cannot answer)."""
        if self.measured is None:
            return []
        from ..plan.whatif import whatif
        out = []
        for m in self._scenarios(change):
            try:
                out.append(whatif(m, self.d.wall_s, **change))
            except Exception as e:
                self.d.notes.append(f"cost model: {change}: {type(e).__name__}: {e}")
                return []
        return out

    def _step(self, w, change: dict[str, Any]) -> float:
        step = w.step_after_s
        if "compress" in change:
            step -= self.d.parts["compress"] - min(self.d.parts["compress"], w.before.breakdown["compress_compute"])
        return max(step, 1e-9)

    def span(self, **change: Any) -> Optional[tuple[float, float]]:
        """The predicted wall step after ``change`` at the bracket's fast and slow ends (None: no prediction)."""
        steps = [self._step(w, change) for w in self._all(**change)]
        return (min(steps), max(steps)) if steps else None

    def whatif(self, **change: Any) -> Optional[float]:
        """The predicted wall step after ``change`` (the measured wall step moved by the model's difference; a new
        compressor also drops the measured compression compute the model under- or over-predicted before): the
        slow end of what the run's evidence allows."""
        sp = self.span(**change)
        return sp[1] if sp is not None else None

    def full(self, **change: Any):
        """The cost model's whole ``WhatIf`` for ``change`` at the slow end (None without a model or an answer)."""
        ws = self._all(**change)
        return max(ws, key=lambda w: w.step_after_s) if ws else None

    def best_compressor(self, exclude: str, also: tuple[str, ...] = ()) -> Optional[tuple[str, float]]:
        """The compressor predicted soonest to fp32 DDP's loss — ``--compress auto``'s terms (``plan.strategy``):
        the predicted step × the steps it needs (the convergence table's measured ratio to fp32 DDP's steps), so a
        faster step that needs 1.6× the steps (PowerSGD on the table's run) loses to one that needs 1.0× (issue 43
        row 4). Candidates: ``also`` and the table's compressors that reached the loss; recommended only when at
        least 3 % sooner than the run's own compressor by the same terms (``plan.strategy.MIN_GAIN``: closer is
        inside the model's error). ``(spec, predicted step)``; its steps ratio: :meth:`steps_ratio`."""
        from ..plan.strategy import MIN_GAIN

        ratio = self.steps_ratio
        current = ratio(exclude)
        current = 1.0 if current is None else current  # not in the table: priced as fp32's (said in the text)
        best = None
        for spec in (*also, *self._table_compressors()):
            if spec_name(spec) == spec_name(exclude) or ratio(spec) is None:
                continue
            step = self.whatif(compress=spec)
            if step is not None and (best is None or step * ratio(spec) < best[1] * ratio(best[0])):
                best = (spec, step)
        if best is None or best[1] * ratio(best[0]) > MIN_GAIN * self.d.wall_s * current:
            return None
        return best

    def _table(self):
        """The convergence model auto ranks with (``plan.strategy.load_convergence``); None when it cannot be read."""
        if not hasattr(self, "_convergence"):
            from ..plan.strategy import load_convergence
            try:
                self._convergence = load_convergence()
            except SyncwiseError:
                self._convergence = None
        return self._convergence

    def horizon(self) -> int:
        """The run's configured steps (its ``train.steps``; else the steps it ran): where the steps are predicted."""
        train = self.d.run.config.get("train", {}) if isinstance(self.d.run.config, dict) else {}
        return int(train.get("steps") or self.d.run.summary.get("steps") or 0) or 0

    def replicas(self) -> Optional[int]:
        """The run's data-parallel replicas (None: not described to the cost model)."""
        if self.measured is None:
            return None
        lay = self.measured.layout
        return max(1, lay.dp_replicate * lay.dp_shard)

    def _table_compressors(self) -> tuple[str, ...]:
        """The convergence model's compressors syncwise's hook runs (not its sync strategies, nor torch's hooks)."""
        from ..layout import METHODS
        from ..plan.cost import CODEC_COST

        table = self._table()
        if table is None:
            return COMPRESSORS
        # (CODEC_COST prices syncwise's codecs and torch's hooks; torchft's strategies are not in it)
        return tuple(spec for spec in sorted(table.a) if spec_name(spec) not in METHODS
                     and spec_name(spec) in CODEC_COST and not names_torch_hook(spec))

    def _prediction(self, spec: str):
        table = self._table()
        if table is None:
            return None
        key = spec if spec in table.a else next((k for k in sorted(table.a) if spec_name(k) == spec_name(spec)),
                                                None)
        return table.predict(key, self.horizon() or None, self.replicas()) if key is not None else None

    def steps_ratio(self, spec: str) -> Optional[float]:
        """Steps to fp32 DDP's loss relative to fp32 DDP's at the run's horizon and replicas (the convergence model;
        ``none``: 1); None when the model has no point prediction for it (never reached, or not in its data; a spec
        with other options: its name's entry)."""
        if spec_name(spec) == "none":
            return 1.0
        if self._table() is None:
            return 1.0 if spec in COMPRESSORS else None
        pr = self._prediction(spec)
        return pr.ratio if pr is not None and pr.reached else None

    def steps_band(self, spec: str) -> tuple[float, float]:
        """The convergence model's 90 % band of :meth:`steps_ratio` (the point both ways when it has none)."""
        r = self.steps_ratio(spec) or 1.0
        pr = self._prediction(spec) if spec_name(spec) != "none" else None
        return (pr.low, pr.high) if pr is not None and pr.reached else (r, r)

    def to_loss_words(self, spec: str, step: float) -> str:
        """'(predicted 0.80× (band 0.70–0.93×) the run's time to fp32 DDP's loss: 412 ms per step × 1.00× the steps
        (band 0.97–1.03); basis: the cost model on this run's measurements, convergence model fitted on ...)' — the
        terms the recommendation was chosen by, with what they rest on and how far they may be off."""
        from ..plan.strategy import convergence_words

        mine = self.steps_ratio(self.d.facts["compressor"]) or 1.0
        r = self.steps_ratio(spec) or 1.0
        lo_r, hi_r = self.steps_band(spec)
        fast, slow = self.span(compress=spec) or (step, step)
        base = self.d.wall_s * mine
        table = self._table()
        where = (f"; convergence: {convergence_words(table, self.horizon() or None, self.replicas())}"
                 if table is not None else "")
        steps_band = f" (band {lo_r:.2f}–{hi_r:.2f})" if hi_r > lo_r else ""
        return (f" (predicted {step * r / base:.2f}× (band {fast * lo_r / base:.2f}–{slow * hi_r / base:.2f}×) the "
                f"run's time to fp32 DDP's loss: {_ms(step)} per step × {r:.2f}× the steps{steps_band}; step: the "
                f"cost model on this run's measurements, the band over what they leave open{where}; the rule of "
                "--compress auto)")


def _measured(d: Diagnosis):
    """The run as ``syncwise.plan.whatif.Measured`` (its preset, layout, batch and measured numbers)."""
    import dataclasses

    from .. import layout as owner
    from ..plan.layout import Layout
    from ..plan.model import from_preset
    from ..plan.whatif import Measured

    run, f = d.run, d.facts
    if not f["preset"] or not f["seq_len"] or not f["batch_size"]:
        raise ValueError(f"{run.path} has no config.json naming a preset, seq_len and batch_size")
    seq = int(f["seq_len"])
    model = from_preset(f["preset"]).with_seq_len(seq)
    # The run's [parallel] table as the layout owner reads it (its keys are syncwise.layout.Layout's fields),
    # dp_replicate the ranks the others leave; the planner adds micro-batch size and accumulation.
    par = run.config.get("parallel", {})
    keys = {fl.name for fl in dataclasses.fields(owner.Layout)} - {"dp_replicate", "compress", "sync"}
    lay = owner.Layout.of(compress=f["compressor"], **{k: v for k, v in par.items() if k in keys})
    pp = lay.pp
    replicate = max(1, d.world_size // (pp * lay.tp * lay.dp_shard))
    batch, accum = int(f["batch_size"]), f["grad_accum"]
    M = lay.microbatches_per_step if pp > 1 else accum
    layout = Layout.of_owner(dataclasses.replace(lay, dp_replicate=replicate), microbatches=M,
                             micro_batch=batch // M if pp > 1 else batch)
    global_batch = batch * replicate * lay.dp_shard * (1 if pp > 1 else accum)
    compute = d.parts["compute"] + (d.parts["pp_bubble"] if pp > 1 else 0.0)
    if pp > 1:  # the model predicts the bubble from the compute: give it the busy part only
        compute = d.parts["compute"]
    return Measured(model=model, layout=layout, global_batch=global_batch, seq_len=seq, compute_s=compute,
                    moved_bytes=f["moved_bytes_per_step"], wire_s=f["wire_time_s"],
                    bucket_cap_mb=f["bucket_cap_mb"], grad_calls=f.get("grad_calls_per_step"))
