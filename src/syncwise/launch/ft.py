"""Start a live-recovery job on this machine: torchft's lighthouse and N replica groups (docs/live-recovery.md).

Each replica group is its own ``torchrun`` job (``python -m torch.distributed.run``) of ``nproc`` workers with
``--max-restarts R``: when one of its workers dies, that torchrun restarts the group's workers, which rejoin the
others through the lighthouse's quorum and heal from a live peer. The other replica groups never stop. The
lighthouse (``torchft._torchft.LighthouseServer``, Rust, in the torchft wheel) runs in this process unless an
address is given (a cluster runs one lighthouse for the job: the Slurm/Kubernetes files say where).

While the replica groups train, this launcher is the one writer of the run's ``metrics.jsonl``
(:class:`LiveRows`): each step's row is appended as soon as a replica group attempt has logged it in its own
``RUN_DIR/ft/replica{R}.{attempt}/metrics.jsonl``, one line per step written and flushed at once (as a plain run's
rows are), so ``tail -f``, ``syncwise report`` and ``syncwise doctor --follow`` read a live run as they read a plain
one. After the replica groups end, :func:`merge_metrics` rewrites the run's ``metrics.jsonl`` once by its rule (one
row per step, from the latest attempt that logged it, then the lowest replica) and writes ``summary.json`` (the
summary of a replica group that finished, with every attempt's live-recovery record and the data each lost replica
skipped).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError, SyncwiseError
from ..rundir import RunDir
from .. import bind, devices, live_env
from .local import threads_per_worker
from ..secret import ENV_SECRET_FILE, create_secret

FT_DIR = "ft"  # RUN_DIR/ft/replica{R}.{attempt}: each replica group attempt's own run directory (LiveRecovery.run_dir)


class LighthouseDied(SyncwiseError):
    """The lighthouse this launcher started exited while replica groups ran: no quorum can form without it, so the
    groups are stopped at once (not left to time out one by one). ``exit_code``: the CLI's exit status."""

    exit_code = 3


#: the launchers' default for ft.heartbeat_timeout_s (config.FaultToleranceSection's default, which users set)
HEARTBEAT_TIMEOUT_S = 1.0


