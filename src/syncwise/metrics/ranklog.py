"""What every rank records for ``syncwise doctor``: its own per-step timings and its collective totals.

``metrics.jsonl`` holds rank 0's rows only; a straggler, a starved loader on one rank or an expert-parallel rank
that waits for its peers shows only in the other ranks' numbers. So every rank (each writes its own files, no
collective is added to the step) keeps

* ``RUN_DIR/ranks/rank{R}.jsonl`` — one line per optimizer step: ``step``, ``step_time_s``, ``compute_s``,
  ``data_wait_s``, ``comm_exposed_s``, per parallel dimension ``comm_bytes_<dim>``, ``comm_s_<dim>`` and
  ``comm_exposed_s_<dim>`` (and ``comm_bytes``, their total), and where measured ``compress_s`` (compression compute of the step's
  gradient sync), ``ep_comm_s`` (time in expert-parallel all-to-alls, waits for peers included),
  ``expert_imbalance`` (max / mean routed-token load of the most unbalanced MoE layer, summed over the ranks
  that share the layers), ``pp_bubble``, ``ckpt_in_flight``, ``time`` (Unix seconds when the row was written);
* ``RUN_DIR/ranks/rank{R}.json`` — at the end of the run: the collectives this rank issued during it per op
  (``calls``, ``bytes``, ``time_s``: ``comm``, the gradient sync — the run's ``ledger.dp``; ``control``: loss
  averaging, validation, router loads; ``ep``: expert all-to-alls), its checkpoint saves (``blocking_s``), its totals.

:class:`StepProbe` gathers the per-step extras at the end of a step without a host sync: the imbalance stays a
device tensor until the row is read (one step late on a GPU).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from ..comm.stats import CommStats
from ..rundir import RunDir
from .logger import read_jsonl

log = logging.getLogger(__name__)

#: keys of a trainer row copied into the rank's own log
RANK_KEYS = ("step", "step_time_s", "compute_s", "data_wait_s", "comm_exposed_s", "compress_s", "ep_comm_s",
             "expert_imbalance", "pp_bubble", "ckpt_in_flight", "skipped", "time")
#: and every per-dimension field (``comm_bytes_tp``, ``comm_s_tp``, ``comm_exposed_s_tp`` ...), and the step's total
DIMENSION_PREFIXES = ("comm_bytes", "comm_s_", "comm_exposed_s_")
#: and the step's bytes per hop (``hop_bytes_intra``, ``hop_bytes_cross``: the same bytes split by the link crossed)
HOP_PREFIX = ("hop_bytes_",)


class StepProbe:
    """Per-step extras the trainer adds to its rows: compression compute, expert all-to-all time, expert load
    imbalance. ``take()`` after each step returns the step's values (tensors stay on the device)."""

    def __init__(self, model: Any, par: Any = None):
        self.model = model
        self.state = getattr(par, "compression_state", None) if par is not None else None
        self._compress_mark = self._compress_total()
        self.ep_stats: Optional[CommStats] = None
        if par is not None and getattr(getattr(par, "spec", None), "ep", 1) > 1:
            self.ep_stats = par.ledger.ep  # the run's expert all-to-alls
        self._ep_mark = self.ep_stats.total_time_s if self.ep_stats is not None else 0.0
        self.moes = [m for m in model.modules() if hasattr(m, "expert_bias") and hasattr(m, "tokens_per_expert")]

    def _compress_total(self) -> float:
        return getattr(self.state, "compute_s", 0.0) if self.state is not None else 0.0

    def take(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.state is not None:
            total = self._compress_total()
            out["compress_s"], self._compress_mark = total - self._compress_mark, total
            synced = self.state.take_sync() if hasattr(self.state, "take_sync") else None
            if synced is not None:  # the hook's own clock of the gradient sync; the step meter takes it out
                out["grad_sync"] = synced
        if self.ep_stats is not None:
            total = self.ep_stats.total_time_s
            out["ep_comm_s"], self._ep_mark = total - self._ep_mark, total
        imbalance = expert_imbalance(self.moes)
        if imbalance is not None:
            out["expert_imbalance"] = imbalance
        return out


def expert_imbalance(moes: list) -> Any:
    """Max over MoE layers of (most loaded expert's routed tokens / the mean), from the load of the last
    bias-update window (``last_load``, summed over ranks) or the current counts; a 0-d tensor, or None."""
    import torch

    ratios = []
    for m in moes:
        load = m.last_load if getattr(m, "last_load", None) is not None else m.tokens_per_expert
        load = load.float()
        ratios.append(load.max() / load.mean().clamp_min(1e-9))
    return torch.stack(ratios).max() if ratios else None


def plain(value: Any) -> Any:
    """A row value as JSON can hold it (0-d tensors read as floats)."""
    if hasattr(value, "item") and callable(value.item):
        return float(value.item())
    return value


class RankLog:
    """This rank's own step log and end-of-run totals under ``RUN_DIR/ranks/``; a no-op without a run dir."""

    def __init__(self, run_dir: "str | Path | None", rank: int, world_size: int = 1, start_step: int = 0):
        self.rank, self.world_size = rank, world_size
        self.dir = RunDir(run_dir).ranks if run_dir else None
        self._file = None
        self._watched: dict[str, tuple[CommStats, dict]] = {}
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = RunDir(run_dir).rank_log(rank)
        if path.exists():  # a fresh run drops an old run's rows; a resumed one the rows it redoes
            rows = [r for r in read_jsonl(path) if r.get("step", 0) <= start_step] if start_step else []
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, path)
        self._file = open(path, "a", buffering=1)

    def watch(self, comm: CommStats, control: CommStats, ep: Optional[CommStats] = None) -> None:
        """Report these counters' collectives from now on (the run's ledger: its gradient sync as ``comm``, its
        control traffic, its expert all-to-alls)."""
        self._watched = {"comm": (comm, comm.snapshot()), "control": (control, control.snapshot())}
        if ep is not None:
            self._watched["ep"] = (ep, ep.snapshot())

    def log_step(self, row: dict[str, Any]) -> None:
        """Record this rank's numbers of one step (a trainer row)."""
        if self._file is not None:
            out = {k: plain(v) for k, v in row.items()
                   if k in RANK_KEYS or k.startswith(DIMENSION_PREFIXES + HOP_PREFIX)}
            out.setdefault("time", round(time.time(), 4))
            try:
                self._file.write(json.dumps(out) + "\n")
            except OSError as e:
                self._give_up(e)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``rank{R}.json``: this run's collectives per op, checkpoint saves and step totals."""
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as e:
            return self._give_up(e)
        self._file = None
        out = {"rank": self.rank, "world_size": self.world_size, "steps": summary.get("steps"),
               "mean_step_time_s": summary.get("mean_step_time_s"), "comm": {},
               "checkpoint_saves": summary.get("checkpoint_saves", []),
               "skipped_steps": summary.get("skipped_steps", [])}  # this rank's record (local SGD: after the averages)
        for name, (stats, mark) in self._watched.items():
            out[name] = stats.since(mark)
        path = self.dir / f"rank{self.rank}.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            self._give_up(e)

    def _give_up(self, error: OSError) -> None:
        """A diagnostics log never ends a run nor hides the error ending it (a full disk: the checkpoint's own
        message must reach the user): warn once and log no more (as the arrival log and the watchdog do)."""
        log.warning("rank log %s: %s; this rank's steps are no longer logged in this run", self.dir, error)
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
