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
"""
from __future__ import annotations

from typing import Sequence


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
