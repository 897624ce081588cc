"""Start N local workers through torchrun's elastic launch API (never hand-rolled multiprocessing)."""
from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    """A TCP port free on this host right now (for the c10d rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_worker(nproc: int) -> int:
    """Split this machine's cores evenly so N workers never oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def run_local(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0,
              run_id: str | None = None, log_dir: str | None = None) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` workers started by torchrun's elastic agent; return {rank: result}.

    Workers find RANK/WORLD_SIZE/MASTER_ADDR in their environment as under ``torchrun``.
    ``fn`` must be a module-level function (workers are spawned).
    """
    # Field notes: sharing the rendezvous TCP store makes restarts flaky on gloo; a separate store is reliable.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    if not os.environ.get("SYNCWISE_DEBUG"):
        # The agent logs every worker failure with a full traceback; syncwise reports failures itself.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id or uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
        monitor_interval=0.5, start_method="spawn", **({"logs_specs": _logs(log_dir)} if log_dir else {}),
    )
    return elastic_launch(config, fn)(*args)


def _logs(log_dir: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=log_dir)
