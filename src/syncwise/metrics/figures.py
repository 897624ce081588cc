"""A run's headline figures, computed by one rule for every door (issue 43 row 3): the trainer's summary
(``summary.json`` and its table), ``syncwise report`` and the progress line read their steady steps, tokens per
second and training time from here, so the same run shows the same numbers everywhere.

* **steady steps**: every step but the first tenth (one-off start-up costs: allocator warm-up, DDP's bucket rebuild;
  at least one, never all) and the compressor's or sync strategy's warm-up steps (PowerSGD's ``start_iter``: full
  gradients); a run that never left its warm-up keeps its steps after the first tenth;
* **tokens/s**: the job's tokens per second over the steady steps, Σ tokens / Σ step time (every rank's tokens: a
  row's ``tokens_per_s`` is the step's, the summary's and the report's the steady mean; the progress line shows the
  step's);
* **train time**: the sum of every step's time (``train_time_s``: the same axis for a resumed run as for one that
  never stopped). ``wall_time_s`` in the summary is something else: this invocation's wall clock, start-up,
  validation and checkpoints included.
* **bytes per hop**: a row's ``hop_bytes_intra`` / ``hop_bytes_cross`` (collectives inside one node / spanning
  nodes), the summary's ``hop_bytes_per_step_intra`` / ``_cross``; "× fewer bytes" against fp32 DDP is formed on
  the cross-node hop — what the slow link carries, what users pay for — when both runs span nodes
  (:func:`fewer_bytes`); on one node, or with the hops not known, on all bytes, and it says which.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


def steady_steps(count: int, first_step: int = 1, warmup: int = 0) -> tuple[list[int], list[int], bool]:
    """Of ``count`` consecutive steps numbered from ``first_step``: the indices of the steady ones, of those inside a
    ``warmup`` of that many steps, and whether the run never left it (then the steady ones are all but the cut)."""
    cut = min(count - 1, max(1, count // 10)) if count else 0
    steady = [i for i in range(cut, count) if first_step + i > warmup]
    in_warmup = [i for i in range(count) if first_step + i <= warmup]
    never_left = bool(warmup) and count > 0 and not steady
    if never_left:
        steady = list(range(cut, count))
    return steady, in_warmup, never_left


def tokens_per_s(tokens: Sequence[float], step_times: Sequence[float]) -> float:
    """The steady rate: Σ tokens / Σ step time (not the mean of the steps' rates, which a few fast steps inflate)."""
    return sum(tokens) / max(sum(step_times), 1e-9)


def train_time_s(step_times: Sequence[float]) -> float:
    """Training time: the sum of the step times."""
    return float(sum(step_times))


def fewer_bytes(base: dict[str, Any], run: dict[str, Any]) -> tuple[Optional[float], str]:
    """(fp32 DDP's bytes per step / the run's, which bytes) from two summaries (``summary.json``, or rows with its
    keys): 'cross-node' when both have a cross-node figure, else 'all bytes, one node' or 'all bytes, hops not
    known'. The ratio is None when either side is missing or the run sent nothing on that hop."""
    b_cross, r_cross = base.get("hop_bytes_per_step_cross"), run.get("hop_bytes_per_step_cross")
    if b_cross is not None and r_cross is not None:
        return (b_cross / r_cross if r_cross else None), "cross-node"
    hops = str(run.get("comm_hops") or base.get("comm_hops") or "")
    on = "all bytes, one node" if hops.startswith("one node") else "all bytes, hops not known"
    b, r = base.get("comm_bytes_per_step"), run.get("comm_bytes_per_step")
    return (b / r if b and r else None), on


def hop_means(rows: Sequence[dict[str, Any]]) -> Optional[dict[str, float]]:
    """Per-step means of metrics rows' bytes per hop (``{'intra', 'cross'}``, plus ``'unsplit'`` where some had no
    known hop); None when some row has no split (one node, an unknown topology, bytes not counted)."""
    if not rows or any("hop_bytes_cross" not in r for r in rows):
        return None
    out = {h: sum(r.get(f"hop_bytes_{h}") or 0 for r in rows) / len(rows) for h in ("intra", "cross", "unsplit")}
    if not out["unsplit"]:
        del out["unsplit"]
    return out
