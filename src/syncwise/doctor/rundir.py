"""Reading a run directory for ``syncwise doctor``: what ``syncwise train`` / ``OptimizedTrainer`` wrote.

Required: ``metrics.jsonl`` (rank 0's rows, at least one) and ``summary.json``. Used when present:
``config.json`` (the resolved configuration; a Python-API run has none), ``ranks/rank{R}.jsonl`` and
``ranks/rank{R}.json`` (every rank's own step timings and collective totals, syncwise.metrics.ranklog).
Everything wrong is a ``SyncwiseError`` naming the path and what was expected.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SyncwiseError
from ..rundir import RunDir

EXPECTED = ("a run directory written by `syncwise train` or OptimizedTrainer(run_dir=...): metrics.jsonl and "
            "summary.json (config.json and ranks/ when present)")


@dataclass
class Run:
    """One run as doctor reads it."""

    path: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)   # rank -> its step rows
    totals: dict[int, dict[str, Any]] = field(default_factory=dict)        # rank -> ranks/rank{R}.json

    def cfg(self, section: str, key: str, default: Any = None) -> Any:
        """A value of config.json (``default`` when the run has no config or not that key)."""
        value = self.config.get(section, {})
        return value.get(key, default) if isinstance(value, dict) else default


# Fields doctor computes with: a row's timings, sizes and counts, and the summary's counts. A damaged or edited file
# that holds something else there is refused in one line (not a TypeError deep inside the analysis).
_NUMERIC_SUFFIXES = ("_s", "_ns", "_bytes", "_per_s", "_ms")
_NUMERIC_ROW_KEYS = frozenset({"step", "loss", "val_loss", "lr", "grad_norm", "micro_batch", "expert_imbalance",
                               "pp_bubble", "mfu", "tokens", "c"})
_NUMERIC_SUMMARY_KEYS = ("steps", "world_size", "params")


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _numbers_ok(row: dict[str, Any]) -> str | None:
    """The first key of ``row`` that should hold a number and does not (None when all do)."""
    for key, value in row.items():
        if (key in _NUMERIC_ROW_KEYS or key.endswith(_NUMERIC_SUFFIXES)) and not _is_number(value):
            return key
    return None


def _saves_ok(saves: Any) -> bool:
    return saves is None or (isinstance(saves, list) and all(
        isinstance(x, dict) and _is_number(x.get("step")) and _is_number(x.get("blocking_s")) for x in saves))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + "…"


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise SyncwiseError(f"doctor: cannot read {path} ({e.strerror or e}); expected {what}") from None
    except ValueError as e:
        raise SyncwiseError(f"doctor: {path} is not valid JSON ({e}); expected {what}") from None


def _jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(errors="replace").splitlines()  # binary junk: lines that are not JSON, below
    except OSError as e:
        raise SyncwiseError(f"doctor: cannot read {path} ({e.strerror or e}); expected {what}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines):  # a torn last line from a crash
                break
            raise SyncwiseError(f"doctor: {path} line {i} is not a JSON object; expected {what}") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) \
                or not isinstance(row.get("step_time_s"), (int, float)):
            raise SyncwiseError(f"doctor: {path} line {i} has no integer 'step' and numeric 'step_time_s'; "
                                f"expected {what}")
        bad = _numbers_ok(row)
        if bad is not None:
            raise SyncwiseError(f"doctor: {path} line {i}: {bad!r} is {_short(row[bad])}, not a number; expected "
                                f"{what}")
        rows.append(row)
    return rows


def load_run(path: "str | Path", live: bool = False) -> Run:
    """Read the run at ``path``; SyncwiseError naming the path and what is expected when it is not one.
    ``live``: the run may still be training (no summary.json yet: an empty summary; `doctor --follow`)."""
    p = Path(path)
    if not p.exists():
        raise SyncwiseError(f"doctor: {p} does not exist; expected {EXPECTED}")
    if not p.is_dir():
        raise SyncwiseError(f"doctor: {p} is not a directory; expected {EXPECTED}")
    metrics = RunDir(p).metrics
    if not metrics.is_file():
        raise SyncwiseError(f"doctor: {p} has no metrics.jsonl; expected {EXPECTED}")
    what = "one JSON object per step with 'step' and 'step_time_s' (syncwise's metrics.jsonl)"
    rows = _jsonl(metrics, what)
    if not rows:
        raise SyncwiseError(f"doctor: {metrics} holds no steps; expected {what} (did the run train at least one "
                            "step?)")
    summary_path = RunDir(p).summary
    if live and not summary_path.is_file():
        summary: Any = {}
    elif not summary_path.is_file():
        raise SyncwiseError(f"doctor: {p} has no summary.json (the run did not finish, or is still running: "
                            f"`syncwise doctor --follow` watches a live run); expected {EXPECTED}")
    else:
        summary = _json(summary_path, "the run's final summary (a JSON object)")
    if not isinstance(summary, dict):
        raise SyncwiseError(f"doctor: {summary_path} is not a JSON object; expected the run's final summary")
    for key in _NUMERIC_SUMMARY_KEYS:
        if not _is_number(summary.get(key)):
            raise SyncwiseError(f"doctor: {summary_path}: {key!r} is {_short(summary[key])}, not a number; expected "
                                "the run's final summary")
    if not _saves_ok(summary.get("checkpoint_saves")):
        raise SyncwiseError(f"doctor: {summary_path}: 'checkpoint_saves' is not a list of saves (objects with a "
                            "numeric 'step' and 'blocking_s'); expected the run's final summary")
    config: dict[str, Any] = {}
    if RunDir(p).config.exists():
        config = _json(p / "config.json", "the run's resolved configuration (a JSON object)")
        if not isinstance(config, dict):
            raise SyncwiseError(f"doctor: {p / 'config.json'} is not a JSON object; expected the run's resolved "
                                "configuration")
    run = Run(p, rows, summary, config)
    rank_dir = RunDir(p).ranks
    if rank_dir.is_dir():
        for f in sorted(rank_dir.iterdir()):
            if not f.is_file():
                continue
            m = re.fullmatch(r"rank(\d+)\.(jsonl|json)", f.name)
            if not m:
                continue
            if m.group(2) == "jsonl":
                run.ranks[int(m.group(1))] = _jsonl(f, what)
            else:
                data = _json(f, "a rank's totals (syncwise.metrics.RankLog)")
                if isinstance(data, dict) and _saves_ok(data.get("checkpoint_saves")):
                    run.totals[int(m.group(1))] = data
    run.ranks = {r: rows for r, rows in run.ranks.items() if rows}
    if not run.ranks:  # a run from before per-rank logs: rank 0's rows are all there is
        run.ranks = {0: rows}
    return run
