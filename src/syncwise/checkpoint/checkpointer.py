"""SmartCheckpointer: asynchronous, atomic, self-verifying checkpoints through torch DCP.

Life of one save (``save(step, train_state)``, called by every rank):

1. wait for the previous save (never two in flight);
2. rank 0 creates ``step_XXXXXXXX.partial/`` (removing leftovers of a crashed save);
3. every rank writes its per-rank state to ``rank_<r>.pt`` (small, synchronous, fsynced);
4. the global state goes to ``dcp.async_save``: the *blocking* part stages a CPU copy of the
   state, then a background thread writes the shards (fsynced by DCP's ``FileSystemWriter``)
   while training continues. Its collectives run on a separate gloo group so they never
   interleave with the training's collectives on the default group;
5. when the shards are written, rank 0 checksums every file into ``manifest.json`` and renames
   the directory to ``step_XXXXXXXX/`` (the publish), then drops checkpoints beyond
   ``max_checkpoints``. A checkpoint is only ever deleted after a newer one is published.

Loading (``load``) is collective: rank 0 verifies a candidate against its manifest, then every rank
reads what it needs and all ranks agree on the outcome before going on, so a failure that only one
rank sees (its rank file refused, say) makes every rank fall back to the previous checkpoint
('auto') or raise (an explicit path) together, never half the ranks loading.
"""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import __version__
from ..comm import ops
from ..errors import ConfigError, SyncwiseError
from . import storage
from .interval import DEFAULT_MTBF_S, interval_steps, parse_interval
from .state import TrainState

log = logging.getLogger("syncwise.checkpoint")
# DCP warns on every single-process save/load, even when no_dist=True is passed explicitly.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

PER_RANK_FORMAT = "syncwise-rank-state/1"


