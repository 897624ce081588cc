"""A run directory: every path in it named once (:class:`RunDir`), and the OS-level lock held for the run's life.

``syncwise train`` takes an exclusive ``flock`` on ``RUN_DIR/.syncwise.lock`` *before* it looks at what the
directory holds, so two runs started at the same moment cannot both pass the "already holds a run" check:
the second is refused at once, naming the holder. The kernel drops the lock when the holding process exits
for any reason (even SIGKILL), so a crashed run never leaves a stale lock behind. Workers started by
``syncwise train`` find ``SYNCWISE_RUN_DIR_LOCKED`` in their environment and do not lock again; a job
started with plain ``torchrun -m syncwise.commands.worker`` (or its alias ``-m syncwise.train``) takes the lock
in rank 0.

flock is local to one machine (and unreliable on some network filesystems): on a cluster the lock
protects against a second launch on the same node, which is where the mix-ups were seen.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Optional

from .errors import SyncwiseError

LOCK_FILE = ".syncwise.lock"
FAILED_STARTS = "failed-starts"  # RUN_DIR/failed-starts/<time>/: what a start that never finished a step left
LOCKED_ENV = "SYNCWISE_RUN_DIR_LOCKED"  # set for workers: the launcher holds the lock of this directory


class RunDir:
    """Every path of a run directory, named here and nowhere else (docs/report.md lists what each holds)::

        config.json      the resolved configuration the workers ran (syncwise train)
        metrics.jsonl    one row per step (rank 0), read by report, doctor and a resumed run
        summary.json     the run's totals, written at its end
        preempted.json   written when a signal stopped the run (exit 83)
        checkpoints/     step_N/ checkpoints (DCP) with their manifest.json
        ranks/           each rank's own rows (rank{R}.jsonl) and collective arrivals (arrivals{R}.jsonl)
        heartbeats/      each rank's last phase, for the hang report
        ft/              live recovery: each replica group attempt's own run directory and log
        logs/            the workers' own output (torch-elastic's per-rank logs)
        traces/          profiler traces of the steps --profile.* chose (rank{R}.step{A}-{B}.json, Chrome/Kineto)
        flight/          each rank's flight-recorder dump, written when a collective hung (rank{R}.json)
        job.secret       the per-job secret (mode 0600) that signs live recovery's heal transfers (secret.py)
        tb/              TensorBoard's events (when tensorboard is installed)
        faults/          which planted faults fired already (--inject-fault)
        failed-starts/   each start that ended before its first step, set aside whole by the next start
    """

    METRICS, SUMMARY = "metrics.jsonl", "summary.json"  # (their names alone, for messages about a run with no directory)

    def __init__(self, root: "str | os.PathLike"):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __fspath__(self) -> str:
        return str(self.root)

    config = property(lambda self: self.root / "config.json")
    metrics = property(lambda self: self.root / self.METRICS)
    summary = property(lambda self: self.root / self.SUMMARY)
    preempted = property(lambda self: self.root / "preempted.json")
    checkpoints = property(lambda self: self.root / "checkpoints")
    ranks = property(lambda self: self.root / "ranks")
    heartbeats = property(lambda self: self.root / "heartbeats")
    ft = property(lambda self: self.root / "ft")
    logs = property(lambda self: self.root / "logs")
    traces = property(lambda self: self.root / "traces")
    flight = property(lambda self: self.root / "flight")
    secret = property(lambda self: self.root / "job.secret")
    tb = property(lambda self: self.root / "tb")
    faults = property(lambda self: self.root / "faults")
    failed_starts = property(lambda self: self.root / FAILED_STARTS)
    lock = property(lambda self: self.root / LOCK_FILE)

    def rank_log(self, rank: int) -> Path:
        return self.ranks / f"rank{rank}.jsonl"

    def arrivals(self, rank: int) -> Path:
        return self.ranks / f"arrivals{rank}.jsonl"

    def flight_dump(self, rank: int) -> Path:
        return self.flight / f"rank{rank}.json"

    def run_files(self) -> tuple[Path, ...]:
        """What the trainer writes: finding one of these means a run was there."""
        return self.metrics, self.summary, self.preempted

    def holds_a_run(self) -> bool:
        """Whether anything of a run (its configuration, rows or checkpoints) is here."""
        return any(p.exists() for p in (self.config, self.metrics, self.checkpoints))


class RunDirLock:
    """Exclusive ownership of a run directory; ``acquire`` raises SyncwiseError if another run holds it."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = RunDir(run_dir).lock
        self._fd: Optional[int] = None
        self._outer: Optional[str] = None  # the directory LOCKED_ENV named before: a lock taken inside another's

    def acquire(self) -> "RunDirLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        except OSError as e:
            raise SyncwiseError(f"cannot use the run directory {self.run_dir}: {e.strerror or e}. Choose a "
                                "directory you can write to with --run-dir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise SyncwiseError(
                f"the run directory {self.run_dir} is in use by another syncwise run ({holder}). Nothing was "
                "started. Wait for that run to end (or stop it), or choose another --run-dir.") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        self._outer = os.environ.get(LOCKED_ENV)
        os.environ[LOCKED_ENV] = str(self.run_dir.resolve())
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        if os.environ.get(LOCKED_ENV) == str(self.run_dir.resolve()):
            if self._outer is not None:  # a lock taken while another was held (auto's probe runs): that one again
                os.environ[LOCKED_ENV] = self._outer
            else:
                del os.environ[LOCKED_ENV]
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunDirLock":
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(run_dir: str | os.PathLike) -> Optional[str]:
    """Who holds the lock of ``run_dir`` right now (None if nobody); creates nothing (``--check``)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _describe(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)


def held_by_launcher(run_dir: str | os.PathLike) -> bool:
    """True in a worker whose launcher (``syncwise train``) holds the lock of ``run_dir``."""
    return os.environ.get(LOCKED_ENV) == str(Path(run_dir).resolve())


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "its process id is not recorded yet"


def holds_a_run(where: str | os.PathLike, found: list[str], resume: str = "--resume auto",
                other: str = "--run-dir") -> str:
    """The refusal to start a fresh run over a previous one (the command line's and the Python API's words)."""
    shown = ", ".join(found[:6]) + (" ..." if len(found) > 6 else "")
    return (f"the run directory {where} already holds a run ({shown}). Nothing was started, so nothing of it is "
            f"overwritten: pass {resume} to continue that run, or choose another {other}.")


def contents(run_dir: str | os.PathLike) -> list[str]:
    """What a run directory holds besides its lock file and the starts set aside before (sorted names)."""
    p = Path(run_dir)
    if not p.is_dir():
        return []
    return sorted(e.name for e in p.iterdir() if e.name not in (LOCK_FILE, FAILED_STARTS))


# What a start writes before its first step: the launcher's (config.json, the workers' logs) and the trainer's.
# (summary.json and preempted.json are written only after a step: never a dead start's.)
TRAINER_START_NAMES = ("metrics.jsonl", "ranks", "heartbeats", "tb", "flight", "traces", "faults", "checkpoints")
START_NAMES = ("config.json", "logs", "job.secret", "ft") + TRAINER_START_NAMES


def finished_a_step(run_dir: str | os.PathLike) -> bool:
    """Whether what syncwise wrote in ``run_dir`` (:data:`START_NAMES`) shows a step that finished: a summary.json or
    preempted.json, a row in a metrics.jsonl or a rank's own rank{R}.jsonl (live recovery's replica directories under
    ft/ included), or anything under a checkpoints/ directory (a published save, or one being written)."""
    root = Path(run_dir)
    if any((root / name).exists() for name in (RunDir.SUMMARY, "preempted.json")):
        return True
    for top in START_NAMES:
        if (root / top).is_file():
            if top == RunDir.METRICS and _has_rows(root / top):
                return True
            continue
        for here, dirs, files in os.walk(root / top):
            name = os.path.basename(here)
            if name == "checkpoints" and (dirs or files):
                return True
            for f in files:
                if f in (RunDir.SUMMARY, "preempted.json"):
                    return True
                if (f == RunDir.METRICS or (name == "ranks" and f.startswith("rank") and f.endswith(".jsonl"))) \
                        and _has_rows(Path(here) / f):
                    return True
    return False


def _has_rows(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return any(line.strip() for line in f)
    except OSError:
        return True  # unreadable: not known to be empty


def dead_start(run_dir: str | os.PathLike, names: tuple[str, ...] = START_NAMES) -> Optional[list[str]]:
    """The entries of ``run_dir`` (among ``names``) that a start which never finished a step left, to be set aside
    by :func:`set_aside`; None when anything there shows a finished step (:func:`finished_a_step`). Entries that are
    not among ``names`` (someone's own files) are neither listed nor looked at here, nor is an empty checkpoints/
    (a checkpointer may hold it already; a non-empty one is a finished step's)."""
    root = Path(run_dir)
    if not root.is_dir() or finished_a_step(root):
        return None
    return sorted(e.name for e in root.iterdir() if e.name in names and e.name != "checkpoints")


def set_aside(run_dir: str | os.PathLike, names: list[str]) -> Path:
    """Move ``names`` (a dead start's entries, :func:`dead_start`) into ``RUN_DIR/failed-starts/<time>/``, whole
    (renamed, never copied or deleted); returns that folder."""
    root = Path(run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        (root / FAILED_STARTS).mkdir(exist_ok=True)
        dest, n = root / FAILED_STARTS / stamp, 1
        while True:  # two starts set aside within one second get -2, -3, ...
            try:
                dest.mkdir()
                break
            except FileExistsError:
                n += 1
                dest = root / FAILED_STARTS / f"{stamp}-{n}"
        for name in names:
            os.rename(root / name, dest / name)
    except OSError as e:
        raise SyncwiseError(f"cannot set aside what a start that never finished a step left in {root} "
                            f"({', '.join(names)}) under {root / FAILED_STARTS}: {e.strerror or e}. Nothing was "
                            "started; move those entries away yourself, or choose another run directory.") from None
    return dest


DEAD_START = "only what a start that never finished a step left"
NO_CHECKPOINT = "a run with no checkpoint to continue from"


def set_aside_note(run_dir: str | os.PathLike, names: list[str], dest: Path, what: str = DEAD_START) -> str:
    """The one line that says a dead start (or, with ``--resume auto``, a run with no checkpoint) was set aside."""
    return (f"syncwise: {run_dir} held {what} ({', '.join(names)}); moved it to {dest} (nothing deleted), "
            "starting afresh")


def run_entries(run_dir: str | os.PathLike, names: tuple[str, ...] = START_NAMES) -> list[str]:
    """What a run wrote in ``run_dir``: its entries among ``names``, summary.json and preempted.json (an empty or
    checkpoint-less checkpoints/ is not listed). ``--resume auto`` with no checkpoint to continue from starts afresh:
    these are set aside (:func:`set_aside`) rather than replaced."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    keep = set(names) | {RunDir.SUMMARY, "preempted.json"}
    return sorted(e.name for e in root.iterdir() if e.name in keep and e.name != "checkpoints")
