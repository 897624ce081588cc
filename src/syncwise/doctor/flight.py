"""Aligning the ranks' flight-recorder dumps of a hung run (``RUN_DIR/flight/rank{R}.json``, ``comm/flight.py``):
the first collective the ranks disagree on, which ranks entered it and which did not.

Per process group (its name is the same on every rank), the collectives are matched by their per-group sequence
number (``collective_seq_id``: the same on every rank for the same collective). Over the window every dump still
holds (a ring can have dropped its oldest entries), the first sequence number that some member of the group did
not enter, or that the members entered as different ops or sizes, is the mismatch — torch's
``torch.distributed.flight_recorder`` analyzer matches the same way. A rank that left no dump (stopped, killed, or
ended before it could write one) is named as such: it cannot be said to have entered anything, so where every dump
agrees the collective named is the last one the dumping ranks entered on the group that timed out, and the ranks
without a dump are the ones it waited for. The hang reports the ranks wrote with their dumps are quoted once each
(identical ones merged): doctor adds to the watchdog's words, it does not repeat them.
Pure Python over JSON.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from ..rundir import RunDir

_FILE = re.compile(r"^rank(\d+)\.json$")


def load_dumps(run_dir: "str | Path") -> dict[int, dict[str, Any]]:
    """rank -> its dump (unreadable files skipped)."""
    where = RunDir(run_dir).flight
    out: dict[int, dict[str, Any]] = {}
    if not where.is_dir():
        return out
    for p in sorted(where.iterdir()):
        m = _FILE.match(p.name)
        if not m:
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("entries"), list):
            out[int(m.group(1))] = data
    return out


def _op(e: dict) -> str:
    return str(e.get("profiling_name") or "?")


#: frames that only carry a collective on its way (torch itself, syncwise's issuing and counting plumbing): the line
#: that issued it is the nearest frame outside them
_PLUMBING = ("/torch/", "/syncwise/comm/ops.py", "/syncwise/comm/counting.py")


def _frame(e: dict) -> Optional[str]:
    """The nearest frame outside torch and syncwise's collective plumbing: the line that issued the collective
    (else the nearest outside torch, else the innermost the recorder kept)."""
    frames = [str(f) for f in e.get("frames") or []]
    for skip in (_PLUMBING, _PLUMBING[:1]):
        for f in frames:
            if not any(p in f for p in skip):
                return f
    return frames[0] if frames else None


def _describe(e: dict, group: str) -> dict[str, Any]:
    return {"group": group, "seq": e.get("collective_seq_id"), "op": _op(e), "sizes": e.get("input_sizes"),
            "dtypes": e.get("input_dtypes"), "frame": _frame(e)}


def first_mismatch(dumps: dict[int, dict[str, Any]], world_size: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The first collective the ranks disagree on (see the module's docstring), or None with no dumps."""
    if not dumps:
        return None
    world = world_size or max(int(d.get("world_size") or 0) for d in dumps.values()) or (max(dumps) + 1)
    no_dump = [r for r in range(world) if r not in dumps]
    members: dict[str, set[int]] = {}
    seqs: dict[str, dict[int, dict[int, dict]]] = {}     # group -> rank -> seq -> entry
    for rank, d in dumps.items():
        for name, ranks in (d.get("groups") or {}).items():
            members.setdefault(str(name), set()).update(int(r) for r in ranks)
        for e in d["entries"]:
            if e.get("is_p2p"):
                continue
            pg = e.get("process_group") or ["", ""]
            group = str(pg[0])
            seqs.setdefault(group, {}).setdefault(rank, {})[int(e.get("collective_seq_id") or 0)] = e
    found = []
    for group, by_rank in seqs.items():
        ranks_in = members.get(group) or (set(by_rank) | set(no_dump))
        dumped = sorted(r for r in ranks_in if r in dumps)
        have = {r: by_rank.get(r, {}) for r in dumped}
        lo = max((min(s) for s in have.values() if s), default=0)       # the window every dump still holds
        hi = max((max(s) for s in have.values() if s), default=0)
        for seq in range(lo, hi + 1):
            entered = [r for r in dumped if seq in have[r]]
            if not entered:
                continue
            missing = [r for r in dumped if seq not in have[r]]
            kinds = {(_op(have[r][seq]), json.dumps(have[r][seq].get("input_sizes"))) for r in entered}
            if missing or len(kinds) > 1:
                e = have[entered[0]][seq]
                found.append((int(e.get("time_created_ns") or 0), {
                    **_describe(e, _label(group, e)), "entered": entered, "missing": missing,
                    "no_dump": [r for r in no_dump if r in ranks_in],
                    "disagree": {r: [_op(have[r][seq]), have[r][seq].get("input_sizes")] for r in entered}
                    if len(kinds) > 1 else {},
                    "why": "ranks entered different collectives" if len(kinds) > 1 else
                           "not every rank of the group entered it"}))
                break
    if found:
        return min(found, key=lambda x: x[0])[1]
    # every dump agrees: the last collective the dumping ranks entered is the one they waited in
    last = [(int(e.get("time_created_ns") or 0), str((e.get("process_group") or [""])[0]), e)
            for d in dumps.values() for e in d["entries"] if not e.get("is_p2p")]
    if not last:
        return {"group": None, "seq": None, "op": None, "entered": [], "missing": [], "no_dump": no_dump,
                "why": "the dumps hold no collective"}
    _, group, e = max(last, key=lambda x: x[0])
    ranks_in = members.get(group) or set(range(world))
    seq = e.get("collective_seq_id")
    entered = sorted(r for r in ranks_in if r in dumps and any(
        str((x.get("process_group") or [""])[0]) == group and x.get("collective_seq_id") == seq
        for x in dumps[r]["entries"]))
    return {**_describe(e, _label(group, e)), "entered": entered, "missing": [],
            "no_dump": [r for r in no_dump if r in ranks_in],
            "why": "every dump agrees; the ranks without a dump are the ones it waited for" if no_dump else
                   "every rank entered it and none completed it"}


