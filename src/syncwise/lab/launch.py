"""Run a real multi-node torchrun job across the lab's nodes: one elastic agent per namespace.

All namespaces share one hostname, so two torchrun flags are needed (measured, FIELD-NOTES.md):
``--rdzv-conf is_host=1`` on node 0 only (else every agent tries to host the store and they time
out), and ``--local-addr <node address>`` (else the agents advertise the shared hostname and hang).
Gloo is pinned to the node's veth with ``GLOO_SOCKET_IFNAME`` so inter-node traffic crosses the
shaped link; processes on the same node reach each other through the namespace's loopback.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from ..errors import ConfigError, SyncwiseError
from .cluster import PREFIX, LabLock, LabState, node_command, require


def omp_threads(state: LabState, nproc_per_node: int) -> int:
    """Threads per worker so all workers of all nodes together use this host's cores once."""
    return max(1, (os.cpu_count() or 1) // (state.num_nodes * nproc_per_node))


def torchrun_argv(state: LabState, node: int, module_args: Sequence[str], nproc_per_node: int, run_id: str,
                  port: int, max_restarts: int = 0, extra_torchrun_args: Sequence[str] = (),
                  script: bool = False) -> list[str]:
    """The torchrun command line (without the namespace wrapper) for one node's agent."""
    n, host = state.node(node), state.nodes[0]
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(state.num_nodes), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host.address}:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "--local-addr", n.address,
            "--max-restarts", str(max_restarts), *extra_torchrun_args,
            *([] if script else ["-m"]), *module_args]


def _pump(src: IO[bytes], sinks: list[IO[bytes]], prefix: bytes) -> None:
    # Copy line by line so node 0's output reaches the console as it happens.
    for line in iter(src.readline, b""):
        for sink in sinks:
            try:
                sink.write(prefix + line)
                sink.flush()
            except (ValueError, OSError):  # console closed: keep draining so the child never blocks
                pass
    src.close()


class _TextSink:
    # Lets the byte pumps write to a text-only stdout (e.g. a replaced sys.stdout).
    def __init__(self, text: IO[str]):
        self._text = text

    def write(self, data: bytes) -> None:
        self._text.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self._text.flush()


def _stdout_bytes() -> IO[bytes]:
    buf = getattr(sys.stdout, "buffer", None)
    return buf if buf is not None else _TextSink(sys.stdout)  # type: ignore[return-value]


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    # Each agent leads its own process group (start_new_session): signal the group so nothing
    # the agent started outlives it. SIGTERM first: torchrun's agent then stops its workers itself.
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def lab_torchrun(module_args: Sequence[str], nproc_per_node: int | None = None, env: Mapping[str, str] | None = None,
                 run_id: str | None = None, max_restarts: int = 0,
                 extra_torchrun_args: Sequence[str] | None = None, *, script: bool = False,
                 log_dir: str | os.PathLike | None = None, port: int | None = None, timeout: float | None = None,
                 prefix: str = PREFIX, console: IO[bytes] | None = None, stop_grace: float = 10.0) -> int:
    """Run ``torchrun ... -m module_args`` on every lab node; return the first non-zero exit code or 0.

    ``module_args`` is ``["pkg.module", "arg", ...]`` (a leading ``"-m"`` is accepted too).
    ``nproc_per_node`` defaults to the lab's ``procs_per_node``. With ``script=True`` the first
    element of ``module_args`` is a script path (torchrun's script mode) instead of a module.
    Node 0's output streams to ``console`` (default: this process's stdout); other nodes write to
    ``log_dir/node<i>.log`` if ``log_dir`` is given, else to the console prefixed ``[node i]``.
    If one node fails, the others are stopped. ``timeout`` (seconds) stops everything and raises. Stopping
    sends SIGTERM to each agent's process group (agent and workers) and waits ``stop_grace`` seconds before
    SIGKILL — also when this launcher is interrupted (an exception here, e.g. a signal turned into one): workers
    that handle SIGTERM (syncwise's trainer: finish the step, save) get that long.
    """
    with LabLock(prefix, exclusive=False):  # the job's hold: `cluster up/down` refuse to tear the lab down under it
        return _lab_torchrun(module_args, nproc_per_node, env, run_id, max_restarts, extra_torchrun_args, script,
                             log_dir, port, timeout, prefix, console, stop_grace)


def _lab_torchrun(module_args, nproc_per_node, env, run_id, max_restarts, extra_torchrun_args, script, log_dir, port,
                  timeout, prefix, console, stop_grace) -> int:
    state = require(prefix)
    nproc = state.procs_per_node if nproc_per_node is None else nproc_per_node
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError("nproc_per_node", nproc_per_node, "an integer >= 1")
    module_args = list(module_args)
    if module_args[:1] == ["-m"]:  # tolerate torchrun's own spelling: ["-m", "pkg.mod", ...]
        module_args, script = module_args[1:], False
    if not module_args:
        raise ConfigError("module_args", module_args, "a module (or script) and its arguments")
    run_id = run_id or uuid.uuid4().hex[:8]
    # Fresh namespaces have every port free; a random one avoids TIME_WAIT from the previous run.
    port = port or random.randint(29500, 39999)
    console = console if console is not None else _stdout_bytes()
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)

    threads = omp_threads(state, nproc)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    files: list[IO[bytes]] = []
    try:
        for n in state.nodes:
            node_env = {"GLOO_SOCKET_IFNAME": n.ifname, "OMP_NUM_THREADS": str(threads),
                        # Field notes: a shared rendezvous store makes gloo restarts flaky.
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
            argv = node_command(state, n.index, torchrun_argv(state, n.index, module_args, nproc, run_id, port,
                                                             max_restarts, extra_torchrun_args or (), script),
                                node_env)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            sinks: list[IO[bytes]] = []
            if logs is not None:
                files.append(open(logs / f"node{n.index}.log", "wb"))
                sinks.append(files[-1])
            if n.index == 0 or logs is None:
                sinks.append(console)
            tag = b"" if n.index == 0 else f"[node {n.index}] ".encode()
            t = threading.Thread(target=_pump, args=(proc.stdout, sinks, tag), daemon=True)
            t.start()
            pumps.append(t)

        first_failure = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # poll every agent (any() would stop at the first)
            if all(c is not None for c in codes):
                break
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                first_failure = failed[0]
                bad = next(i for i, c in enumerate(codes) if c == first_failure)
                print(f"syncwise lab: node {bad} exited with code {first_failure}; stopping the other nodes",
                      file=sys.stderr, flush=True)
                break
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
                raise SyncwiseError(f"the lab job did not finish within {timeout:g} s and was stopped "
                                    f"(logs: {logs or 'console'}).")
            time.sleep(0.1)
        _stop(procs, stop_grace)  # no-op if all exited; else stops the survivors of a failed node
        if not first_failure:
            first_failure = next((p.returncode for p in procs if p.returncode != 0), 0)
        return first_failure
    except BaseException:
        _stop(procs, stop_grace)
        raise
    finally:
        for t in pumps:
            t.join(timeout=5)
        for f in files:
            f.close()


def lab_python(node: int, argv: Sequence[str], env: Mapping[str, str] | None = None, prefix: str = PREFIX,
               **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``python argv...`` (this interpreter) in a lab node's namespace; returns the Popen."""
    state = require(prefix)
    return subprocess.Popen(node_command(state, node, [sys.executable, *argv], env), **popen_kwargs)
