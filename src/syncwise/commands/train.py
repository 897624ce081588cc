"""`syncwise train`: validate the configuration, then start the workers (local, or across the lab)."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Optional

from ..config import (RunConfig, add_train_arguments, build_config, describe_fields, format_config, load_file,
                      overrides_from_args, placement, upgrade_moved_keys)
from .. import rundir
from ..errors import ConfigError, SyncwiseError
from ..rundir import RunDir, RunDirLock


def describe_compressors() -> str:
    """The help's list of syncwise's compressors, their options, defaults and docs, from the torch-free table
    (``syncwise.layout.COMPRESSORS``; ``compress.registry.describe_compressors`` gives the same text but loads torch,
    and building the parser must not: a mistyped flag is answered in well under a second, issue 43 row 7)."""
    from ..layout import COMPRESSORS

    lines = []
    for info in COMPRESSORS.values():
        if info.torch_hook:
            continue
        lines.append(f"{info.name:9s} {info.summary}")
        for key, (typ, default, doc) in info.options.items():
            lines.append(f"    {key}={default!s:<8} ({typ}) {doc}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--check", action="store_true", help="validate everything checked before workers "
                        "start and print the resolved configuration (TOML); start nothing, write nothing")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("Every configuration field can be set as --section.key=value (or in a TOML file):\n"
                     + describe_fields() + "\n\nGradient compressors (--compress NAME[:key=value,...]):\n"
                     + describe_compressors())


class RunFinished(SyncwiseError):
    """``--resume auto`` on a run that already reached its ``--steps``: nothing to do (not a failure)."""


def prepare_run_dir(cfg: RunConfig, held: Optional[RunDirLock] = None) -> RunDirLock:
    """Choose the run directory, take its lock (held until released or this process exits), refuse to
    overwrite anything in it unless resuming, and write ``config.json``. Returns the held lock. ``held``: the
    directory's lock this start already holds (auto's probe took it: :class:`Probe`), taken over."""
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(cfg.run_dir)
    # Lock first, look second: two runs started together cannot both find the directory empty.
    mine = held is not None and held.held and held.run_dir.resolve() == run_dir.resolve()
    lock = held if mine else RunDirLock(run_dir).acquire()
    try:
        aside, what = check_run_dir(cfg, run_dir)
        if aside:  # a start that never finished a step, or nothing to resume: set aside whole, never deleted
            dest = rundir.set_aside(run_dir, aside)
            print(rundir.set_aside_note(run_dir, aside, dest, what), file=sys.stderr, flush=True)
        cfg.save(RunDir(run_dir).config)
    except BaseException:
        lock.release()
        raise
    return lock


def look_at_run_dir(cfg: RunConfig) -> tuple[list[str], str]:
    """The run directory's read-only checks before any worker starts (``--check``; auto's probe, :func:`probe`):
    another syncwise run holding it, or :func:`check_run_dir`'s refusals, as one ConfigError naming ``run_dir``;
    RunFinished passes through (not a failure); else :func:`check_run_dir`'s answer."""
    if not cfg.run_dir:
        return [], ""
    try:
        busy = rundir.holder(cfg.run_dir)
        if busy:
            raise SyncwiseError(f"it is in use by another syncwise run ({busy})")
        return check_run_dir(cfg, Path(cfg.run_dir))
    except RunFinished:
        raise
    except SyncwiseError as e:
        raise _refused(cfg, e) from None


def _refused(cfg: RunConfig, why: SyncwiseError) -> ConfigError:
    """The one line that refuses a run directory before any worker starts (``--check``, auto's probe)."""
    return ConfigError("run_dir", cfg.run_dir, f"a directory this run may use ({why})")


