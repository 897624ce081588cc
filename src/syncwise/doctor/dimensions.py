"""Communication per parallel dimension (dp, fsdp, tp, pp, ep), from every rank's own log: the report's
"communication by dimension" lines and ``--json``'s ``by_dimension``.

For each dimension over the diagnosis' steady steps: the job's bytes per step (every rank's summed), and per rank
(mean over ranks) the seconds in its collectives and the exposed seconds the step waited for them, with that
exposed time's share of the step. A time a run did not measure (DDP's built-in all-reduce's total, an exposed share
on a GPU) is None. What each field is: ``syncwise.train.meter.StepBytes``; docs/monitoring.md.
"""
from __future__ import annotations

import math
from typing import Any, Optional

DIMENSIONS = ("dp", "fsdp", "tp", "pp", "ep")
WORDS = {"dp": "replicas", "fsdp": "FSDP2 shards", "tp": "tensor", "pp": "pipeline", "ep": "all-to-all"}


def _mean(values: list) -> Optional[float]:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def by_dimension(ranks: dict[int, list[dict[str, Any]]], steps: list[int]) -> dict[str, dict[str, Any]]:
    """``{dim: {"bytes_per_step", "comm_s", "exposed_s", "exposed_share"}}`` for the dimensions that sent anything
    in ``steps`` (rank logs: rank -> rows)."""
    use = set(steps)
    out: dict[str, dict[str, Any]] = {}
    for dim in DIMENSIONS:
        job_bytes, took, exposed, step_s = 0.0, [], [], []
        seen = False
        for rows in ranks.values():
            mine = [r for r in rows if r.get("step") in use]
            if not mine:
                continue
            sent = [r.get(f"comm_bytes_{dim}") for r in mine]
            if any(f"comm_bytes_{dim}" in r or f"comm_s_{dim}" in r for r in mine):
                seen = True
            job_bytes = math.nan if any(b is None and f"comm_bytes_{dim}" in r for b, r in zip(sent, mine)) \
                else job_bytes + sum(b or 0 for b in sent) / len(mine)
            took.append(_mean([r.get(f"comm_s_{dim}", 0.0) for r in mine]))
            exposed.append(_mean([r.get(f"comm_exposed_s_{dim}", 0.0) for r in mine]))
            step_s.append(_mean([r.get("step_time_s") or 0.0 for r in mine]))
        t, e, st = _mean(took), _mean(exposed), _mean(step_s)
        if not seen or (not job_bytes and not t):
            continue
        out[dim] = {"bytes_per_step": None if math.isnan(job_bytes) else job_bytes, "comm_s": t, "exposed_s": e,
                    "exposed_share": e / st if e is not None and st else None}
    return out


def lines(dims: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str, str]]:
    """Table rows: dimension, MB per step (job), ms per step, exposed ms, exposed share."""
    def ms(v: Optional[float]) -> str:
        return "?" if v is None else f"{v * 1e3:,.1f}"

    rows = []
    for dim, v in dims.items():
        b = v["bytes_per_step"]
        rows.append((f"{dim} ({WORDS[dim]})", "?" if b is None else f"{b / 1e6:,.2f}", ms(v["comm_s"]),
                     ms(v["exposed_s"]), "?" if v["exposed_share"] is None else f"{100 * v['exposed_share']:.0f} %"))
    return rows