@dataclass
class SaveStats:
    """Cost of one save on this rank: blocking seconds (training stopped), total seconds until
    published (rank 0) or written (other ranks), bytes of the checkpoint (rank 0), its path."""

    step: int
    blocking_s: float
    total_s: float = float("nan")
    bytes: int = 0
    path: Path | None = None


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def _stager_kw(ckpt: Any) -> dict[str, Any]:
    """``async_stager=`` for ``dcp.async_save``: one stager per checkpointer, kept across saves (issue 24).

    Without it DCP stages through the FileSystemWriter, which copies every tensor into fresh pageable memory at
    every save: slow device-to-host copies, all counted as the save's blocking time. torch's ``DefaultStager``
    caches the staging storage per source storage (reused by the next save: ``save`` waits for the previous
    one first, so nobody still reads it) and, on CUDA, pins it and copies with ``non_blocking`` on a staging
    stream, then synchronizes that stream. Pinning needs CUDA, so on the CPU it only caches."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # torch without the staging API: DCP's own default
        return {}
    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return {}
    stager = getattr(ckpt, "_async_stager", None)
    if stager is None:
        cuda = torch.cuda.is_available()
        stager = ckpt._async_stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda))
    return {"async_stager": stager}


def _no_dist_kw(fn: Any) -> dict[str, Any]:
    """``{'no_dist': True}`` for DCP calls outside a process group, if ``fn`` accepts it (torch 2.5's
    ``async_save`` does not; it then infers single-process mode itself)."""
    if _dist_on():
        return {}
    try:
        return {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}
    except (TypeError, ValueError):
        return {}


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


class SmartCheckpointer:
    """Saves and restores a ``TrainState`` every ``interval`` with DCP, asynchronously and atomically.

    Args:
        directory: where ``step_*`` checkpoint directories live (shared by all ranks).
        interval: an int (every N steps; 0 = never during the run, only the loop's final save), a
            duration ('30s', '5m', '2h'), or 'dynamic': the
            Young/Daly optimum √(2·δ·M), with δ the measured blocking cost of a save and M =
            ``mtbf_s``. Time-based intervals are converted to steps from the step time agreed by
            all ranks (max over ranks), so every rank decides identically. 'dynamic' takes its
            first checkpoint right after ``calibration_steps`` steps to measure δ.
        max_checkpoints: how many published checkpoints to keep (>= 1).
        compression: False, True (zstd if `zstandard`/`pyzstd` is installed, else zlib), 'zstd' or
            'zlib'. Implemented as a DCP stream extension, so compressed checkpoints stay regular,
            reshardable DCP checkpoints (needs torch>=2.7).
        async_save: stage and return, writing in a background thread (``dcp.async_save``).
        mtbf_s: mean time between failures of the whole job, for 'dynamic'; default 4 h
            (``interval.DEFAULT_MTBF_S``).
        calibration_steps: steps observed before a time-based interval is fixed.
        layout: the run's parallel layout (e.g. ``ParallelSpec.describe``: 'dp_shard 2', 'dp_replicate 2 ×
            tp 2'), recorded in each checkpoint's manifest. Global state (DCP) reshards to any layout;
            per-rank state (RNG streams, data positions, compressor error feedback) is restored only under
            the layout and world size it was written with, and dropped with a warning otherwise. None
            (default): not recorded, and only the world size is compared (the behaviour before layouts).

    ``should_save`` and ``save`` must be called by all ranks at the same steps (they may issue
    collectives on the default group). Call ``wait()`` (or ``close()``) before exiting.

    What stays on disk (decided by rank 0 each time a checkpoint is published):

    - the newest ``max_checkpoints`` published ``step_*`` checkpoints; older ones are deleted, only
      ever after a newer one is complete;
    - a save of step N is abandoned (not published, with a warning) when a checkpoint of a later step
      was published while this checkpointer ran: by another writer (live recovery's replica groups share
      the directory; a writer paused before its save must not hide their newer progress);
    - checkpoints of steps later than the one just published that were there when this checkpointer
      started (the run resumed from an older checkpoint, so they belong to a discarded timeline; never
      with ``shared``, where a later step is another writer's progress) are renamed
      ``step_*.abandoned`` ('auto' never resumes from them; an earlier abandoned copy of the same step is kept, as
      ``step_*.<n>.abandoned``). The ``max_checkpoints`` abandoned ones with the highest steps — the
      furthest progress of the discarded timelines — are kept, older ones are deleted with a warning
      naming them, so they cannot pile up forever;
    - ``step_*.replaced`` is the previous copy of a step being saved again, normally deleted as soon
      as the new copy is published. One left by a crash is deleted if the step's checkpoint exists,
      and renamed back to ``step_*`` if it does not (it is then the only copy of that checkpoint).
    """

    def __init__(self, directory: str | os.PathLike, interval: int | str = "dynamic", max_checkpoints: int = 3,
                 compression: bool | str = False, async_save: bool = True, mtbf_s: float | None = None,
                 *, calibration_steps: int = 3, layout: str | None = None, shared: bool = False):
        self.directory = Path(directory)
        # shared: other jobs save into this directory too (live recovery's replica groups): a group starting (a
        # replacement) must not remove the unfinished save another group is writing right now as a leftover
        self.shared = shared
        if layout is not None and not isinstance(layout, str):
            raise ConfigError("layout", layout, "a string naming the parallel layout (ParallelSpec.describe), or None")
        self.layout = layout
        self._kind, self._value = parse_interval(interval)
        if isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int) or max_checkpoints < 1:
            raise ConfigError("max_checkpoints", max_checkpoints, "an int >= 1")
        if mtbf_s is not None and (isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float)) or mtbf_s <= 0):
            raise ConfigError("mtbf_s", mtbf_s, "a positive number of seconds, or None for the 4 h default")
        if not isinstance(calibration_steps, int) or calibration_steps < 1:
            raise ConfigError("calibration_steps", calibration_steps, "an int >= 1")
        self.interval = interval
        self.max_checkpoints = max_checkpoints
        self.async_save = bool(async_save)
        self.mtbf_s = float(mtbf_s) if mtbf_s is not None else DEFAULT_MTBF_S
        self.calibration_steps = calibration_steps
        self._extension, self.compression = storage.compression_extension(compression)
        self.rank, self.world_size = _rank_world()
        # DCP's async collectives run in a background thread: give them their own gloo group so
        # they cannot interleave with the training's collectives on the default group (gloo
        # matches collectives by issue order per group; mixing them would mismatch or hang).
        self._save_pg = ops.new_group(backend="gloo", desc="checkpoint") if _dist_on() and self.async_save else None
        # what was published before this run: a later step among these is a discarded timeline's (_retain); a
        # later step published since is a newer save of this job's (another writer's): it wins (_finish)
        self._found_at_start = {p.name for p in storage.published_checkpoints(self.directory)}  # (+ our own)
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not shared:  # (shared: the next save's own clean-up removes what a crashed save left)
                self._remove_partials()
            self._settle_replaced()
        _barrier()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncwise-ckpt")
        self._pending: Future | None = None
        self._pending_stats: SaveStats | None = None
        self.history: list[SaveStats] = []
        self._interval_steps: int | None = int(self._value) if self._kind == "steps" else None
        self._anchor_step: int | None = None
        self._step_times: deque[float] = deque(maxlen=32)
        self._last_tick: float | None = None
        self._agreed_step_s: float | None = None
        self._agreed_cost_s: float | None = None
        self._agreed_total_s: float | None = None

    # ------------------------------------------------------------------ interval policy
    @property
    def next_interval_steps(self) -> int | None:
        """Steps between checkpoints currently in force (None until a time-based policy is calibrated)."""
        return self._interval_steps

    @property
    def last_save(self) -> SaveStats | None:
        """Stats of the most recent finished save on this rank."""
        return self.history[-1] if self.history else None

    @property
    def save_in_flight(self) -> bool:
        """True while a started save is still being written/published in the background."""
        return self._pending is not None and not self._pending.done()

    def should_save(self, step: int, step_time_s: float | None = None) -> bool:
        """True if a checkpoint is due after ``step``; call on every rank after every step.

        ``step_time_s`` is the duration of the step just done; if omitted, the time between
        calls is used. The first time-based decision (after ``calibration_steps`` steps) agrees
        the step time across ranks with one small all-reduce.
        """
        now = time.perf_counter()
        if step_time_s is None and self._last_tick is not None:
            step_time_s = now - self._last_tick
        self._last_tick = now
        if step_time_s is not None and step_time_s > 0:
            self._step_times.append(float(step_time_s))
        if self._anchor_step is None:
            self._anchor_step = step - 1  # the run (or resume) started just before this step
        if self._kind == "steps":
            return step > 0 and step % self._interval_steps == 0
        if self._kind == "final":  # interval 0: only the loop's own save at the end
            return False
        if self._interval_steps is None:
            if len(self._step_times) < self.calibration_steps:
                return False
            self._update_interval()
            if self._kind == "dynamic" and self._agreed_cost_s is None:
                return True  # first save: measures δ for the Young/Daly interval
        return step - self._anchor_step >= self._interval_steps

    def maybe_save(self, step: int, train_state: TrainState, step_time_s: float | None = None) -> SaveStats | None:
        """``save`` if ``should_save(step, step_time_s)``; the one call a training loop needs per step."""
        return self.save(step, train_state) if self.should_save(step, step_time_s) else None

    def _local_step_time(self) -> float:
        if not self._step_times:
            return 0.0
        times = sorted(self._step_times)
        return times[len(times) // 2]  # median: robust to the slow first step and to save stalls

    def _agree(self, values: list[float]) -> list[float]:
        """Max over ranks (on the default group, from the main thread), so all ranks decide alike."""
        if not _dist_on():
            return values
        t = torch.tensor(values, dtype=torch.float64, device=_ctl_device())
        ops.all_reduce(t, "max")
        return t.tolist()

    def _update_interval(self, cost_s: float | None = None, total_s: float | None = None) -> None:
        step_s, cost, total = self._agree([self._local_step_time(), cost_s if cost_s is not None else -1.0,
                                           total_s if total_s is not None else -1.0])
        self._agreed_step_s = step_s
        if cost >= 0:
            self._agreed_cost_s = cost
        if total >= 0:
            self._agreed_total_s = total
        if self._kind != "steps":
            self._interval_steps = interval_steps(self._kind, self._value, step_s, self._agreed_cost_s,
                                                  self._agreed_total_s, self.mtbf_s)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, train_state: TrainState, *, blocking: bool | None = None) -> SaveStats:
        """Checkpoint ``train_state`` as ``step`` (collective). Returns once the state is staged
        (async) or published (``blocking=True`` / ``async_save=False``); see ``wait()``."""
        prev = self.wait()
        blocking = (not self.async_save) if blocking is None else blocking
        t0 = time.perf_counter()
        partial = self.directory / (storage.step_dirname(step) + storage.PARTIAL_SUFFIX)
        if self.rank == 0:
            self._remove_partials()
            partial.mkdir(parents=True)
        _barrier()  # the .partial directory exists for everyone

        writer_kwargs: dict[str, Any] = {"sync_files": True}
        if self._extension is not None:
            writer_kwargs["_extensions"] = [self._extension]
        writer = dcp.FileSystemWriter(str(partial), **writer_kwargs)
        state = dict(train_state.global_components)  # DCP calls state_dict() on each Stateful
        upload: Future | None = None
        try:
            self._write_rank_file(partial, step, train_state)
            if self.async_save and not blocking:
                resp = dcp.async_save(state, storage_writer=writer, process_group=self._save_pg,
                                      **_stager_kw(self), **_no_dist_kw(dcp.async_save))
                # torch>=2.9 may return AsyncSaveResponse(staging_completion, upload_completion)
                upload = getattr(resp, "upload_completion", resp)
            else:
                dcp.save(state, storage_writer=writer, **_no_dist_kw(dcp.save))
        except (Exception, dcp.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise save_failed(step, self.directory, e) from e
        stats = SaveStats(step=step, blocking_s=time.perf_counter() - t0)
        self._pending_stats = stats
        self._pending = self._executor.submit(self._finish, upload, step, partial, t0, stats, train_state)
        if blocking:
            self.wait()
            stats.blocking_s = time.perf_counter() - t0
        self._anchor_step = step
        # δ = this save's blocking cost; the total of the previous save bounds the interval below.
        self._update_interval(stats.blocking_s, prev.total_s if prev is not None else None)
        self._last_tick = time.perf_counter()  # do not count the save as step time
        return stats

    def _write_rank_file(self, partial: Path, step: int, train_state: TrainState) -> None:
        payload = {"format": PER_RANK_FORMAT, "rank": self.rank, "world_size": self.world_size, "step": step,
                   "components": {n: c.state_dict() for n, c in train_state.per_rank_components.items()}}
        path = partial / storage.rank_filename(self.rank)
        with open(path, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())

    def _finish(self, upload: Future | None, step: int, partial: Path, t0: float, stats: SaveStats,
                train_state: TrainState) -> SaveStats:
        if upload is not None:
            upload.result()  # DCP's finish on rank 0 runs after every rank has written its shards
        if self.rank == 0:
            manifest = storage.write_manifest(partial, {
                "step": step, "world_size": self.world_size, "time": time.time(),
                "syncwise_version": __version__, "torch_version": torch.__version__,
                "compression": self.compression,
                "global_components": sorted(train_state.global_components),
                "per_rank_components": sorted(train_state.per_rank_components),
                "save_blocking_s": round(stats.blocking_s, 6),
                **({"layout": self.layout} if self.layout is not None else {}),
            })
            newer = self._published_since_start(step)
            if newer:  # decided for step N, but someone published a later step meanwhile: never hide it
                log.warning("abandoning the checkpoint of step %d: %s was published meanwhile (by another writer; "
                            "this one was paused or slow), and the newest checkpoint wins", step, newer[0])
                shutil.rmtree(partial, ignore_errors=True)
                stats.total_s = time.perf_counter() - t0
                return stats
            final = self.directory / storage.step_dirname(step)
            old = None
            if final.exists():  # re-saving a step: replace only once the new copy is complete
                old = final.with_name(final.name + storage.REPLACED_SUFFIX)
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(partial, final)
            storage.fsync_dir(self.directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            stats.path = final
            self._found_at_start.add(final.name)  # (ours: a later load of an older one discards it like the rest)
            stats.bytes = sum(f["size"] for f in manifest["files"].values())
            self._retain(step)
        else:
            stats.path = self.directory / storage.step_dirname(step)
        stats.total_s = time.perf_counter() - t0
        return stats

    def _retain(self, newest_step: int) -> None:
        """Rank 0, after publishing ``newest_step``: apply the retention policy of the class docstring."""
        self._settle_replaced()
        for p in storage.published_checkpoints(self.directory):
            s = storage.step_of(p)
            if s is not None and s > newest_step and not self.shared and p.name in self._found_at_start:
                # a later step than the one just published belongs to an abandoned timeline (we
                # resumed from an older checkpoint): set it aside so 'auto' never resumes from it
                aside = storage.abandoned_name(self.directory, p.name)
                log.warning("checkpoint %s is newer than the run's current step %d (the run resumed "
                            "from an older checkpoint); moved to %s", p, newest_step, aside)
                os.rename(p, aside)
        for old in storage.published_checkpoints(self.directory)[self.max_checkpoints:]:
            log.info("removing checkpoint %s (keeping the newest %d)", old, self.max_checkpoints)
            shutil.rmtree(old, ignore_errors=True)
        for old in storage.abandoned_checkpoints(self.directory)[self.max_checkpoints:]:
            log.warning("removing abandoned checkpoint %s (keeping the %d abandoned checkpoints with the highest "
                        "steps)", old, self.max_checkpoints)
            shutil.rmtree(old, ignore_errors=True)

    def _published_since_start(self, step: int) -> list[Path]:
        """Published checkpoints of steps after ``step`` that this checkpointer neither found when it started nor
        published itself (with ``shared``: any), newest first."""
        return [p for p in storage.published_checkpoints(self.directory)
                if (storage.step_of(p) or 0) > step and (self.shared or p.name not in self._found_at_start)]

    def _settle_replaced(self) -> None:
        """Rank 0: resolve ``step_*.replaced`` left by a crash while re-saving a step."""
        for p in sorted(self.directory.glob("step_*" + storage.REPLACED_SUFFIX)):
            final = p.with_name(p.name[:-len(storage.REPLACED_SUFFIX)])
            if not p.is_dir() or storage.step_of(final) is None:
                continue
            if final.exists():
                log.info("removing %s, a stale copy of %s (left by an interrupted re-save)", p, final)
                shutil.rmtree(p, ignore_errors=True)
            else:
                log.warning("restoring %s from %s: a re-save of that step was interrupted before the new "
                            "copy was published", final, p)
                os.rename(p, final)
                storage.fsync_dir(self.directory)

    def _remove_partials(self) -> None:
        for p in self.directory.glob("*" + storage.PARTIAL_SUFFIX):
            log.info("removing unfinished checkpoint %s (left by an interrupted save)", p)
            shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> SaveStats | None:
        """Block until the save in flight (if any) is written and published; return its stats."""
        if self._pending is None:
            return None
        pending, stats = self._pending, self._pending_stats
        self._pending = self._pending_stats = None
        try:
            pending.result()
        except (Exception, dcp.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise save_failed(stats.step if stats else None, self.directory, e) from e
        if stats is not None:
            self.history.append(stats)
        return stats

    def close(self) -> None:
        """Finish the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            stager = getattr(self, "_async_stager", None)
            if stager is not None:
                self._async_stager = None
                stager.close()  # unpins and drops the cached staging buffers

    # ------------------------------------------------------------------ loading
    def latest_valid(self) -> Path | None:
        """Newest verified checkpoint in this checkpointer's directory (see ``latest_valid``)."""
        return storage.latest_valid(self.directory)

    def load(self, path_or_auto: str | os.PathLike, train_state: TrainState) -> int:
        """Restore ``train_state`` from a checkpoint path or 'auto' (newest valid); return its step
        (0 if 'auto' found nothing). Collective when distributed."""
        self.wait()
        step = load(path_or_auto, train_state, directory=self.directory, layout=self.layout)
        self._anchor_step = step
        return step


def save_failed(step: int | None, directory: Path, e: BaseException) -> SyncwiseError:
    """One readable paragraph for a failed save: DCP's exception carries every rank's whole traceback."""
    return SyncwiseError(
        f"saving the checkpoint of step {step if step is not None else '?'} in {directory} failed: "
        f"{first_cause(e)}{storage.disk_full_hint(directory)}. The previous "
        "checkpoints are untouched; check free disk space and write permissions of the checkpoint directory.")


def first_cause(e: BaseException) -> str:
    """'Type: first line' of an exception; for DCP's CheckpointException (whose text holds every rank's
    whole traceback), of the first failing rank's exception."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, stack)}
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------------------------------------
def _flatten(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.size()) if isinstance(value, torch.Tensor) else None


class _Damaged(SyncwiseError):
    """This checkpoint cannot be loaded (damaged, tampered with, incomplete); an older one may be tried.

    Any other ``SyncwiseError`` while loading means the checkpoint does not fit the run (another
    model, other components): older checkpoints of the run would not fit either, so 'auto' stops.
    """


def _check_compatible(path: Path, train_state: TrainState,
                      manifest: dict[str, Any]) -> tuple[list[str], set[str]]:
    """Compare the state this rank loads with the checkpoint's DCP metadata; raise a clear error if this rank
    needs an entry the checkpoint lacks, or an entry's shape differs. Returns (the checkpoint's entries under the
    run's global components, sorted; the entries this rank loads) for ``_check_covered``: a pipeline stage loads
    only its own layers, so "is every saved entry part of the run" is asked of the union over ranks."""
    saved = set(manifest.get("global_components", []))
    missing_components = [n for n in train_state.global_components if n not in saved]
    if missing_components:
        raise SyncwiseError(
            f"checkpoint {path} has no state for {', '.join(missing_components)} (it holds: "
            f"{', '.join(sorted(saved)) or 'nothing'}). The run registers components the checkpoint was "
            "not written with; load it with the same set of components (e.g. the same scheduler/scaler "
            "options), or start a fresh run in another checkpoint directory.")
    reader = storage.make_safe_reader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise _Damaged(f"checkpoint {path} has unreadable DCP metadata ({type(e).__name__}: {e}). "
                       "It is damaged or not a syncwise checkpoint; use another checkpoint.") from e
    saved_md = metadata.state_dict_metadata
    for name, comp in train_state.global_components.items():  # e.g. the optimizer's form (ModelOptimizerState)
        adapt = getattr(comp, "adapt_to_checkpoint", None)
        if callable(adapt):
            adapt({k[len(name) + 1:] for k in saved_md if k.startswith(name + ".")})
    ours = _flatten({n: c.state_dict() for n, c in train_state.global_components.items()})
    missing = [k for k in ours if k not in saved_md]
    mismatched = []
    for k, v in ours.items():
        md = saved_md.get(k)
        shape = _shape(v)
        if md is not None and shape is not None:
            saved_size = tuple(getattr(md, "size", ()) or ())
            if not hasattr(md, "size"):
                mismatched.append(f"'{k}': checkpoint holds a non-tensor, the run has a tensor {list(shape)}")
            elif saved_size != shape:
                mismatched.append(f"'{k}': checkpoint {list(saved_size)}, run {list(shape)}")
    parts = []
    if missing:
        parts.append(f"{len(missing)} entries of the run are missing from the checkpoint ({_few(missing)})")
    if mismatched:
        parts.append(f"{len(mismatched)} have a different shape ({_few(mismatched)})")
    if parts:
        raise _mismatch(path, manifest, parts)
    prefixes = tuple(f"{n}." for n in train_state.global_components)
    return sorted(k for k in saved_md if k.startswith(prefixes)), set(ours)


def _check_covered(path: Path, manifest: dict[str, Any], entries: list[str], ours: set[str]) -> None:
    """Collective: every entry of the checkpoint (``entries``, the same list on every rank) must be loaded by
    some rank — the union of the ranks' state is the saved model, whatever the layout (DCP reshards each
    entry by its fully-qualified name, so pipeline stages, FSDP2 shards and tensor-parallel pieces each take
    their part). An entry no rank loads belongs to another model (more layers, other modules): refused."""
    mask = torch.tensor([k in ours for k in entries], dtype=torch.int32, device=_ctl_device())
    if _dist_on() and entries:
        ops.all_reduce(mask, "max")
    unexpected = [k for k, hit in zip(entries, mask.tolist()) if not hit]
    if unexpected:
        raise _mismatch(path, manifest, [f"{len(unexpected)} entries of the checkpoint do not exist in the run "
                                         f"({_few(unexpected)})"])


def _few(xs: list[str]) -> str:
    return ", ".join(repr(x) if not x.startswith("'") else x for x in xs[:3]) + (" ..." if len(xs) > 3 else "")


def _mismatch(path: Path, manifest: dict[str, Any], parts: list[str]) -> SyncwiseError:
    return SyncwiseError(
        f"checkpoint {path} (step {manifest.get('step')}, written by {manifest.get('world_size')} "
        f"rank(s)) does not match the model being trained: {'; '.join(parts)}. It was saved from a "
        "different model configuration. Load it with the configuration it was written with, or "
        "start without resuming (or point the checkpoint directory elsewhere).")


def _layout_change(manifest: dict[str, Any], layout: str | None) -> str | None:
    """Why per-rank state cannot follow from the checkpoint to this run (None: it can)."""
    _, world = _rank_world()
    if manifest.get("world_size") != world:
        return f"was written by {manifest.get('world_size')} ranks, this run has {world}"
    saved = manifest.get("layout")
    if layout is not None and saved is not None and saved != layout:
        return f"was written under the layout '{saved}', this run's is '{layout}'"
    return None


def _read_rank_file(path: Path, train_state: TrainState, manifest: dict[str, Any],
                    layout: str | None = None) -> dict[str, Any] | None:
    """This rank's per-rank payload of checkpoint ``path``, read and checked but not applied (None when the run
    has no per-rank state). Under another world size or layout, rank 0's payload when the run has portable
    per-rank state (``TrainState.register(portable=True)``: only that part of it is applied), else None."""
    rank, world = _rank_world()
    if not train_state.per_rank_components:
        return None
    changed = _layout_change(manifest, layout) is not None
    if changed and not train_state.portable:
        return None
    f = path / storage.rank_filename(0 if changed else rank)
    try:
        payload = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _Damaged(f"checkpoint {path} lacks {f.name}, the per-rank state of rank {0 if changed else rank}; "
                       "the checkpoint is incomplete, use an earlier one.") from None
    except Exception as e:
        # weights_only refuses anything but tensors and plain data: never run code from a checkpoint
        raise _Damaged(
            f"refused to load {f}: it contains data that is not plain tensors/numbers/strings "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). syncwise loads per-rank state "
            "with torch.load(weights_only=True) and never unpickles arbitrary objects; the file was not "
            "written by syncwise or was tampered with. Use another checkpoint.") from e
    if not isinstance(payload, dict) or not isinstance(payload.get("components", {}), dict):
        raise _Damaged(f"{f} is not a syncwise per-rank state file ({PER_RANK_FORMAT}); use another checkpoint.")
    return payload


def _apply_rank_file(path: Path, train_state: TrainState, manifest: dict[str, Any],
                     payload: dict[str, Any] | None, layout: str | None = None) -> None:
    rank, world = _rank_world()
    names = list(train_state.per_rank_components)
    if not names:
        return
    change = _layout_change(manifest, layout)
    comps = payload.get("components", {}) if payload is not None else {}
    if change is not None:
        # a rank's state (a compressor's error feedback, its RNG streams) belongs to its place in the layout:
        # under another layout rank r is not the same worker, so nothing is mis-assigned to it. Portable state
        # (a data position) is taken from the old rank 0 and adapts itself.
        moved = [n for n in names if n in train_state.portable and n in comps]
        for name in moved:
            train_state.per_rank_components[name].load_state_dict(comps[name])
        dropped = [n for n in names if n not in moved]
        if dropped:
            log.warning("checkpoint %s %s: per-rank state (%s) is not restored (it belongs to the ranks of the "
                        "old layout); RNG streams are re-derived from the seed, compressor error feedback and "
                        "local-SGD state start from zero%s", path, change, ", ".join(dropped),
                        f"; {', '.join(moved)} continues from the old layout's position" if moved else "")
        return
    for name, comp in train_state.per_rank_components.items():
        if name in comps:
            comp.load_state_dict(comps[name])
        else:
            log.warning("checkpoint %s has no per-rank state %r for rank %d; it keeps its current value",
                        path, name, rank)


# Outcome of one step of loading a candidate on one rank; all ranks agree on the worst (max).
_OK, _DAMAGED, _INCOMPATIBLE = 0, 1, 2
# What rank 0 tells the others about the candidate (broadcast).
_TRY, _NOTHING, _INVALID, _EXHAUSTED = 0, 1, 2, 3


def _ctl_device() -> torch.device:
    """Device for small control tensors on the default group (NCCL only takes CUDA tensors)."""
    if _dist_on() and "gloo" not in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _outcome(err: BaseException | None) -> int:
    if err is None:
        return _OK
    return _DAMAGED if isinstance(err, _Damaged) or not isinstance(err, SyncwiseError) else _INCOMPATIBLE


def _agree_outcome(err: BaseException | None) -> tuple[int, list[str]]:
    """The worst outcome over all ranks and, if it is a failure, every failing rank's reason (collective)."""
    code = _outcome(err)
    if not _dist_on():
        return code, ([str(err)] if err is not None else [])
    t = torch.tensor([code], dtype=torch.int64, device=_ctl_device())
    ops.all_reduce(t, "max")
    worst = int(t.item())
    if worst == _OK:
        return _OK, []
    # rare path: share the reasons so every rank can name them (strings made by syncwise, not read from disk)
    gathered = ops.all_gather_object(str(err) if err is not None else None)
    return worst, [f"rank {r}: {msg}" for r, msg in enumerate(gathered) if msg is not None]


