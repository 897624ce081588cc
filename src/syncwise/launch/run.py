"""The one launch table: every syncwise command that starts workers asks this module (DESIGN.md §3.1c).

``syncwise train``, ``bench``, ``comm-bench``, ``cluster run`` and ``plan --calibrate`` describe *what* to start
(a :class:`Worker`: a module-level function and/or its ``-m MODULE ARGS`` command line) and *where and how* (a
:class:`Job`); :func:`route` picks the row and :func:`start` starts it. The mechanisms the rows drive stay where
they are (each starts processes only when this table calls it):

=========== ======= ============ ====================================================================================
row         where   recovery     how
=========== ======= ============ ====================================================================================
in-process  local   plain        one worker, no restarts, one node: the work runs in this process (``Worker.here``)
elastic     local   plain        torchrun's elastic agent in this process spawns ``nproc`` workers
                                 (``launch/local.run_local``; restarts, elastic ``nnodes``)
lab         lab     plain        one torchrun agent per lab node, each in its namespace (``lab/launch.lab_torchrun``)
live        local   live         torchft's lighthouse and one torchrun per replica group (``launch/ft.run_replicas``)
live-lab    lab     live         the lighthouse on node 0, replica group r on node r (``launch/ft_lab``)
copies      local   plain        N independent one-worker processes, no process group (bench's shared-CPU reference)
=========== ======= ============ ====================================================================================

:func:`run_training` is the table for a training job: the row's outcome read back as rank 0's summary, a
preemption (``RUN_DIR/preempted.json``) raised as :class:`RunPreempted`, a failure as one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Optional, Sequence

from ..errors import SyncwiseError
from ..rundir import RunDir

IN_PROCESS, ELASTIC, LAB, LIVE, LIVE_LAB, COPIES = "in-process", "elastic", "lab", "live", "live-lab", "copies"

#: row -> (where, recovery, what starts the processes)
ROWS: dict[str, tuple[str, str, str]] = {
    IN_PROCESS: ("local", "plain", "this process"),
    ELASTIC: ("local", "plain", "syncwise.launch.local.run_local"),
    LAB: ("lab", "plain", "syncwise.lab.launch.lab_torchrun"),
    LIVE: ("local", "live", "syncwise.launch.ft.run_replicas"),
    LIVE_LAB: ("lab", "live", "syncwise.launch.ft_lab.run_replicas_lab"),
    COPIES: ("local", "plain", "syncwise.launch.run.start (one process per copy)"),
}


@dataclass(frozen=True)
class Worker:
    """What each worker runs. ``argv``: its command line in torchrun's form (``['-m', MODULE, ARGS...]``, or a
    script and its arguments): what a lab node's agent, a replica group's torchrun or a copy starts. ``fn(*args)``:
    a module-level function (this machine's elastic agent spawns it). ``here``: the same work in this process,
    failures raised (the in-process row; default ``fn``). ``log``: where a copy's output goes."""
    argv: Sequence[str] = ()
    fn: Optional[Callable[..., Any]] = None
    args: tuple = ()
    here: Optional[Callable[..., Any]] = None
    log: Optional[Path] = None


@dataclass(frozen=True)
class Live:
    """Live recovery's replica groups (``ft.*``): ``replicas`` torchrun jobs of ``Job.nproc`` workers, each
    restarted ``restarts`` times; the lighthouse started here unless ``lighthouse`` names one (not in the lab)."""
    replicas: int
    restarts: int
    min_replicas: int = 1
    quorum_timeout_s: float = 60.0
    timeout_s: float = 30.0
    heartbeat_timeout_s: Optional[float] = None  # None: launch/ft's default
    lighthouse: str = ""
    device: str = "auto"  # dist.device: on CUDA each replica group gets GPUs of its own (devices.replica_gpus)


@dataclass(frozen=True)
class Job:
    """Where and how the workers run. ``nproc``: workers per node (the lab: None takes its ``procs_per_node``).
    ``in_process``: a one-worker job may run in this process. ``preempt_grace_s``: a training job's
    ``ckpt.preempt_grace_s`` (None: not a job that saves on SIGTERM): how long the agents wait for the workers to
    save when stopped. ``copies``: run each worker given as its own process."""
    nproc: Optional[int] = 1
    lab: bool = False
    lab_prefix: Optional[str] = None
    live: Optional[Live] = None
    copies: bool = False
    in_process: bool = False
    max_restarts: int = 0
    nnodes: str = "1"
    run_dir: Optional[str] = None
    log_dir: Optional[str] = None
    console: Optional[IO[bytes]] = None
    script: bool = False
    timeout_s: Optional[float] = None
    preempt_grace_s: Optional[float] = None
    threads: Optional[int] = None  # copies: OMP_NUM_THREADS of each


@dataclass
class Outcome:
    """What a row returns: ``results`` (rank -> the worker function's return value: the in-process and elastic
    rows) or ``codes`` (the exit code of the lab job, of each replica group, of each copy)."""
    row: str
    results: dict[int, Any] = field(default_factory=dict)
    codes: list[int] = field(default_factory=list)


class RunPreempted(Exception):
    """The workers stopped for SIGTERM/SIGUSR1 and said so in ``RUN_DIR/preempted.json`` (``record``)."""

    def __init__(self, record: dict):
        super().__init__(record)
        self.record = record


def route(job: Job) -> str:
    """The row of the table that starts ``job``."""
    if job.copies:
        return COPIES
    if job.live is not None:
        return LIVE_LAB if job.lab else LIVE
    if job.lab:
        return LAB
    if job.in_process and job.nproc == 1 and job.max_restarts == 0 and job.nnodes == "1":
        return IN_PROCESS
    return ELASTIC


def start(job: Job, *workers: Worker) -> Outcome:
    """Start ``job``'s workers by its row and wait for them. One worker description, except the copies row (one
    per copy). Exceptions of the mechanism (torch-elastic's ``ChildFailedError``, a signal) reach the caller."""
    row = route(job)
    if row == COPIES:
        return Outcome(row, codes=_copies(job, workers))
    if len(workers) != 1:
        raise ValueError(f"the {row} row starts one worker description, not {len(workers)}")
    worker = workers[0]
    if row == IN_PROCESS:
        here = worker.here or worker.fn
        assert here is not None, "the in-process row needs Worker.here or Worker.fn"
        return Outcome(row, results={0: here(*worker.args)})
    if row == ELASTIC:
        from .local import run_local

        assert worker.fn is not None, "this machine's elastic agent spawns Worker.fn"
        grace = job.preempt_grace_s
        return Outcome(row, results=run_local(worker.fn, job.nproc, *worker.args, max_restarts=job.max_restarts,
                                              log_dir=job.log_dir, nnodes=job.nnodes,
                                              shutdown_grace_s=grace + 5 if grace else None))
    if row == LAB:
        return Outcome(row, codes=[_lab(job, worker)])
    return Outcome(row, codes=_live(job, worker))


def launch(*, argv: Sequence[str] = (), fn: Optional[Callable[..., Any]] = None, args: tuple = (),
           **job: Any) -> Outcome:
    """``start(Job(**job), Worker(argv, fn, args))``: for a caller below this layer (``plan.calibrate``), which
    is handed this function and cannot name the classes."""
    return start(Job(**job), Worker(argv=argv, fn=fn, args=args))


def _lab(job: Job, worker: Worker) -> int:
    from ..lab.launch import lab_torchrun

    options: dict[str, Any] = {"nproc_per_node": job.nproc, "max_restarts": job.max_restarts, "script": job.script,
                               "log_dir": job.log_dir, "timeout": job.timeout_s, "console": job.console}
    if job.lab_prefix:
        options["prefix"] = job.lab_prefix
    if job.preempt_grace_s is None:
        return lab_torchrun(list(worker.argv), **options)
    from ..train.preemption import signals_raise

    # SIGTERM/SIGUSR1 here stop the lab's agents with SIGTERM; each forwards it to its workers, which save within
    # the grace (the agents wait that long, and so does the lab launcher before it kills anything).
    grace = job.preempt_grace_s
    with signals_raise():
        return lab_torchrun(list(worker.argv), env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(grace) + 5)},
                            stop_grace=grace + 10, **options)


