"""The Python API's hold on its run directory: the lock ``syncwise train`` takes (syncwise.rundir), and the same
refusal to start a fresh run over a previous one's files.

``OptimizedTrainer.train(..., resume=None)`` in a directory that holds a finished or stopped run used to replace
its ``metrics.jsonl`` and ``summary.json`` and set its checkpoints aside as ``.abandoned``; now, as on the command
line, nothing is started and nothing is overwritten. Rank 0 decides (it owns the files) and every rank raises the
same error, so no rank waits in a collective for a rank that stopped. What a start that never finished a step left
there is set aside (``RUN_DIR/failed-starts/<time>/``, never deleted) and does not block the rerun.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .. import rundir
from ..checkpoint.storage import published_checkpoints
from ..errors import SyncwiseError
from ..rundir import RunDir, RunDirLock, held_by_launcher


def previous_run(run_dir: Optional[Path], checkpoint_dir: Optional[Path]) -> list[str]:
    """The files and checkpoints of an earlier run in ``run_dir`` / ``checkpoint_dir`` (empty: none)."""
    # an empty metrics.jsonl is a run that ended before its first step: nothing of it to keep, nothing to continue
    run = RunDir(run_dir) if run_dir is not None else None
    found = [p.name for p in (run.run_files() if run else ()) if p.exists()
             and not (p == run.metrics and p.stat().st_size == 0)]
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        found += [str(p.relative_to(run_dir)) if run_dir is not None and p.is_relative_to(run_dir) else str(p)
                  for p in published_checkpoints(checkpoint_dir)]
    return found


def set_aside_dead_start(run_dir: str) -> None:
    """Move what a start that never finished a step left in ``run_dir`` (the files this trainer writes there: a
    metrics.jsonl with no rows, ranks/, tb/, ...) into ``run_dir/failed-starts/<time>/``, with one line saying so:
    the new run's files then hold this run alone (TensorBoard's events included). Nothing when a step finished
    there (rows, checkpoints: the refusal above, or a resume); entries this trainer does not write stay as they are
    (a run directory of the Python API may be a folder with other things in it)."""
    dead = rundir.dead_start(run_dir, rundir.TRAINER_START_NAMES)
    if dead:
        print(rundir.set_aside_note(run_dir, dead, rundir.set_aside(run_dir, dead)), file=sys.stderr, flush=True)


def claim(run_dir: Optional[str], checkpoint_dir: Optional[str | Path], resume: Optional[str], continuing: bool,
          rank: int, world_size: int, held: Optional[RunDirLock] = None) -> Optional[RunDirLock]:
    """Lock ``run_dir`` (rank 0; not when ``syncwise train``'s launcher holds it) and refuse a fresh run
    (``resume`` None, ``continuing`` False) over an earlier one. Returns the lock this call holds, if any."""
    error, lock = None, held
    if rank == 0:
        try:
            launcher = run_dir is not None and held_by_launcher(run_dir)
            if run_dir is not None and not launcher and (lock is None or not lock.held):
                lock = RunDirLock(run_dir).acquire()
            if resume is None and not continuing and not launcher:  # the launcher checked the directory itself
                found = previous_run(Path(run_dir) if run_dir else None,
                                     Path(checkpoint_dir) if checkpoint_dir else None)
                if found:
                    where = run_dir if run_dir is not None else checkpoint_dir
                    raise SyncwiseError(rundir.holds_a_run(
                        where, found, resume="resume='auto' to train()",
                        other="run_dir=" if run_dir is not None else "checkpoint_dir="))
            if run_dir is not None and not continuing and not launcher:
                set_aside_dead_start(run_dir)
                if resume == "auto" and checkpoint_dir is not None and not published_checkpoints(checkpoint_dir):
                    # nothing to continue: the run starts afresh, so an earlier run's rows are set aside, not replaced
                    aside = rundir.run_entries(run_dir, rundir.TRAINER_START_NAMES)
                    if aside:
                        dest = rundir.set_aside(run_dir, aside)
                        print(rundir.set_aside_note(run_dir, aside, dest, rundir.NO_CHECKPOINT), file=sys.stderr,
                              flush=True)
        except SyncwiseError as e:
            error = str(e)
            if lock is not None and lock is not held:
                lock.release()
            lock = None
    if world_size > 1 and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
        if error:  # every rank past the broadcast before any leaves (an early exit aborts a rank still sending)
            dist.barrier()
    if error:
        raise SyncwiseError(error)
    return lock