def _try_load(path: Path, train_state: TrainState,
              layout: str | None = None) -> tuple[int, list[str], BaseException | None]:
    """Load checkpoint ``path`` into ``train_state`` on every rank (collective).

    Each stage is agreed by all ranks before the next, so a failure on any rank stops all of them at
    the same point: (1) read the manifest, check the model against the DCP metadata and read this
    rank's per-rank file (local, nothing changed yet); then check that the ranks together load every entry
    of the checkpoint (one small all-reduce); (2) the DCP load (collective); (3) apply the per-rank state. Returns (outcome, reasons from every failing rank, this rank's own error).
    """
    err: BaseException | None = None
    manifest: dict[str, Any] = {}
    payload = None
    try:
        try:
            manifest = storage.read_manifest(path)
        except (OSError, ValueError) as e:
            raise _Damaged(f"the manifest of checkpoint {path} is unreadable: {e}") from e
        entries, ours = _check_compatible(path, train_state, manifest)
        payload = _read_rank_file(path, train_state, manifest, layout)
    except Exception as e:
        err = e
    code, reasons = _agree_outcome(err)
    if code != _OK:
        return code, reasons, err
    try:  # every rank read the same metadata (agreed above), so every rank builds the same list
        _check_covered(path, manifest, entries, ours)
    except SyncwiseError as e:
        err = e
    code, reasons = _agree_outcome(err)
    if code != _OK:
        return code, reasons, err
    try:
        dcp.load(dict(train_state.global_components), storage_reader=storage.make_safe_reader(path),
                 planner=storage.make_safe_planner(), **_no_dist_kw(dcp.load))
    except SyncwiseError as e:  # raised by a component's load_state_dict: the state does not fit the run
        err = e
    except (Exception, dcp.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        err = _Damaged(f"loading checkpoint {path} failed: {first_cause(e)}. The checkpoint may be damaged "
                       "or from an incompatible version; try an earlier one.")
        err.__cause__ = e
    code, reasons = _agree_outcome(err)
    if code != _OK:
        return code, reasons, err
    try:
        _apply_rank_file(path, train_state, manifest, payload, layout)
    except SyncwiseError as e:
        err = e
    except Exception as e:
        err = _Damaged(f"the per-rank state of checkpoint {path} does not load: {type(e).__name__}: {e}")
        err.__cause__ = e
    code, reasons = _agree_outcome(err)
    return code, reasons, err


def _broadcast_text(text: str | None) -> str:
    if not _dist_on():
        return text or ""
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0] or ""


