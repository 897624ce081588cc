"""How far a prediction of ``syncwise plan`` can be off, and what it rests on.

The band is not a guess: it is the spread of measured ÷ predicted step time over the runs the cost model is
checked against (``benchmarks/plan_published.py``: the published large-scale runs of
``syncwise.plan.published.runs`` and vTrain's measured Megatron-DeepSpeed set, ``published.vtrain_runs``), split
by whether the job fits on one node or spans nodes (different terms dominate: kernels and tensor parallel inside
a node, the fabric across nodes). ``BANDS`` holds the 10th and 90th percentile of that ratio per regime, as
``benchmarks/plan_published.py`` computed and stored them in ``benchmarks/results/plan-published.json``
(``summary.bands``; tests/test_plan_uncertainty.py checks the two agree): a step predicted at *t* s measured
between *lo × t* and *hi × t* in 8 of 10 of those runs. Those runs used the catalog's numbers, so the band is
the catalog's; a cluster file measured by ``syncwise plan --calibrate`` removes the catalog's guesses about the
hardware (its error on the published set is not known), and the basis line says which one a prediction used.

Pure Python, no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cloud import ACCELERATORS, FABRICS, CloudConfig
from .search import human_time

#: quantiles of measured ÷ predicted step time kept as the band
QUANTILES = (0.1, 0.9)


@dataclass(frozen=True)
class Band:
    """measured ÷ predicted step time: ``lo`` and ``hi`` quantiles (QUANTILES) over ``runs`` checked runs."""

    regime: str
    lo: float
    hi: float
    runs: int


#: written by benchmarks/plan_published.py (its summary's "bands"); regime -> Band
BANDS: dict[str, Band] = {
    "one node": Band("one node", 0.878, 1.259, 1450),
    "multi-node": Band("multi-node", 0.923, 1.161, 129),
}


def regime(cloud: CloudConfig) -> str:
    """The band's regime of a cluster: "one node" or "multi-node"."""
    return "one node" if cloud.nodes == 1 else "multi-node"


#: per accelerator, where the checked runs hold at least ACCELERATOR_MIN_RUNS of it (written by
#: benchmarks/plan_published.py, its summary's "accelerator_bands"): the checked runs are mostly A100 (vTrain's
#: 1,549, Megatron-LM's, MT-NLG's), so the regime's band says little about another accelerator; an H100 plan takes
#: the spread of the H100 runs (llm-foundry's MPT tables, Llama 3, the MoE rows) instead
ACCELERATOR_MIN_RUNS = 8
ACCELERATOR_BANDS: dict[str, Band] = {
    "a100-80gb": Band("a100-80gb", 0.884, 1.257, 1567),
    "h100-sxm": Band("h100-sxm", 0.826, 1.433, 12),
}


def band_for(cloud: CloudConfig) -> Band:
    """The accelerator's band where its checked runs are enough and it is not the regime bands' own accelerator
    (A100), else the regime's."""
    own = ACCELERATOR_BANDS.get(cloud.accelerator.name)
    if own is not None and own.runs >= ACCELERATOR_MIN_RUNS and not cloud.accelerator.name.startswith("a100"):
        return own
    return BANDS[regime(cloud)]


def accelerator_bands(rows: list[dict]) -> dict[str, dict]:
    """Per accelerator of ``rows`` (``published.evaluate`` rows, their "accelerator"), the QUANTILES of measured ÷
    predicted step time, as :func:`bands` per regime."""
    out = {}
    for name in sorted({r["accelerator"] for r in rows}):
        ratios = [_ratio(r) for r in rows if r["accelerator"] == name]
        out[name] = {"lo": round(quantile(ratios, QUANTILES[0]), 3), "hi": round(quantile(ratios, QUANTILES[1]), 3),
                     "runs": len(ratios)}
    return out


def _ratio(r: dict) -> float:
    return 1 / (1 + r["error"]) if r["metric"] == "step_time_s" else 1 + r["error"]


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = q * (len(xs) - 1)
    i = int(pos)
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (pos - i)


def bands(rows: list[dict]) -> dict[str, dict]:
    """The bands of ``published.evaluate`` rows: per regime, the QUANTILES of measured ÷ predicted step time
    (error = predicted / reported − 1 in the publication's unit: measured ÷ predicted step is 1 / (1 + error) for
    step-time rows and 1 + error for TFLOP/s rows), rounded as BANDS holds them."""
    out = {}
    for name, one in (("one node", True), ("multi-node", False)):
        ratios = [(1 / (1 + r["error"]) if r["metric"] == "step_time_s" else 1 + r["error"]) for r in rows
                  if (r["nodes"] == 1) == one]
        out[name] = {"lo": round(quantile(ratios, QUANTILES[0]), 3), "hi": round(quantile(ratios, QUANTILES[1]), 3),
                     "runs": len(ratios)}
    return out


def basis(cloud: CloudConfig) -> str:
    """What the prediction rests on: the catalog's entries, a cluster file's own numbers, or a calibration."""
    acc, intra, inter = cloud.accelerator, cloud.intra_node, cloud.inter_node
    if acc.name.endswith("-measured") or intra.name.startswith("measured") or inter.name.startswith("measured"):
        return f"calibrated: measured by `syncwise plan --calibrate` ({acc.name}, {intra.name}, {inter.name})"
    changed = []
    if ACCELERATORS.get(acc.name) != acc:
        changed.append(acc.name)
    for fabric in (intra, inter):
        base = FABRICS.get(fabric.name)
        if base is None or dataclasses.replace(base, nics_per_node=fabric.nics_per_node, kind=fabric.kind) != fabric:
            changed.append(fabric.name)
    names = f"{acc.name}, {intra.name}" + ("" if cloud.nodes == 1 else f", {inter.nics_per_node} × {inter.name}")
    if changed:
        return f"catalog with the cluster file's own numbers for {', '.join(changed)} ({names}); not calibrated"
    return f"catalog: {names}; not calibrated"


def describe(step_time_s: float, mfu: float, cloud: CloudConfig) -> str:
    """One line: the step with its band (and the MFU's), how the band was derived, and the basis."""
    b = band_for(cloud)
    lo, hi = step_time_s * b.lo, step_time_s * b.hi
    return (f"predicted {human_time(step_time_s)}/step, likely {human_time(lo)} to {human_time(hi)} "
            f"({b.lo - 1:+.0%} / {b.hi - 1:+.0%}; MFU {mfu / b.hi:.0%} to {mfu / b.lo:.0%}): the 10th-90th percentile "
            f"of measured ÷ predicted over {b.runs:,} checked {b.regime} runs (benchmarks/plan_published.py); "
            f"basis: {basis(cloud)}")
