"""This rank's flight recorder, dumped as JSON when a collective hung: ``RUN_DIR/flight/rank{R}.json``.

PyTorch's flight recorder (c10d's ``FlightRecorder``) keeps a ring of the last ``TORCH_FR_BUFFER_SIZE`` collectives
of every process group (default 2,000 here, see ``comm.arrivals``) — for gloo as well as NCCL in torch 2.13
(checked on this machine's CPU build: entries with the op, the group, the per-group ``collective_seq_id``, sizes,
dtypes and the issuing Python stack; gloo leaves each entry's ``state`` at 'scheduled', but the per-group
``pg_status`` says the last collective enqueued and completed). :func:`dump` writes it — on a hang only, from the
rank that saw the timeout (the trainer's hang path and the watchdog, just before it ends the process) — with the
hang report's paragraph, this rank's groups and their members, and each entry's nearest frames. JSON, not torch's
pickle: ``syncwise doctor`` reads it without unpickling anything (docs/security.md). A rank that is stopped or
killed writes nothing; doctor names it from the others' dumps and the heartbeats (``syncwise.doctor.flight``).
"""
from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path
from typing import Any, Optional

FRAMES = 6          # the nearest frames kept per entry (the issuing line and its callers)
KEEP = ("pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name", "time_created_ns",
        "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state", "is_p2p", "timeout_ms")


def _groups() -> dict[str, list[int]]:
    """This rank's process groups: name -> global ranks."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        return {str(name): list(dist.get_process_group_ranks(pg)) for pg, name in c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 — the dump must be written whatever the group table looks like
        return {}


def record() -> Optional[dict[str, Any]]:
    """The flight recorder as plain data (None where this torch has none or it is off)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        # torch's own bytes from this process (never a file): its dump is a pickle
        raw = pickle.loads(_dump_fr_trace(True, True, False))
    except Exception:  # noqa: BLE001 — no recorder: no dump
        return None
    entries = []
    for e in raw.get("entries", []):
        row = {k: e.get(k) for k in KEEP}
        row["process_group"] = list(e.get("process_group") or ("", ""))
        row["frames"] = [f"{f.get('filename')}:{f.get('line')} in {f.get('name')}"
                         for f in (e.get("frames") or [])[:FRAMES]]
        entries.append(row)
    return {"version": raw.get("version"), "pg_status": raw.get("pg_status", {}), "entries": entries}


def dump(path: "str | os.PathLike | None", rank: int, world_size: int, report: str = "") -> Optional[Path]:
    """Write this rank's flight recorder to ``path`` (no-op without a path or a recorder); never raises."""
    if path is None:
        return None
    data = record()
    if data is None:
        return None
    data.update({"rank": rank, "world_size": world_size, "time": time.time(), "report": report,
                 "groups": _groups()})
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, path)
    except OSError:
        return None
    return path
