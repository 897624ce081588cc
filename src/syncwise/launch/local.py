"""Start N local workers through torchrun's elastic launch API (never hand-rolled multiprocessing)."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import uuid
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..train.preemption import TORCHRUN_SIGNALS
from .. import bind


def free_port() -> int:
    """A TCP port free on this job's address right now (for the c10d rendezvous store)."""
    return bind.free_port()


def threads_per_worker(nproc: int) -> int:
    """Split this machine's cores evenly so N workers never oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """torchrun's ``--nnodes`` syntax: 'N' or 'MIN:MAX'."""
    lo, _, hi = str(nnodes).partition(":")
    return int(lo), int(hi or lo)


def run_local(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0,
              run_id: str | None = None, log_dir: str | None = None, nnodes: str = "1",
              shutdown_grace_s: float | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` workers started by torchrun's elastic agent; return {rank: result}.

    ``nnodes='1:2'`` makes this agent one node of an elastic job that may grow to 2 (other nodes join
    through the same c10d rendezvous); ``max_restarts`` lets the agent restart the group after a failure.

    Workers find RANK/WORLD_SIZE/MASTER_ADDR in their environment as under ``torchrun``.
    ``fn`` must be a module-level function (workers are spawned). On SIGTERM or SIGUSR1 the agent forwards the
    signal to the workers and waits ``shutdown_grace_s`` seconds (torch's default: 30) before killing them.
    """
    # Field notes: sharing the rendezvous TCP store makes restarts flaky on gloo; a separate store is reliable.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    # Every endpoint of the job (rendezvous and workers' stores, gloo) on one address: a local run is on this
    # machine alone (its rendezvous was always 127.0.0.1), so loopback (bind.py, docs/security.md)
    host = bind.bind_host(nodes=1)
    bind.job_env(host)
    if not os.environ.get("SYNCWISE_DEBUG"):
        # The agent logs every worker failure with a full traceback; syncwise reports failures itself. Its
        # modules' loggers carry their own levels, so each is quietened, not just the parent.
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    min_nodes, max_nodes = parse_nnodes(nnodes)
    known = {f.name for f in dataclasses.fields(LaunchConfig)}  # torch >= 2.9 has both
    # The agent forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT by default; SIGUSR1 (Slurm's "time is nearly up") is added,
    # else it kills the agent: the workers then stop and save (train/preemption.py).
    signals = {"signals_to_handle": TORCHRUN_SIGNALS} if "signals_to_handle" in known else {}
    if shutdown_grace_s and "shutdown_timeout" in known:
        signals["shutdown_timeout"] = int(shutdown_grace_s + 0.999)
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
        # Field notes: with an elastic range each rendezvous otherwise waits 30 s for optional nodes.
        rdzv_configs={"last_call_timeout": 3} if max_nodes > min_nodes else {}, run_id=run_id or uuid.uuid4().hex[:8],
        rdzv_backend=bind.register_rendezvous(),
        rdzv_endpoint=bind.hostport(host, _rendezvous_port(host, max_nodes)),
        local_addr=host, max_restarts=max_restarts,
        monitor_interval=0.5, start_method="spawn", **({"logs_specs": _logs(log_dir)} if log_dir else {}), **signals,
    )
    # The agent installs its handlers for those signals in this process and leaves them there: put back the
    # caller's, so a later train() in this process (or a test) finds the signals as they were.
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in TORCHRUN_SIGNALS.split(","))}
    try:
        return elastic_launch(config, fn)(*args)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _rendezvous_port(host: str, max_nodes: int) -> int:
    """The rendezvous store's port: 0 for a job of this machine alone, so that the agent's store binds a free port
    itself (as ``torchrun --standalone`` does; a port chosen here and bound later can be taken meanwhile by another
    job: "Address already in use"), and the workers share that store (torch's agent store). A job other nodes
    join must name its port in advance."""
    return 0 if max_nodes == 1 else bind.free_port(host)


def _logs(log_dir: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=log_dir)