def _live(job: Job, worker: Worker) -> list[int]:
    live = job.live
    assert live is not None and job.run_dir and job.nproc
    heartbeat = {} if live.heartbeat_timeout_s is None else {"heartbeat_timeout_s": live.heartbeat_timeout_s}
    if job.lab:  # one replica group per lab node, the lighthouse on node 0
        from .ft_lab import run_replicas_lab

        return run_replicas_lab(list(worker.argv), job.run_dir, live.replicas, job.nproc, live.restarts,
                                min_replicas=live.min_replicas, quorum_timeout_s=live.quorum_timeout_s,
                                timeout_s=live.timeout_s, device=live.device, **heartbeat)
    from .ft import run_replicas

    return run_replicas(list(worker.argv), job.run_dir, live.replicas, job.nproc, live.restarts,
                        lighthouse=live.lighthouse, min_replicas=live.min_replicas,
                        quorum_timeout_s=live.quorum_timeout_s, timeout_s=live.timeout_s, device=live.device,
                        **heartbeat)


def _copies(job: Job, workers: Sequence[Worker]) -> list[int]:
    """Each worker as its own process of this interpreter (no process group: no communication), its output in
    ``Worker.log``; wait for all; their exit codes."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if job.threads is not None:
        env["OMP_NUM_THREADS"] = str(job.threads)
    procs = []
    for worker in workers:
        assert worker.log is not None, "a copy's output goes to Worker.log"
        with open(worker.log, "wb") as log:
            procs.append(subprocess.Popen([sys.executable, *worker.argv], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return [p.wait() for p in procs]


# ------------------------------------------------------------------------------------------------ training jobs
def run_training(job: Job, worker: Worker, steps: int) -> dict:
    """Start a training job (``RUN_DIR/config.json`` written) by the table and return rank 0's summary; a
    preempted job raises :class:`RunPreempted`, a failed one ``SyncwiseError`` (one line: where to look)."""
    from ..train.preemption import read_marker

    assert job.run_dir
    row = route(job)
    if row in (LIVE, LIVE_LAB):
        return _live_training(job, worker, steps)
    if row == LAB:
        code = start(job, worker).codes[0]
        if code != 0:
            if read_marker(job.run_dir):
                raise RunPreempted(read_marker(job.run_dir))
            raise SyncwiseError(f"the lab job failed (exit code {code}); see the worker output above")
        return json.loads(RunDir(job.run_dir).summary.read_text())
    if row == IN_PROCESS:
        return start(job, worker).results[0]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        results = start(job, worker).results
    except ChildFailedError as e:
        if read_marker(job.run_dir):  # a worker was signalled (not this launcher): the workers stopped and saved
            raise RunPreempted(read_marker(job.run_dir)) from None
        rank, failure = e.get_first_failure()
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        raise SyncwiseError(f"worker rank {rank} failed: {message or 'exit code ' + str(failure.exitcode)}"
                            f" (worker logs: {Path(job.run_dir) / 'logs'}; SYNCWISE_DEBUG=1 shows the agent's "
                            "tracebacks)") from None
    except ValueError as e:  # e.g. JSONDecodeError: torch-elastic could not read a worker's error file
        from ..checkpoint.storage import disk_full_hint

        raise SyncwiseError(f"the workers failed and torch-elastic could not read their error reports "
                            f"({type(e).__name__}: {e}){disk_full_hint(job.run_dir)}; each worker's own "
                            "message is printed above") from None
    return results[0]


def _live_training(job: Job, worker: Worker, steps: int) -> dict:
    """The lighthouse and the replica groups, then the run's merged metrics.jsonl and summary.json. Fails when a
    replica group ended in failure (its restarts spent) and no replica finished the run."""
    from .ft import check_outcome, merge_metrics

    live = job.live
    assert live is not None and job.run_dir
    print(f"syncwise: live recovery: {live.replicas} replica groups of {job.nproc} worker(s), lighthouse "
          f"{live.lighthouse or 'started here'}; replica logs in {Path(job.run_dir) / 'ft'}", flush=True)
    codes = start(job, worker).codes
    summary = merge_metrics(job.run_dir, steps, live.replicas)
    summary["live_recovery"]["exit_codes"] = codes
    try:  # a replica group that failed for good is named, in summary.json and the exit code
        check_outcome(summary, codes, steps, job.run_dir)
    finally:
        RunDir(job.run_dir).summary.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