def load(path_or_auto: str | os.PathLike, train_state: TrainState, *,
         directory: str | os.PathLike | None = None, layout: str | None = None) -> int:
    """Restore ``train_state`` from a checkpoint; return its step. Collective when distributed.

    ``path_or_auto`` is a checkpoint directory, or 'auto' for the newest checkpoint in ``directory``
    that loads. Rank 0 verifies each candidate (a complete manifest, sizes, sha256); then every rank
    loads it and all ranks agree on the outcome. With 'auto', a checkpoint that fails (damaged,
    tampered with, refused by ``weights_only`` on any rank) is skipped on every rank with a warning
    naming it and the reason, and the previous one is tried. 'auto' returns 0 and changes nothing
    when ``directory`` holds no published checkpoint; when it holds some but none loads, it raises
    ``SyncwiseError`` listing them (starting from scratch would later prune the user's saved
    checkpoints). An explicit path that fails raises ``SyncwiseError`` (never a silent substitute),
    and so does a checkpoint from a different model, also with 'auto'. Global state loads through
    DCP at any world size and layout (DDP, FSDP2/HSDP, tensor parallel: DCP reshards); per-rank state
    loads only at the world size it was written with and, when both ``layout`` and the checkpoint's
    manifest name one, under the same layout (otherwise a warning, and it is skipped).
    """
    rank, world = _rank_world()
    auto = isinstance(path_or_auto, str) and path_or_auto == "auto"
    if auto and directory is None:
        raise ConfigError("directory", None, "the checkpoint directory to search when loading 'auto'")
    candidates = storage.published_checkpoints(directory) if auto and rank == 0 else []
    next_candidate = 0
    tried: list[str] = []  # rank 0: every candidate that failed, with why
    while True:
        # rank 0 picks the next candidate that verifies, so all ranks act alike
        status, step, problem = _TRY, 0, None
        if rank == 0:
            chosen = None
            if auto:
                while chosen is None and next_candidate < len(candidates):
                    path = candidates[next_candidate]
                    next_candidate += 1
                    problem = storage.verify_checkpoint(path)
                    if problem is None:
                        chosen = path
                    else:
                        log.warning("skipping checkpoint %s: %s; falling back to the previous checkpoint",
                                    path, problem)
                        tried.append(f"{path.name}: {problem}")
                if chosen is not None:
                    step = storage.step_of(chosen)
                elif not candidates:
                    status = _NOTHING
                else:
                    status = _EXHAUSTED
                    problem = (
                        f"no checkpoint in {directory} can be loaded; tried, newest first: {' | '.join(tried)}. "
                        "They are left as they are. syncwise does not start from scratch over saved checkpoints "
                        "(the new run's checkpoints would replace them): to start afresh, move them out of "
                        f"{directory} or use a new run/checkpoint directory; to resume, repair or restore one.")
            else:
                problem = storage.verify_checkpoint(path_or_auto)
                if problem is None:
                    step = int(storage.read_manifest(path_or_auto)["step"])  # verified: an int
                else:
                    status = _INVALID
                    problem = (f"cannot load checkpoint {path_or_auto}: {problem}. Pass a published step_* "
                               "directory, or 'auto' to use the newest valid checkpoint.")
        if _dist_on():
            t = torch.tensor([status, step], dtype=torch.int64, device=_ctl_device())
            ops.broadcast(t, src=0)
            status, step = int(t[0]), int(t[1])
        if status == _NOTHING:
            log.info("no checkpoint in %s: starting from scratch", directory)
            return 0
        if status in (_INVALID, _EXHAUSTED):
            raise SyncwiseError(_broadcast_text(problem))
        path = Path(directory) / storage.step_dirname(step) if auto else Path(path_or_auto)
        code, reasons, err = _try_load(path, train_state, layout)
        if code == _OK:
            manifest = storage.read_manifest(path)
            log.info("restored checkpoint %s (step %d, saved by %s ranks%s, now %d%s)", path, step,
                     manifest.get("world_size"), f" as {manifest['layout']}" if manifest.get("layout") else "",
                     world, f" as {layout}" if layout else "")
            return step
        if code == _INCOMPATIBLE or not auto:
            if err is not None:
                raise err
            raise SyncwiseError(f"cannot load checkpoint {path}: {'; '.join(reasons)}")
        why = "; ".join(reasons)
        log.warning("checkpoint %s could not be loaded (%s); falling back to the previous checkpoint", path, why)
        tried.append(f"{path.name}: {why}")
