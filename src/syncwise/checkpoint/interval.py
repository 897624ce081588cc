"""When to checkpoint: fixed steps, fixed seconds, or the Young/Daly optimum.

With a checkpoint cost δ (seconds training is blocked per save) and a mean time between failures
M (of the whole job), the expected loss per unit time of checkpointing every τ seconds is about
δ/τ + τ/(2M): the save overhead plus half an interval of lost work per failure. Its minimum is
Young's interval τ* = √(2·δ·M); Daly's refinement adds higher-order terms that matter only when
δ is not small against M.
"""
from __future__ import annotations

import math
import re

from ..errors import ConfigError

DEFAULT_MTBF_S = 4 * 3600.0
"""Job MTBF assumed when none is given: 4 h, a pessimistic figure for a multi-node cloud job (e.g.
a per-node MTBF of a few weeks over ~100 nodes). Set ``mtbf_s`` from your cluster's failure log."""

_SECONDS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")


def young_daly_interval_s(save_cost_s: float, mtbf_s: float, refined: bool = False) -> float:
    """Optimal seconds between checkpoints: √(2·δ·M) (Young), or Daly's higher-order form."""
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_cost_s >= 0 and mtbf_s > 0, got {save_cost_s}, {mtbf_s}")
    young = math.sqrt(2.0 * save_cost_s * mtbf_s)
    if not refined:
        return young
    if save_cost_s >= 2.0 * mtbf_s:  # Daly: checkpointing costs more than it saves
        return mtbf_s
    r = save_cost_s / (2.0 * mtbf_s)
    return young * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_cost_s


ACCEPTED = "0 (only the final checkpoint), a positive int (steps), a duration like '30s', '5m', '1h', or 'dynamic'"


def parse_interval(interval: int | str) -> tuple[str, float]:
    """Normalise ``interval``: int steps, '30s'/'5m'/'1h' seconds, 'dynamic', or 0 (only the final checkpoint).

    Returns ('steps', n), ('seconds', s), ('dynamic', 0) or ('final', 0): with 'final' no checkpoint is ever
    due during the run; the training loop's own save at the end is the only one.
    """
    if isinstance(interval, bool):
        raise ConfigError("interval", interval, ACCEPTED)
    if isinstance(interval, int):
        if interval < 0:
            raise ConfigError("interval", interval, ACCEPTED)
        return ("steps", float(interval)) if interval else ("final", 0.0)
    if isinstance(interval, str):
        text = interval.strip()
        if text.lower() == "dynamic":
            return "dynamic", 0.0
        if text.isdigit() and text.isascii():
            return ("steps", float(int(text))) if int(text) > 0 else ("final", 0.0)
        m = _SECONDS_RE.match(interval.lower())
        if m and float(m.group(1)) > 0:
            return "seconds", float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
    raise ConfigError("interval", interval, ACCEPTED)


def interval_steps(kind: str, value: float, step_time_s: float, save_cost_s: float | None,
                   save_total_s: float | None, mtbf_s: float) -> int:
    """Steps between checkpoints for a policy, from agreed step time and measured save costs.

    For 'dynamic' the Young interval uses the *blocking* save cost (what training loses); any
    time-based interval is also kept at least as long as a whole save so that two saves are
    never in flight at once.
    """
    if kind == "steps":
        return max(1, int(value))
    step_time_s = max(step_time_s, 1e-6)
    if kind == "seconds":
        seconds = value
    else:
        seconds = young_daly_interval_s(save_cost_s or 0.0, mtbf_s)
    if save_total_s:
        seconds = max(seconds, save_total_s)
    return max(1, math.ceil(seconds / step_time_s))
