"""Run a function on N real gloo processes (no mocks of torch.distributed).

``run_workers(fn, 2, arg)`` starts 2 fresh processes (forked from a forkserver that preloaded torch),
initialises a gloo group over loopback, calls ``fn(rank, world_size, arg)`` in each and returns the per-rank results in rank order. ``fn`` must be a
module-level function of a test module. ``local_world_size`` sets torchrun's LOCAL_* variables, so
topology code sees e.g. 2 nodes x 2 workers.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncwise.launch import free_port


def _entry(rank, fn, world_size, local_world_size, port, args, results, env, cwd):
    # The caller's environment and directory as they are now (a forkserver's child would otherwise have the
    # server's, from when the session's first call started it), as a spawned process has them.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    local = local_world_size or world_size
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # Plain pickle (by value): a tensor sent through torch's queue lives in shared memory that vanishes when this
        # process exits, possibly before the parent has read it (FileNotFoundError).
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    else:
        _wait_for_peers()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_peers():
    """Leave only when every rank's ``fn`` has returned: rank 0 holds the store, and a rank that tore its group down
    while a peer still made a group or ran a last collective reset that peer's connection (a race on a slow machine).
    A peer that failed or hangs is the parent's to report: its result (or its absence) is already on the queue, so
    a barrier that raises or times out is not this rank's error."""
    if not dist.is_initialized():
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - see the docstring
        pass


# Workers fork from one forkserver per test session, which imports torch and syncwise once: a worker starts in
# ~0.1 s instead of re-importing them (2-3 s of CPU each, the largest share of a small multi-process test on 2
# cores). Forked from a clean single-threaded server (nothing has run a torch op there), as torch allows.
# (syncwise.train's names load on first use, so its trainer module is named: preloading the package alone would
# leave every worker to import the trainer itself, ~10 % of the multi-process tests' time)
_PRELOAD = ["torch", "torch.distributed", "syncwise.train.trainer", "syncwise.models", "syncwise.parallel"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def run_workers(fn, world_size: int, *args, local_world_size: int | None = None, timeout: float = 180.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, local_world_size, port, args, results,
                                              dict(os.environ), os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for workers")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("worker failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