class Lighthouse:
    """torchft's lighthouse (``torchft_lighthouse``, the Rust server in the torchft wheel) as a child process of
    this launcher, its log in ``log_path``; ``address`` is its http://HOST:PORT."""

    def __init__(self, min_replicas: int, log_path: Path, heartbeat_timeout_ms: int = int(HEARTBEAT_TIMEOUT_S * 1000),
                 join_timeout_ms: int = 60_000, host: Optional[str] = None):
        host = host or bind.bind_host(nodes=1)  # (the replica groups of syncwise train are on this machine)
        port = bind.free_port(host)
        self.address = f"http://{bind.hostport(host, port)}"
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [_lighthouse_program(), "--bind", bind.hostport(host, port), "--min_replicas", str(min_replicas),
             "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:  # listening before any replica group asks it
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.shutdown()
                    raise SyncwiseError(f"torchft's lighthouse did not start (see {log_path})") from None
                time.sleep(0.1)

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def heartbeat_ms(heartbeat_timeout_s: float, timeout_s: float) -> int:
    """The lighthouse's ``--heartbeat_timeout_ms`` for ``ft.heartbeat_timeout_s``, at most ``ft.timeout_s``."""
    return int(min(heartbeat_timeout_s, timeout_s) * 1000)


def _lighthouse_program() -> str:
    """torchft's ``torchft_lighthouse`` console script: next to this Python, else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "torchft_lighthouse"
    found = str(here) if here.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise SyncwiseError("torchft's torchft_lighthouse program was not found (pip install torchft==0.2.0)")
    return found


def replica_command(module_args: Sequence[str], nproc: int, restarts: int, host: Optional[str] = None) -> list[str]:
    """One replica group's torchrun command line: its own rendezvous and workers' store (which the other replica
    groups reach too: torchft configures the cross-replica group through it) on ``host``, the job's address (this
    machine's: loopback), through ``syncwise.launch.agent``, which knows the ``syncwise-c10d`` rendezvous whose
    store listens there only (bind.py)."""
    host = host or bind.bind_host(nodes=1)
    port = bind.free_port(bind.LOOPBACK)  # (free here; a lab node's fresh namespace has every port free)
    return [sys.executable, "-m", "syncwise.launch.agent", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--rdzv-backend", bind.RDZV_BACKEND,
            "--rdzv-endpoint", bind.hostport(host, port), "--local-addr", host,
            "--monitor-interval", "0.5", *module_args]


def replica_env(replica: int, replicas: int, lighthouse: str, nproc: int, min_replicas: int,
                quorum_timeout_s: float, timeout_s: float, status_dir: str,
                base: Optional[dict[str, str]] = None, host: Optional[str] = None) -> dict[str, str]:
    """The environment a replica group's workers read (``syncwise.train.live_recovery.LiveRecovery.from_env``)."""
    env = dict(os.environ if base is None else base)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    # Field notes: sharing the rendezvous TCP store makes restarts flaky on gloo; a separate store is reliable.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env["OMP_NUM_THREADS"] = str(threads_per_worker(nproc * replicas))
    if base is None or host:  # this machine's launcher: loopback; the lab: the node's address (the cluster files'
        bind.job_env(host or bind.bind_host(nodes=1), env)  # agents apply the rule on each node)
    env.update(live_env.replica_vars(replica, replicas, lighthouse, min_replicas, quorum_timeout_s, timeout_s,
                                     status_dir))
    return env


def replica_gpu_env(device: str, replicas: int, nproc: int, base: Optional[dict[str, str]] = None,
                    visible_gpus: Optional[int] = None) -> list[dict[str, str]]:
    """For each replica group on this machine, the variables that give it GPUs of its own (``devices``' rule:
    group ``r`` gets the launcher's GPUs ``r*nproc .. r*nproc+nproc-1`` as its ``CUDA_VISIBLE_DEVICES``, so its
    local rank k computes on its ``cuda:k``); ``{}`` each when the job computes on the CPU. Raises the rule's
    one-line ConfigError, before any group starts, when the machine has fewer than ``replicas*nproc`` GPUs.
    ``visible_gpus``: this launcher's (None: asked of torch)."""
    env = os.environ if base is None else base
    gpus = devices.visible_gpus() if visible_gpus is None else visible_gpus
    out = []
    for r in range(replicas):
        ids = devices.replica_visible_devices(device, r, replicas, nproc, gpus, env.get("CUDA_VISIBLE_DEVICES"))
        out.append({} if ids is None else {"CUDA_VISIBLE_DEVICES": ids})
    return out


def run_replicas(module_args: Sequence[str], run_dir: str | Path, replicas: int, nproc: int, restarts: int,
                 lighthouse: str = "", min_replicas: int = 1, quorum_timeout_s: float = 60.0,
                 timeout_s: float = 30.0, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 device: str = "auto") -> list[int]:
    """Start the lighthouse (unless ``lighthouse`` names one) and ``replicas`` torchrun jobs running
    ``module_args`` (e.g. ``['-m', 'syncwise.commands.worker', '--config', FILE]``); wait for all; return their exit
    codes. Each group's output goes to ``RUN_DIR/ft/replica{R}.log``. SIGINT/SIGTERM here stop every group.
    ``device``: the job's dist.device; on CUDA each group gets GPUs of its own (:func:`replica_gpu_env`)."""
    gpu_env = replica_gpu_env(device, replicas, nproc)  # (refused here, before the lighthouse or any group starts)
    run_dir = Path(run_dir)
    (run_dir / FT_DIR).mkdir(parents=True, exist_ok=True)
    # A resumed run (--resume auto) launched again: its attempts are numbered after the earlier launches' ones, and
    # the earlier status files (the start-up wait's) are not this launch's.
    first_attempt = 1 + max((a for _, a, _ in _attempts(run_dir)), default=-1)
    shutil.rmtree(run_dir / FT_DIR / "status", ignore_errors=True)
    secret_file = str(create_secret(run_dir))  # (owner-only: the replicas sign their heal transfers with it)
    server = None
    if not lighthouse:
        # a replica dead or stopped is dropped from the next quorum once its heartbeat is this late (the survivors
        # of a kill wait this long): not later than the collective timeout
        server = Lighthouse(min_replicas, run_dir / FT_DIR / "lighthouse.log",
                            heartbeat_timeout_ms=heartbeat_ms(heartbeat_timeout_s, timeout_s))
        lighthouse = server.address
    elif "://" not in lighthouse:
        lighthouse = f"http://{lighthouse}"
    procs: list[subprocess.Popen] = []
    logs = []
    rows = LiveRows(run_dir)
    try:
        for r in range(replicas):
            env = replica_env(r, replicas, lighthouse, nproc, min_replicas, quorum_timeout_s, timeout_s,
                              str(run_dir / FT_DIR / "status"))
            env[live_env.FIRST_ATTEMPT] = str(first_attempt)
            env[ENV_SECRET_FILE] = secret_file
            env.update(gpu_env[r])
            log = open(run_dir / FT_DIR / f"replica{r}.log", "ab")
            logs.append(log)
            procs.append(subprocess.Popen(replica_command(module_args, nproc, restarts), env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
        while any(p.poll() is None for p in procs):
            if server is not None and server.proc.poll() is not None:
                raise lighthouse_died(server.proc, server.address, run_dir)
            rows.poll()
            time.sleep(0.2)
        return [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        if server is not None:
            server.shutdown()
        rows.close()  # (the groups' last rows too: a run that ends in failure keeps every row its groups logged)


def lighthouse_died(proc: subprocess.Popen, address: str, run_dir: Path) -> LighthouseDied:
    """Say at once (one line on stderr, before the groups are stopped, which takes up to their grace period) that
    the lighthouse this launcher started (``proc``, at ``address``) died, and make the error the launcher ends
    with."""
    code = proc.returncode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    line = (f"live recovery: torchft's lighthouse (pid {proc.pid}, {address}) {how}; no quorum can "
            f"form without it, so every replica group is stopped (its log: {run_dir / FT_DIR / 'lighthouse.log'}). "
            f"Each group's rows and the checkpoints are kept: relaunch with --resume auto")
    print(f"syncwise: {line}", file=sys.stderr, flush=True)
    return LighthouseDied(line)


class LiveRows:
    """The run's ``metrics.jsonl`` while its replica groups train; the launcher that waits for them is its one
    writer (the groups write only their own attempt directories). :meth:`poll` appends each step the file does not
    hold yet as soon as a replica group attempt has logged it — one line per step, written and flushed at once, in
    step order; where several attempts logged a new step by then, the row :func:`merge_metrics` would take (the
    latest attempt, then the lowest replica), with its ``attempt``. Steps already in the file (a resumed run's
    earlier launch) are not written again; :func:`merge_metrics` rewrites the file once at the end (a step redone
    after every replica was lost then shows the latest attempt's row). A write that fails (a full disk) stops
    the copying with one line; the groups' own rows are kept and merged at the end."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = RunDir(self.run_dir).metrics
        self.last = max((s for s in map(_step_of, _read_rows(self.path)) if s is not None), default=0)
        self._offsets: dict[Path, int] = {}  # each attempt's metrics.jsonl: the bytes of whole lines read so far
        self._file: Any = None
        self._stopped = False

    def poll(self) -> int:
        """Copy the steps logged since the last call; returns how many rows were appended."""
        if self._stopped:
            return 0
        new: dict[int, tuple[tuple[int, int], dict]] = {}
        for r, a, d in _attempts(self.run_dir):
            for row in self._new_rows(RunDir(d).metrics):
                step = _step_of(row)
                if step is None or step <= self.last:
                    continue
                if step not in new or (-a, r) < new[step][0]:
                    new[step] = ((-a, r), {**row, "attempt": a})
        if not new:
            return 0
        try:
            if self._file is None:
                self._file = open(self.path, "a", buffering=1)  # line-buffered: each row reaches the file at once
            for step in sorted(new):
                self._file.write(json.dumps(new[step][1]) + "\n")
                self.last = step
        except OSError as e:
            self._stopped = True
            print(f"syncwise: live recovery: writing {self.path} failed ({e.strerror or e}); the replica groups' own "
                  f"rows are kept under {self.run_dir / FT_DIR} and merged into it at the end", file=sys.stderr,
                  flush=True)
        return len(new)

    def _new_rows(self, path: Path) -> list[dict]:
        """The whole lines appended to ``path`` since the last look (a line being written waits for its end)."""
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:
                    offset = 0  # (rewritten: read it again; steps already copied are skipped by number)
                f.seek(offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[path] = offset + end
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a damaged line: skipped, never the rows after it
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def close(self) -> None:
        """A last :meth:`poll` (the rows logged since the previous one), then the file is closed."""
        try:
            self.poll()
        finally:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None
            self._stopped = True


def _step_of(row: dict) -> Optional[int]:
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _read_rows(path: Path) -> list[dict]:
    rows = []
    try:
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill
    except OSError:
        pass
    return rows


def _attempts(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(replica, attempt, directory) of every replica group attempt, ordered by replica then attempt."""
    found = []
    for d in (run_dir / FT_DIR).glob("replica*.*"):
        name = d.name[len("replica"):]
        r, _, a = name.partition(".")
        if d.is_dir() and r.isdigit() and a.isdigit():
            found.append((int(r), int(a), d))
    return sorted(found)


def merge_metrics(run_dir: str | Path, total_steps: int, replicas: Optional[int] = None) -> dict[str, Any]:
    """``RUN_DIR/metrics.jsonl`` (one row per step) and ``summary.json`` from the replica groups' own files.
    ``replicas``: the configured replica groups (a group that never logged a step, e.g. one that died on every
    start, then skipped every step's data); None: those that left an attempt directory."""
    run_dir = Path(run_dir)
    attempts = _attempts(run_dir)
    by_step: dict[int, dict] = {}
    trained: dict[int, set[int]] = {}  # replica -> steps it took part in (any attempt)
    # A step logged twice (every replica lost: the fallback from a checkpoint redid it) is the latest attempt's.
    for r, a, d in sorted(attempts, key=lambda t: (-t[1], t[0])):
        for row in _read_rows(RunDir(d).metrics):
            step = int(row.get("step", 0))
            trained.setdefault(r, set()).add(step)
            by_step.setdefault(step, {**row, "attempt": a})
    rows = [by_step[s] for s in sorted(by_step)]
    metrics = RunDir(run_dir).metrics
    tmp = metrics.with_name(metrics.name + ".merging")  # (replaced in one step: a reader never sees half a file)
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, metrics)
    summaries = [(r, a, json.loads(RunDir(d).summary.read_text())) for r, a, d in attempts
                 if RunDir(d).summary.exists()]
    # the summary of the attempt that got furthest (the latest such attempt, then the lowest replica)
    best = min(summaries, key=lambda t: (-int(t[2].get("steps") or 0), -t[1], t[0]), default=None)
    summary: dict[str, Any] = dict(best[2]) if best else {"steps": max(by_step, default=0)}
    missed = {}
    for r in sorted({r for r, _, _ in attempts} | set(range(replicas or 0))):
        steps = sorted(set(range(1, total_steps + 1)) - trained.get(r, set()))
        if steps:
            missed[f"replica{r}"] = _ranges(steps)
    summary["live_recovery"] = {
        "attempts": [{"replica": r, "attempt": a, **(s.get("live_recovery") or {})} for r, a, s in summaries],
        "steps_logged": len(rows), "steps_missing": sorted(set(range(1, total_steps + 1)) - set(by_step)),
        # a lost replica's shard: the batches of the steps it was absent for were not trained on (skipped)
        "data_skipped_by_replica": missed,
        "discarded_batches": sum(int(row.get("discarded_batches", 0)) for row in rows),
        # local SGD / DiLoCo: the inner steps of the rounds whose outer step did not commit (their rows stay)
        "discarded_inner_steps": sum(int(row.get("discarded_inner_steps", 0)) for row in rows),
    }
    RunDir(run_dir).summary.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def check_outcome(summary: dict[str, Any], codes: Sequence[int], steps: int, run_dir: str | Path) -> None:
    """After the replica groups ended: record every group that ended in failure (its restarts spent) in
    ``summary['live_recovery']['failed_replicas']`` and raise one line naming it, with its exit code — also when the
    others finished the run (they trained on without it: its shard's batches were skipped). A run that no replica
    finished names every exit code."""
    failed = {f"replica{r}": code for r, code in enumerate(codes) if code}
    summary.setdefault("live_recovery", {})["failed_replicas"] = failed
    reached = int(summary.get("steps") or 0)
    logs = Path(run_dir) / FT_DIR
    if reached < steps or (codes and all(codes)):
        raise SyncwiseError(f"live recovery: the replica groups ended with exit codes {list(codes)} and the run "
                            f"reached step {reached} of {steps}; see {logs}/replica*.log")
    if failed:
        names = ", ".join(f"{name} (exit code {code}, {logs / (name + '.log')})" for name, code in failed.items())
        raise SyncwiseError(f"live recovery: the run reached step {steps}, but {names} failed for good (its restarts "
                            "spent); the others trained on without it and its shard's batches were skipped "
                            "(summary.json: live_recovery.failed_replicas, data_skipped_by_replica)")


def _ranges(steps: list[int]) -> list[str]:
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m syncwise.launch.ft --replicas 3 [--nproc 1] [--restarts 3] --run-dir D -- script.py ARGS``: a
    user's training script (``OptimizedTrainer(..., live_recovery=LiveRecovery.from_env())``) under live recovery."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m syncwise.launch.ft", description=main.__doc__)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--quorum-timeout-s", type=float, default=60.0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=HEARTBEAT_TIMEOUT_S)
    p.add_argument("--device", choices=devices.DEVICES, default="auto",
                   help="where the workers compute: on CUDA each replica group gets GPUs of its own")
    p.add_argument("--run-dir", required=True)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if args.replicas < 2 or not 1 <= args.min_replicas <= args.replicas or args.nproc < 1 or not script:
        p.error("needs --replicas ≥ 2, 1 ≤ --min-replicas ≤ --replicas, --nproc ≥ 1 and a script")
    try:  # (too few GPUs for the replica groups: one line, before anything starts)
        replica_gpu_env(args.device, args.replicas, args.nproc)
    except ConfigError as e:
        p.error(str(e))
    codes = run_replicas(script, args.run_dir, args.replicas, args.nproc, args.restarts, lighthouse=args.lighthouse,
                         min_replicas=args.min_replicas, quorum_timeout_s=args.quorum_timeout_s,
                         timeout_s=args.timeout_s, heartbeat_timeout_s=args.heartbeat_timeout_s, device=args.device)
    print(f"replica groups ended with exit codes {codes}; logs in {Path(args.run_dir) / FT_DIR}", file=sys.stderr)
    return 0 if not all(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
