"""Live recovery across the network lab: torchft's lighthouse on node 0 and one replica group per lab node.

``syncwise train --lab --ft.replicas=N`` (and ``benchmarks/live_recovery.py --lab``): replica group ``r`` is a
torchrun job of ``dist.nproc`` workers inside node ``r``'s network namespace (``syncwise.launch.ft.replica_command``:
its own rendezvous on the node's loopback), so its cross-replica all-reduces and the healing transfer cross the
node's shaped link. What the lab adds to ``syncwise.launch.ft.run_replicas``:

- every process of node ``r`` runs in its own UTS namespace whose host name is the node's namespace name, which
  the lab's ``/etc/hosts`` maps to the node's address: torchft advertises ``socket.gethostname()`` for its manager
  and its HTTP checkpoint server, and the lab's nodes otherwise share this machine's one host name (a peer would
  reach itself); ``SYNCWISE_FT_HOST`` says the same to syncwise's manager;
- a replica group whose torchrun ends in failure (its workers' restarts spent, or the whole node killed:
  ``kill_node``) is relaunched on its node, ``relaunches`` times — what a scheduler does with a lost node (Slurm's
  relaunch of the step, Kubernetes' replacement pod); each relaunch's attempts get run directories of their own
  (``SYNCWISE_FT_FIRST_ATTEMPT``) and heal from a live peer.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from ..errors import ConfigError, SyncwiseError
from ..lab.cluster import PREFIX, LabLock, LabState, node_command, require
from ..lab.launch import omp_threads
from .ft import (FT_DIR, HEARTBEAT_TIMEOUT_S, LiveRows, _attempts, _lighthouse_program, heartbeat_ms,
                 lighthouse_died, replica_command, replica_env, replica_gpu_env)
from ..secret import ENV_SECRET_FILE, create_secret
from .. import live_env

#: a relaunched replica group's attempt numbers start here times the relaunch (its torchrun counts from 0 again)
ATTEMPT_BASE_ENV = live_env.FIRST_ATTEMPT  # LiveRecovery.run_dir adds torchrun's restart count


def in_node(state: LabState, node: int, argv: Sequence[str]) -> list[str]:
    """``argv`` inside lab node ``node``: its network namespace and a UTS namespace named after it."""
    ns = state.node(node).namespace
    return node_command(state, node, ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns, *argv])


def node_pids(state: LabState, node: int) -> list[int]:
    """Every process in lab node ``node``'s network namespace."""
    out = subprocess.run(["ip", "netns", "pids", state.node(node).namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_node(node: int, prefix: str = PREFIX) -> int:
    """SIGKILL every process of a lab node (a node that dies: its agent, workers and anything else on it); returns
    how many were killed."""
    pids = node_pids(require(prefix), node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(pids)


def wait_listening(state: LabState, node: int, port: int, proc: subprocess.Popen, log: Path) -> None:
    """Until torchft's lighthouse ``proc`` accepts connections on lab node ``node``'s address (30 s at most)."""
    address = state.node(node).address
    deadline = time.monotonic() + 30
    probe = node_command(state, node, ["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"])
    while subprocess.run(probe, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SyncwiseError(f"torchft's lighthouse did not start on lab node {node} (see {log})")
        time.sleep(0.2)


def run_replicas_lab(module_args: Sequence[str], run_dir: str | Path, replicas: int, nproc: int, restarts: int,
                     min_replicas: int = 1, quorum_timeout_s: float = 60.0, timeout_s: float = 30.0,
                     relaunches: Optional[int] = None, prefix: str = PREFIX,
                     heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, device: str = "auto") -> list[int]:
    """The lighthouse on lab node 0 and replica group ``r`` on node ``r`` (``replicas`` ≤ the lab's nodes); wait
    for all; return each group's last exit code. ``relaunches`` (default ``restarts``): how often a group whose
    torchrun failed is started again on its node. Logs: ``RUN_DIR/ft/replica{R}.log``, ``lighthouse.log``.
    ``device``: the job's dist.device; the lab's nodes are namespaces of this machine, so on CUDA each node's group
    gets GPUs of its own as on one machine (``launch.ft.replica_gpu_env``; unverified on GPUs: no GPU machine here)."""
    with LabLock(prefix, exclusive=False):  # `cluster down` refuses to tear the lab down under the job
        state = require(prefix)
        if replicas > state.num_nodes:
            raise ConfigError("ft.replicas", replicas, f"at most the lab's {state.num_nodes} nodes (one replica group "
                              f"per node; `syncwise cluster up --nodes {replicas}`)")
        gpu_env = replica_gpu_env(device, replicas, nproc)
        return _run(state, list(module_args), Path(run_dir), replicas, nproc, restarts, min_replicas,
                    quorum_timeout_s, timeout_s, restarts if relaunches is None else relaunches,
                    heartbeat_timeout_s, gpu_env)


def _run(state: LabState, module_args: list[str], run_dir: Path, replicas: int, nproc: int, restarts: int,
         min_replicas: int, quorum_timeout_s: float, timeout_s: float, relaunches: int,
         heartbeat_timeout_s: float, gpu_env: Optional[list[dict[str, str]]] = None) -> list[int]:
    ft_dir = run_dir / FT_DIR
    ft_dir.mkdir(parents=True, exist_ok=True)
    # as run_replicas: a launch of a resumed run numbers its attempts after the earlier ones; old status files go
    first_attempt = 1 + max((a for _, a, _ in _attempts(run_dir)), default=-1)
    shutil.rmtree(ft_dir / "status", ignore_errors=True)
    port = random.randint(20000, 28999)  # fresh namespaces: any port is free; random avoids TIME_WAIT
    lh_log = open(ft_dir / "lighthouse.log", "ab")
    # a replica dead or stopped is dropped once its heartbeat is this late (as run_replicas does)
    lighthouse = subprocess.Popen(
        in_node(state, 0, [_lighthouse_program(), "--bind", f"{state.node(0).address}:{port}", "--min_replicas", str(min_replicas),
                           "--heartbeat_timeout_ms", str(heartbeat_ms(heartbeat_timeout_s, timeout_s))]),
        stdout=lh_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    procs: dict[int, subprocess.Popen] = {}
    logs = []
    rows = LiveRows(run_dir)  # the run's metrics.jsonl as the groups train (as run_replicas writes it)
    try:
        wait_listening(state, 0, port, lighthouse, ft_dir / "lighthouse.log")
        address = f"http://{state.node(0).namespace}:{port}"
        threads = str(omp_threads(state, nproc))

        def start(r: int, launch: int) -> subprocess.Popen:
            n = state.node(r)
            env = replica_env(r, replicas, address, nproc, min_replicas, quorum_timeout_s, timeout_s,
                              str(ft_dir / "status"), host=n.address)  # (its manager and heal server listen there)
            env[ENV_SECRET_FILE] = str(create_secret(run_dir))
            env.update({"GLOO_SOCKET_IFNAME": n.ifname, "OMP_NUM_THREADS": threads, live_env.HOST: n.namespace,
                        ATTEMPT_BASE_ENV: str(first_attempt + launch * (restarts + 1))})
            if gpu_env and gpu_env[r]:  # (CUDA: its own GPUs, and NCCL's sockets on the node's shaped link)
                env.update({**gpu_env[r], "NCCL_SOCKET_IFNAME": n.ifname})
            log = open(ft_dir / f"replica{r}.log", "ab")
            logs.append(log)
            return subprocess.Popen(in_node(state, r, replica_command(module_args, nproc, restarts, host=n.address)), env=env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

        launches = {r: 0 for r in range(replicas)}
        codes: dict[int, int] = {}
        procs = {r: start(r, 0) for r in range(replicas)}
        while len(codes) < replicas:
            if lighthouse.poll() is not None:  # (named at once, as run_replicas does: no quorum forms without it)
                raise lighthouse_died(lighthouse, address, run_dir)
            for r, p in list(procs.items()):
                code = p.poll()
                if code is None or r in codes:
                    continue
                if code != 0 and launches[r] < relaunches and any(q.poll() is None for q in procs.values()):
                    launches[r] += 1  # the node's replica group is gone: start a replacement there
                    print(f"syncwise lab: replica {r} (node {r}) ended with exit code {code}; relaunching it "
                          f"({launches[r]}/{relaunches})", flush=True)
                    procs[r] = start(r, launches[r])
                else:
                    codes[r] = code
            rows.poll()
            time.sleep(0.2)
        return [codes[r] for r in range(replicas)]
    finally:
        for p in (*procs.values(), lighthouse):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + 30
        for p in (*procs.values(), lighthouse):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in (*logs, lh_log):
            log.close()
        rows.close()