def check_run_dir(cfg: RunConfig, run_dir: Path) -> tuple[list[str], str]:
    """Refuse a run directory this run may not use. Reads only; returns what :func:`prepare_run_dir` sets aside (into
    RUN_DIR/failed-starts/<time>/; empty: nothing) and why: what a start that never finished a step left, or, with
    ``--resume auto``, the files of a run that has no checkpoint to continue from (the fresh run would replace them)."""
    previous = rundir.contents(run_dir)
    dead = rundir.dead_start(run_dir) if previous else None
    if dead is not None and dead != [name for name in previous if name != "checkpoints"]:
        dead = None  # something besides what a start writes (someone's own files): not ours to move
    if previous and cfg.resume == "none" and dead is None:
        # A run's rows, checkpoints or summary, or files syncwise did not write: never overwritten.
        raise SyncwiseError(rundir.holds_a_run(run_dir, previous))
    summary = _read_json(RunDir(run_dir).summary)
    if cfg.resume == "auto" and summary and int(summary.get("steps") or 0) >= cfg.train.steps:
        raise RunFinished(
            f"the run in {run_dir} already finished at step {summary['steps']} (its summary.json); nothing to "
            f"resume. To train it further, pass --resume auto with --steps larger than {summary['steps']}.")
    if dead:
        return dead, rundir.DEAD_START
    if previous and cfg.resume == "auto":
        from ..checkpoint.storage import published_checkpoints

        if not published_checkpoints(RunDir(run_dir).checkpoints):  # the trainer starts afresh: keep the rows aside
            return rundir.run_entries(run_dir), rundir.NO_CHECKPOINT
    before = _read_json(RunDir(run_dir).config)
    if previous and before:
        # The model/data layout must match the checkpoints; so must the compressor / sync strategy, whose
        # per-rank state (residuals, PowerSGD's Q, replicas) the checkpoints hold: changing them would drop it.
        # (model.moe_impl only changes how experts compute, not what: free to change.)
        fixed = {"model": ("preset", "attention"), "data": ("seq_len", "corpus"), "compress": ("method",),
                 "parallel": ("sync",)}
        try:  # a run saved before parallel.sync had that key as compress.sync
            before = upgrade_moved_keys(before, str(RunDir(run_dir).config)) or before
        except ConfigError:
            pass  # contradicts itself: resolve_config reports it
        for section, keys in fixed.items():
            for key, old in before.get(section, {}).items():
                new = getattr(getattr(cfg, section), key, old)
                if key in keys:
                    if new != old:
                        raise SyncwiseError(
                            f"--resume: the run in {run_dir} was trained with {section}.{key}={old!r}, not {new!r}; "
                            "its checkpoints cannot continue under a different model, data layout or gradient "
                            "sync (their state would be dropped). Resume without that flag (the run's saved "
                            "setting is used), or start a new run with another --run-dir.")
    return [], ""


# What a resumed run does not take from its saved config.json: where it runs, how, and the faults of the
# first attempt (a kill fired once already; a NaN fault must not hit the redone steps again).
_PER_INVOCATION = ("run_dir", "resume", "inject_fault")

# The layout is one thing: giving any of its degrees at resume replaces the saved layout as a whole (the degrees
# not given take their defaults), so a resumed DDP -> FSDP2 run does not carry dp_shard 2 into a later --parallel.tp 2.
LAYOUT_DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "ep")
# ... and what shapes the saved pipeline, replaced with it (a new pp degree does not keep the old schedule's shape)
LAYOUT_KEYS = LAYOUT_DEGREES + ("pp_schedule", "microbatches", "stages_per_rank")
LAYOUT_RULE = ("giving any --parallel.{dp_replicate,dp_shard,tp,pp,ep} at --resume replaces the saved layout as a "
               "whole (degrees not given take their defaults), not merged degree by degree")


def _gives_degree(file_values: dict | None, overrides: dict) -> bool:
    """Whether the user's flags or TOML file name a layout degree (LAYOUT_DEGREES)."""
    table = (file_values or {}).get("parallel")
    return any(f"parallel.{d}" in overrides for d in LAYOUT_DEGREES) or (
        isinstance(table, dict) and any(d in table for d in LAYOUT_DEGREES))


def resolve_config(file_values: dict | None, overrides: dict, probe=None) -> RunConfig:
    """The run's configuration. Resuming (``--resume`` not 'none') a run directory with a ``config.json``
    continues with that saved configuration; the user's TOML file and flags override it where given, except the
    layout: giving any of its degrees replaces the saved layout as a whole (``LAYOUT_RULE``, docs/resume.md).
    ``probe``: auto's start-up probe (:func:`probe`; ``config.resolve_auto``) of a new run; a resumed one is not
    probed (its checkpoints hold the strategy it started with: ``check_run_dir``)."""
    file_values = upgrade_moved_keys(file_values, "the configuration file")  # merged below under the new names
    overrides = upgrade_moved_keys(overrides, "the command line")
    cfg = build_config(file_values, overrides, announce=False)  # (read for its run directory and --resume)
    saved = _read_json(RunDir(cfg.run_dir).config) if cfg.resume != "none" and cfg.run_dir else {}
    if not saved:
        return build_config(file_values, overrides, probe=probe)
    try:  # keys that moved since the run was saved (compress.sync -> parallel.sync) under their new names
        saved = upgrade_moved_keys(saved, str(RunDir(cfg.run_dir).config)) or saved
    except ConfigError as e:
        raise SyncwiseError(f"--resume: the saved configuration of {cfg.run_dir} does not load ({e}); start a "
                            "new run, or fix its config.json") from None
    base = {k: v for k, v in saved.items() if k not in _PER_INVOCATION}
    replaced = _gives_degree(file_values, overrides) and isinstance(base.get("parallel"), dict)
    if replaced:
        before = _layout_text(base["parallel"])
        base["parallel"] = {k: v for k, v in base["parallel"].items() if k not in LAYOUT_KEYS}
    for key, value in (file_values or {}).items():  # the user's file on top of the saved run, section by section
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    try:
        resolved = build_config(base, overrides)
    except SyncwiseError as e:
        if replaced:  # the new layout does not go with the run's saved settings (its compressor, say)
            raise SyncwiseError(f"--resume with a new layout: {e} (the other settings are the run's, from "
                                f"{cfg.run_dir}/config.json)") from None
        # e.g. a saved value this version no longer accepts
        raise SyncwiseError(f"--resume: the saved configuration of {cfg.run_dir} does not load ({e}); start a "
                            "new run, or fix its config.json") from None
    if replaced:
        after = _layout_text(vars(resolved.parallel))
        if after != before:
            print(f"syncwise: note: the layout changes at resume, {before} -> {after}: {LAYOUT_RULE}",
                  file=sys.stderr, flush=True)
    return resolved


