"""`syncwise doctor --follow RUN_DIR`: diagnose a run while it trains, and say when the top cause changes.

Every ``interval_s`` the run directory is read again (``load_run(live=True)``: no summary.json needed) and the
last ``window`` steps are diagnosed — rank 0's metrics, every rank's own rows and their flight-recorder arrivals
(written every few seconds by syncwise.comm.arrivals) — so a straggler that starts mid-run is named from the steps
since it started, not diluted by the run's healthy past. One line is printed (and, with ``emit``, one JSON
object handed over) whenever the top cause or its rank changes; the loop ends when summary.json appears (the run
finished), or after ``max_s``.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import SyncwiseError
from .analyze import diagnose
from .rundir import Run, load_run


def window_of(run: Run, window: int) -> Run:
    """The run's last ``window`` steps (rank 0's rows and every rank's)."""
    last = max(row["step"] for row in run.rows)
    keep = lambda rows: [r for r in rows if r["step"] > last - window]  # noqa: E731
    return dataclasses.replace(run, rows=keep(run.rows), ranks={r: keep(v) for r, v in run.ranks.items()})


def check(path: "str | Path", window: int = 20, predict: bool = False) -> Optional[dict[str, Any]]:
    """One look at a live run: its top cause over the last ``window`` steps (None while it has no steps yet)."""
    try:
        run = load_run(path, live=True)
    except SyncwiseError:
        return None
    d = diagnose(window_of(run, window), predict=predict)
    top = d.top
    return {"time": time.time(), "step": max(r["step"] for r in run.rows), "finished": bool(run.summary),
            "cause": top.cause if top else None, "title": top.title if top else None,
            "rank": top.details.get("rank") if top else None,
            "share": top.lost_s / d.wall_s if top and d.wall_s else 0.0, "efficiency": d.efficiency}


def follow(path: "str | Path", interval_s: float = 2.0, window: int = 20, max_s: Optional[float] = None,
           emit: Optional[Callable[[dict[str, Any]], None]] = None,
           say: Callable[[str], None] = print) -> Optional[dict[str, Any]]:
    """Watch the run at ``path`` until it finishes (or ``max_s``); returns the last look."""
    start, last_key, look = time.time(), None, None
    while True:
        look = check(path, window)
        if look is not None:
            key = (look["cause"], look["rank"])
            if key != last_key:
                last_key = key
                what = look["title"] or "no cause over 5 % of the step"
                share = f" ({100 * look['share']:.0f} % of the step)" if look["cause"] else ""
                say(f"[{time.strftime('%H:%M:%S', time.localtime(look['time']))} step {look['step']}] {what}{share}; "
                    f"efficiency {look['efficiency']:.2f}")
                if emit is not None:
                    emit(look)
            if look["finished"]:
                return look
        if max_s is not None and time.time() - start >= max_s:
            return look
        time.sleep(interval_s)