def _label(group: str, e: dict) -> str:
    pg = e.get("process_group") or [group, ""]
    return f"{group} ({pg[1]})" if len(pg) > 1 and pg[1] else group


def summarize(run_dir: "str | Path") -> Optional[dict[str, Any]]:
    """The hang as the dumps tell it, or None without dumps."""
    dumps = load_dumps(run_dir)
    if not dumps:
        return None
    reports: list[str] = []
    for r in sorted(dumps):
        text = str(dumps[r].get("report") or "")
        if text and text not in reports:
            reports.append(text)
    return {"ranks_dumped": sorted(dumps), "first_mismatch": first_mismatch(dumps), "reports": reports}


def sentence(f: dict[str, Any]) -> str:
    m = f["first_mismatch"] or {}
    if not m.get("op"):
        return f"flight recorder: dumps from rank(s) {f['ranks_dumped']} hold no collective"
    text = (f"flight recorder: {m['op']} #{m['seq']} on process group {m['group']} (sizes {m['sizes']}"
            + (f", issued at {m['frame']}" if m.get("frame") else "") + f") — entered by rank(s) {m['entered']}")
    if m.get("missing"):
        text += f"; not entered by rank(s) {m['missing']}"
    if m.get("disagree"):
        text += "; the ranks entered different collectives: " + "; ".join(
            f"rank {r}: {op} {sizes}" for r, (op, sizes) in m["disagree"].items())
    if m.get("no_dump"):
        text += f"; no dump from rank(s) {m['no_dump']} (stopped, killed, or ended before writing one)"
    return text + f" ({m['why']})"


def print_flight(f: Optional[dict[str, Any]], console: Any) -> None:
    if not f:
        return
    console.print(sentence(f) + ".")
    for text in f["reports"]:
        console.print(f"[dim]hang report: {text}[/dim]")