def _layout_text(parallel: dict) -> str:
    """The layout keys of a [parallel] table that differ from their defaults, as 'pp=2, pp_schedule=zbv'."""
    from ..config import ParallelSection

    defaults = vars(ParallelSection())
    return ", ".join(f"{k}={parallel[k]}" for k in LAYOUT_KEYS if k in parallel and parallel[k] != defaults[k]) \
        or "the default (DDP over every rank)"


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def interrupted_message(cfg: RunConfig, signal_name: str = "SIGINT") -> str:
    """What a user needs after stopping a run: where it was, what is saved, how to continue."""
    from ..checkpoint.storage import published_checkpoints, step_of
    from ..metrics import read_jsonl

    run_dir = Path(cfg.run_dir)
    rows = read_jsonl(RunDir(run_dir).metrics) if RunDir(run_dir).metrics.exists() else []
    step = max((int(r.get("step", 0)) for r in rows), default=0)
    saved = published_checkpoints(RunDir(run_dir).checkpoints)
    ckpt = f"last checkpoint step {step_of(saved[0])} ({saved[0]})" if saved else "no checkpoint saved yet"
    return (f"interrupted ({signal_name}) at step {step}; {ckpt}; resume with: syncwise train --run-dir "
            f"{run_dir} --resume auto" + (" (it restarts from step 0: nothing was saved)" if not saved else ""))


def launch(cfg: RunConfig) -> dict:
    """Start the workers for ``cfg`` by the launch table (``syncwise.launch.run``) and return rank 0's summary."""
    from ..launch.run import Job, Live, Worker, run_training
    from .worker import run_worker, train_worker

    ft = cfg.ft
    live = Live(ft.replicas, ft.replica_restarts, min_replicas=ft.min_replicas, quorum_timeout_s=ft.quorum_timeout_s,
                timeout_s=ft.timeout_s, heartbeat_timeout_s=ft.heartbeat_timeout_s,
                lighthouse=ft.lighthouse, device=cfg.dist.device) if ft.replicas else None
    job = Job(nproc=cfg.dist.nproc, lab=cfg.dist.lab, live=live, in_process=True, max_restarts=cfg.dist.max_restarts,
              nnodes=cfg.dist.nnodes, run_dir=cfg.run_dir, preempt_grace_s=cfg.ckpt.preempt_grace_s,
              # the elastic agent's worker logs (the lab's nodes print to this console)
              log_dir=None if cfg.dist.lab else str(RunDir(cfg.run_dir).logs))
    worker = Worker(argv=worker_argv(cfg), fn=run_worker, args=(cfg,), here=train_worker)
    return run_training(job, worker, cfg.train.steps)


class Probe:
    """auto's start-up probe for one start (``commands.auto_probe``; ``resolve_config(probe=...)``), each probe a job
    started as this command starts one — after the run directory's checks (:func:`look_at_run_dir`), so that a
    directory this run may not use is refused before any worker starts, and under the directory's lock: a second
    start on the same directory is refused at once instead of probing too. The start takes the lock over
    (``prepare_run_dir(cfg, probe.lock)``) or releases it (:meth:`release`). A call returns None (no probe: the
    catalog's figures) when the run finished already (the start says so)."""

    def __init__(self) -> None:
        self.lock: Optional[RunDirLock] = None

    def __call__(self, cfg: RunConfig, candidates) -> Optional[tuple[dict, float]]:
        from .auto_probe import run_probes

        try:
            look_at_run_dir(cfg)
        except RunFinished:
            return None
        if cfg.run_dir and self.lock is None:
            try:
                self.lock = RunDirLock(cfg.run_dir).acquire()
            except SyncwiseError as e:  # taken since the look: the same one line as look_at_run_dir's
                raise _refused(cfg, e) from None

        def start(sub: RunConfig) -> None:
            lock = prepare_run_dir(sub)
            try:
                launch(sub)
            finally:
                lock.release()
        return run_probes(cfg, candidates, start)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def probe(cfg: RunConfig, candidates) -> Optional[tuple[dict, float]]:
    """auto's start-up probe where nothing starts after it (a benchmark's ranking): :class:`Probe`, its lock
    released at the end."""
    once = Probe()
    try:
        return once(cfg, candidates)
    finally:
        once.release()


def worker_argv(cfg: RunConfig) -> list[str]:
    """The worker's command line for ``cfg`` (its saved config.json), in torchrun's form."""
    return ["-m", "syncwise.commands.worker", "--config", str(RunDir(cfg.run_dir).config)]


def _stopped(cfg: RunConfig, signal_name: str) -> int:
    """After SIGTERM/SIGUSR1/SIGINT reached this launcher: the preemption report (the workers saved and wrote
    preempted.json) with its exit code, else where the run was interrupted (128 + the signal's number)."""
    import signal

    from ..train.preemption import describe, read_marker

    record = read_marker(cfg.run_dir)
    if record:
        print(f"syncwise: {describe(record, cfg.run_dir)}", file=sys.stderr)
        return int(record.get("exit_code", 83))
    print(f"syncwise: {interrupted_message(cfg, signal_name)}", file=sys.stderr)
    return 128 + int(getattr(signal, signal_name, signal.SIGTERM))


def run(args: argparse.Namespace, extra: list[str]) -> int:
    # the configuration is validated before torch is imported: a mistake is one line in well under a second
    probed = Probe()  # holds the run directory's lock from before auto's probe, if one runs, until the run takes it
    try:
        cfg = resolve_config(load_file(args.config) if args.config else None, overrides_from_args(args, extra),
                             probe=None if args.check else probed)
    except BaseException:
        probed.release()
        raise
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ..launch.run import RunPreempted
    from ..train.preemption import Preempted, StopSignal, describe

    if args.check:  # the run directory's checks are read-only; it is neither created nor locked
        note = ""
        try:
            aside, what = look_at_run_dir(cfg)
            if aside:
                note = (f"\n# note: {cfg.run_dir} holds {what} ({', '.join(aside)}): `syncwise train` moves it "
                        f"to {RunDir(cfg.run_dir).failed_starts}/ and starts afresh")
        except RunFinished as e:
            note = f"\n# note: {e}"  # valid; `syncwise train` would say so and exit 0
        shared = placement(cfg).note  # e.g. 2 workers on one GPU: gloo, and how to get NCCL
        print(format_config(cfg) + note + (f"\n# note: {shared}" if shared else ""))
        return 0
    lock: Optional[RunDirLock] = None
    try:
        lock = prepare_run_dir(cfg, probed.lock)
    except RunFinished as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return 0
    finally:
        if probed.lock is not lock:
            probed.release()
    # Where to look while it runs: metrics.jsonl grows a row per step (a live-recovery run's too: its launcher
    # appends each step as a replica group logs it); `syncwise doctor --follow` and `syncwise report` read the
    # directory at any time (plain `syncwise doctor` wants the finished run's summary.json).
    print(f"run directory: {cfg.run_dir}  (during the run: tail -f {Path(cfg.run_dir) / 'metrics.jsonl'}; "
          f"syncwise doctor --follow {cfg.run_dir}; syncwise report {cfg.run_dir})", flush=True)
    try:
        summary = launch(cfg)
    except KeyboardInterrupt:
        print(f"syncwise: {interrupted_message(cfg)}", file=sys.stderr)
        return 130
    except SignalException as e:  # torchrun's agent turns SIGINT/SIGTERM/SIGUSR1/... into this
        return _stopped(cfg, e.sigval.name)
    except StopSignal as e:  # the lab launcher's own SIGTERM/SIGUSR1
        return _stopped(cfg, e.signal_name)
    except Preempted as e:  # one process, in this process
        return _stopped(cfg, e.signal_name)
    except RunPreempted as e:
        print(f"syncwise: {describe(e.record, cfg.run_dir)}", file=sys.stderr)
        return int(e.record.get("exit_code", 83))
    finally:
        lock.release()
    print(f"run directory: {cfg.run_dir}  (final loss {_num(summary.get('final_loss'))}, "
          f"val loss {_num(summary.get('final_val_loss'))})")
    return 0


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"
