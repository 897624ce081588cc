"""Live recovery (issue 30): the same job side by side under (a) today's checkpoint restart and (b) live recovery.

Paths (each a `syncwise train` subprocess, the same model, data, steps and replicas):

- ``ddp``  — plain DDP, ``--nproc N`` (one rank per replica), no failures: the failure-free baseline;
- ``ckpt`` — (a) today: the same, saving every ``--interval`` steps and restarted by torchrun's agent
  (``--max-restarts``): every rank is killed, restarted and reloads the newest checkpoint;
- ``ft``   — (b) live recovery: ``--ft.replicas=N --nproc 1`` (N replica groups, one rank each, a lighthouse;
  issue30a's engine): a lost replica is restarted by its own agent and heals from a live peer while the others
  keep training.

Failures, injected at seeded random moments (a random step, then a random fraction of a step): ``kill`` (SIGKILL of
one worker), ``stop`` (SIGSTOP of one worker past the collective timeout ``--dist.timeout_s``; SIGCONT
``--cont-after`` s after that timeout, as a hung host that comes back), ``node`` (with ``--lab``: every process in
one lab node's network namespace is killed). The next failure waits until the previous one is recovered.

Everything is read from the run's own files — the per-step ``time`` stamp of ``metrics.jsonl`` and of every rank's
``ranks/rankR.jsonl`` (one source per rank/replica) — and from the harness's clock at the moment it injects:

- ``survivors_s``: time from the failure until the first step that *started* after it completes on any rank
  (for ``ckpt`` that is after the restart, for ``ft`` on a surviving replica);
- ``rejoined_s``: the same for the last rank to come back (the replacement);
- ``lost_s``: how much later the next step after the last one finished at the failure completes than it would
  have (``t(step s+1) - t(step s) - median step``): restart, reload and redone steps for ``ckpt``, the stall for
  ``ft``;
- ``steps_lost``: finished steps done again (``s - (first step logged after the failure - 1)``);
- per job: wall-clock against the failure-free run of the same path (paired: run right before it).

Failure-free overhead of ``ft`` against ``ddp``: ``--overhead-repeats`` pairs, order shuffled per pair, median
steady step time (from the timestamps, steps after ``WARMUP``) and wall-clock. The machine may be shared: only
ratios measured side by side are reported.

    python benchmarks/live_recovery.py --paths ckpt,ft --failures kill,stop --repeats 2
    python benchmarks/live_recovery.py --paths ckpt --failures kill,stop --repeats 1 --out benchmarks/results/live-recovery-ckpt.json
    python benchmarks/live_recovery.py --overhead-repeats 5 --repeats 0
    python benchmarks/live_recovery.py --lab 1gbit --failures kill,stop,node     # one replica per lab node
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from syncwise.live_env import REPLICA

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 3  # a process's first steps (allocator, DDP bucket rebuild) are left out of step-time medians
RESUMED_RE = re.compile(r"resumed from step (\d+)")
AGENT_MARKS = (b"torch.distributed.run", b"syncwise.launch.agent", b"torchrun", b"netns", b"torchft_lighthouse")
LAB_PREFIX = ["swfb"]  # the lab `syncwise train --lab` runs on (set from --prefix)
REPLICA_ENV = (REPLICA.encode(), b"REPLICA_GROUP_ID", b"TORCHFT_REPLICA_ID")  # ours, then torchft's own names


# ----------------------------------------------------------------------------------------------- the job
def job_cmd(args: argparse.Namespace, path: str, run_dir: Path, failures: int) -> list[str]:
    """`syncwise train` for one path; ``failures`` sizes the restart allowances."""
    cmd = [sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), "--preset", args.preset,
           "--steps", str(args.steps), f"--data.seq_len={args.seq_len}", f"--data.batch_size={args.batch_size}",
           "--train.val_interval=0", "--train.val_batches=1", f"--dist.timeout_s={args.timeout_s}"]
    if args.pace_ms:
        # a paced loader (every step waits this long for data; losses unchanged): steps long enough that a failure
        # lands mid-run and a stall is measured in steps, as on a real model
        cmd += ["--inject-fault", f"slowdata:ms={args.pace_ms}"]
    restarts = failures + args.spare_restarts
    if path == "ddp":
        cmd += ["--nproc", str(args.replicas), "--ckpt.interval=0"]
    elif path == "ckpt":
        cmd += ["--nproc", str(args.replicas), f"--ckpt.interval={args.interval}", "--max-restarts", str(restarts)]
    elif path == "ft":
        cmd += ["--nproc", "1", f"--ft.replicas={args.replicas}", f"--ft.replica_restarts={restarts}",
                f"--ft.timeout_s={args.timeout_s}",
                f"--ckpt.interval={args.ft_interval}", *args.ft_arg]
    else:
        raise ValueError(path)
    if args.lab and path == "ft":
        # one replica group per lab node (syncwise.launch.ft_lab), started by this script's child (below): the [ft]
        # validation does not take --lab yet
        return [sys.executable, str(Path(__file__).resolve()), "--ft-lab-child", "--prefix", args.prefix,
                "--run-dir", str(run_dir), "--", *cmd[cmd.index("--run-dir") + 2:]]
    if args.lab:
        cmd += ["--lab"]  # on this benchmark's own lab: SYNCWISE_LAB_PREFIX (Job's environment)
        cmd[cmd.index("--nproc") + 1] = str(max(1, args.replicas // args.nodes))
    return cmd


def ft_lab_child(prefix: str, run_dir: str, flags: list[str]) -> int:
    """The ft path on the lab: `syncwise train`'s run-directory handling, then run_replicas_lab and the merge."""
    from syncwise.commands.train import prepare_run_dir
    from syncwise.config import config_from_argv
    from syncwise.launch.ft import merge_metrics
    from syncwise.launch.ft_lab import run_replicas_lab

    cfg = config_from_argv([*flags, "--run-dir", run_dir])
    lock = prepare_run_dir(cfg)
    try:
        ft = cfg.ft
        codes = run_replicas_lab(["-m", "syncwise.commands.worker", "--config", str(Path(run_dir) / "config.json")],
                                 run_dir, ft.replicas, cfg.dist.nproc, ft.replica_restarts,
                                 min_replicas=ft.min_replicas, quorum_timeout_s=ft.quorum_timeout_s,
                                 timeout_s=ft.timeout_s, prefix=prefix)
        summary = merge_metrics(run_dir, cfg.train.steps)
    finally:
        lock.release()
    print(f"replica groups' exit codes {codes}; steps {summary.get('steps')}", flush=True)
    return 0 if summary["live_recovery"]["steps_logged"] == cfg.train.steps and not all(codes) else 1


class Job:
    """A `syncwise train` subprocess in its own session; output kept with arrival times."""

    def __init__(self, cmd: list[str], log: Path):
        self.cmd = cmd
        self.run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "SYNCWISE_LAB_PREFIX": LAB_PREFIX[0]})
        self.lines: list[str] = []
        self._log = log
        self._pump = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._pump.start()

    def wait(self, timeout: float) -> Any:
        try:
            code: Any = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            code = "timeout"
        self.wall_s = time.time() - self.t0
        self._pump.join(timeout=5)
        self._log.write_text("".join(self.lines))
        return code

    def kill(self) -> None:
        for pid in self.pids():
            _signal(pid, signal.SIGCONT)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for pid in self.pids():  # lab nodes' processes live in other sessions
            _signal(pid, signal.SIGKILL)
        self.proc.wait()

    def pids(self) -> list[int]:
        """Every process of this job: its session, and (lab) those started with its run directory."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        out += subprocess.run(["pgrep", "-f", str(self.run_dir) + "/"], capture_output=True, text=True).stdout.split()
        return sorted({int(p) for p in out} - {os.getpid()})

    def workers(self) -> list[dict]:
        """The job's training processes (not agents, launchers or the lighthouse): pid, rank, replica. torchrun's
        CLI gives its workers RANK in their environment; the elastic API's spawned workers (`syncwise train`'s
        local launcher) get it only in-process, so those are ranked by start order under their agent."""
        found, spawned = [], {}
        for pid in self.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in x)
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"spawn_main" in cmd and b"TORCHELASTIC_SIGNALS_TO_HANDLE" in env:
                spawned.setdefault(ppid, []).append(pid)
                continue
            if b"RANK" not in env or b"TORCHELASTIC_RUN_ID" not in env or any(m in cmd for m in AGENT_MARKS):
                continue
            replica = next((env[k].decode() for k in REPLICA_ENV if k in env), "0")
            found.append({"pid": pid, "rank": int(env[b"RANK"]), "replica": replica})
        for agent, pids in spawned.items():
            found += [{"pid": pid, "rank": r, "replica": str(agent)} for r, pid in enumerate(sorted(pids))]
        return sorted(found, key=lambda w: (w["replica"], w["rank"]))


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------ the timeline
_ATTEMPT = re.compile(r"^ft/replica(\d+)\.\d+/")


def sources(run_dir: Path) -> dict[str, list[dict]]:
    """Every rank's own per-step log (``ranks/rankR.jsonl``), rows in time order. Live recovery writes each replica
    group attempt to ``ft/replica{R}.{attempt}/``: a replica's attempts are one source (``replicaR/rankK``), so a
    replacement continues its replica's timeline."""
    from syncwise.metrics.logger import read_jsonl

    out: dict[str, list[dict]] = {}
    for p in sorted(run_dir.rglob("rank*.jsonl")):
        if p.parent.name != "ranks":
            continue
        rel = str(p.relative_to(run_dir))
        m = _ATTEMPT.match(rel)
        name = f"replica{m.group(1)}/{p.stem}" if m else p.stem
        rows = [r for r in read_jsonl(p) if "time" in r and "step" in r]
        out.setdefault(name, []).extend(rows)
    return {k: sorted(v, key=lambda r: r["time"]) for k, v in out.items() if v}


def main_rows(run_dir: Path) -> list[dict]:
    """The run's one row per step: metrics.jsonl (live recovery merges its replica groups' into it at the end)."""
    from syncwise.metrics.logger import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time" in r]


def newest_row(run_dir: Path) -> Optional[dict]:
    rows = [r for rs in sources(run_dir).values() for r in rs]
    return max(rows, key=lambda r: (r["step"], r["time"])) if rows else None


def wait_for(job: Job, pred, limit: float) -> bool:
    deadline = time.time() + limit
    while time.time() < deadline and job.proc.poll() is None:
        if pred():
            return True
        time.sleep(0.05)
    return False


def inject(job: Job, kind: str, rng: random.Random, args: argparse.Namespace) -> Optional[dict]:
    """One failure of ``kind`` now; what was hit and when (the harness's clock)."""
    workers = job.workers()
    if not workers:
        return None
    before = newest_row(job.run_dir)
    if kind == "node":
        node = rng.randrange(1, args.nodes) if args.nodes > 1 else 0  # node 0 hosts the rendezvous/lighthouse
        from syncwise.lab.cluster import require

        ns = require(args.prefix).node(node).namespace
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                               text=True).stdout.split()]
        t = time.time()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        return {"kind": kind, "node": node, "pids": len(pids), "t": t, "step_done": before["step"] if before else 0,
                "step_done_t": before["time"] if before else None}
    victim = rng.choice(workers)
    t = time.time()
    _signal(victim["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    event = {"kind": kind, "rank": victim["rank"], "replica": victim["replica"], "t": t,
             "step_done": before["step"] if before else 0, "step_done_t": before["time"] if before else None}
    if kind == "stop":  # a hung host that comes back after the timeout has passed (or is killed by its agent)
        threading.Timer(args.timeout_s + args.cont_after, _signal, (victim["pid"], signal.SIGCONT)).start()
    return event


def analyse_failure(ev: dict, srcs: dict[str, list[dict]], rows: list[dict], step_s: float) -> dict:
    t = ev["t"]
    after = {name: [r for r in rows if r["time"] > t] for name, rows in srcs.items()}
    started_after = {name: next((r for r in rows if r["time"] - r.get("step_time_s", 0.0) >= t), None)
                     for name, rows in after.items()}
    firsts = [r["time"] for r in started_after.values() if r is not None]
    out = dict(ev)
    out["survivors_s"] = min(firsts) - t if firsts else None
    out["rejoined_s"] = max(firsts) - t if firsts and all(started_after.values()) else None
    s = ev["step_done"]
    main = sorted(rows, key=lambda r: r["time"])
    first_after = next((r for r in main if r["time"] > t), None)
    out["first_step_after"] = first_after["step"] if first_after else None
    out["steps_lost"] = max(0, s - (first_after["step"] - 1)) if first_after else None
    nxt = next((r for r in main if r["time"] > t and r["step"] == s + 1), None)
    if nxt is not None and ev.get("step_done_t") is not None:
        out["lost_s"] = nxt["time"] - ev["step_done_t"] - step_s
    else:
        out["lost_s"] = None
    return out


def steady_step_s(rows: list[dict]) -> Optional[float]:
    """Median time between consecutive rows (data wait, sync and logging included) after the warm-up."""
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if a["step"] >= WARMUP and b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def run_job(args: argparse.Namespace, path: str, name: str, plan: list[tuple[str, int]], rng: random.Random) -> dict:
    run_dir = Path(args.work_dir) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    job = Job(job_cmd(args, path, run_dir, len(plan)), Path(args.work_dir) / f"{name}.log")
    events = []
    for kind, step in plan:
        row = lambda: newest_row(run_dir)  # noqa: E731
        if not wait_for(job, lambda: (row() or {}).get("step", 0) >= step, args.job_timeout):
            break
        time.sleep(rng.random() * max(args.pace_ms, 20) / 1000)  # a random moment inside the step
        # the previous failure must be over: every source has a row after it (the replacement rejoined)
        if events:
            prev = events[-1]["t"]
            wait_for(job, lambda: all(rs[-1]["time"] > prev for rs in sources(run_dir).values()), args.job_timeout)
        if (newest_row(run_dir) or {}).get("step", 0) > args.steps - 6:
            print(f"  {name}: {kind} planned at step {step} not injected: the run is nearly over", flush=True)
            break
        ev = inject(job, kind, rng, args)
        if ev is not None:
            events.append(ev)
            print(f"  {name}: {kind} at step {ev['step_done']} ({ev.get('rank', ev.get('node'))})", flush=True)
    code = job.wait(args.job_timeout - (time.time() - job.t0))
    requeues = 0
    while code != 0 and path == "ckpt" and any(e["kind"] == "node" for e in events) and requeues < len(events):
        # today's path cannot lose a node inside one job (the other agents wait for it, then fail): the scheduler
        # requeues the job and it resumes from the newest checkpoint (its wall-clock counts from the first start)
        requeues += 1
        print(f"  {name}: exit {code} after a node loss; requeued with --resume auto", flush=True)
        t0 = job.t0
        job = Job([*job.cmd, "--resume", "auto"], Path(args.work_dir) / f"{name}.requeue{requeues}.log")
        job.t0 = t0
        code = job.wait(args.job_timeout - (time.time() - t0))
    srcs = sources(run_dir)
    rows = main_rows(run_dir)
    step_s = steady_step_s(rows) or 0.0
    log = "".join(job.lines)
    done = sorted({r["step"] for r in rows})
    final = rows[-1].get("loss") if rows else None
    return {"path": path, "name": name, "command": " ".join(job.cmd[2:]), "exit_code": code, "wall_s": job.wall_s,
            "steps_logged": len(rows), "every_step": done == list(range(1, args.steps + 1)),
            "one_row_per_step": [r["step"] for r in rows] == list(range(1, args.steps + 1)),
            "final_loss": final, "step_s_median": step_s or None, "resumes": RESUMED_RE.findall(log),
            "failures": [analyse_failure(ev, srcs, rows, step_s) for ev in events], "requeues": requeues,
            "tail": log.strip().splitlines()[-4:] if code != 0 else []}


def plan_failures(rng: random.Random, kinds: list[str], steps: int, per_job: int) -> list[tuple[str, int]]:
    """``per_job`` failures at distinct steps in the middle of the run, spaced so each can recover."""
    lo, hi = max(WARMUP + 2, steps // 6), steps - steps // 4
    gap = max(1, (hi - lo) // max(1, per_job))
    at = sorted(rng.randrange(lo + i * gap, lo + (i + 1) * gap) for i in range(per_job))
    return [(rng.choice(kinds), s) for s in at]


# ----------------------------------------------------------------------------------------------- main
def summarise(jobs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for path in sorted({j["path"] for j in jobs}):
        free = [j for j in jobs if j["path"] == path and j["name"].endswith("-free")]
        hit = [j for j in jobs if j["path"] == path and not j["name"].endswith("-free")]
        fails = [f for j in hit for f in j["failures"]]

        def med(key: str, kind: Optional[str] = None) -> Optional[float]:
            xs = [f[key] for f in fails if f.get(key) is not None and (kind is None or f["kind"] == kind)]
            return statistics.median(xs) if xs else None

        pairs = []  # wall-clock lost per failure: each failing job against the failure-free run just before it
        for j in hit:
            ref = next((f for f in free if f["name"] == j["name"].rsplit("-", 1)[0] + "-free"), None)
            if ref and j["failures"] and j["exit_code"] == 0:
                pairs.append((j["wall_s"] - ref["wall_s"]) / len(j["failures"]))
        out[path] = {
            "jobs": len(hit), "jobs_finished": sum(j["exit_code"] == 0 and j["every_step"] for j in hit),
            "failures": len(fails), "steps_lost_total": sum(f["steps_lost"] or 0 for f in fails),
            "survivors_s_median": med("survivors_s"), "rejoined_s_median": med("rejoined_s"),
            "lost_s_median": med("lost_s"), "wall_lost_s_per_failure_median": statistics.median(pairs) if pairs else None,
            "by_kind": {k: {"n": sum(f["kind"] == k for f in fails), "survivors_s": med("survivors_s", k),
                            "rejoined_s": med("rejoined_s", k), "lost_s": med("lost_s", k)}
                        for k in sorted({f["kind"] for f in fails})},
            "free_wall_s_median": statistics.median([j["wall_s"] for j in free]) if free else None,
            "free_step_s_median": statistics.median([j["step_s_median"] for j in free if j["step_s_median"]])
            if any(j["step_s_median"] for j in free) else None,
        }
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ft-lab-child"]:  # --ft-lab-child --prefix P --run-dir D -- FLAGS...
        return ft_lab_child(argv[2], argv[4], argv[6:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="ckpt,ft", help="comma list of ckpt (checkpoint restart), ft (live recovery)")
    ap.add_argument("--failures", default="kill,stop", help="comma list of kill, stop, node (node: --lab only)")
    ap.add_argument("--repeats", type=int, default=2, help="failing jobs per path (each paired with a failure-free one)")
    ap.add_argument("--per-job", type=int, default=2, help="failures injected per failing job")
    ap.add_argument("--overhead-repeats", type=int, default=3, help="failure-free ddp/ft pairs (0: none)")
    ap.add_argument("--replicas", type=int, default=2, help="data-parallel replicas (ft: replica groups of 1 rank)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=10, help="ckpt: checkpoint every N steps")
    ap.add_argument("--ft-interval", type=int, default=0, help="ft: fallback checkpoint interval (0: none)")
    ap.add_argument("--ft-arg", action="append", default=[], help="more flags for the ft path (repeatable)")
    ap.add_argument("--spare-restarts", type=int, default=1)
    ap.add_argument("--timeout-s", type=int, default=10, help="--dist.timeout_s: the collective timeout")
    ap.add_argument("--cont-after", type=float, default=5.0, help="stop: SIGCONT this long after the timeout")
    ap.add_argument("--pace-ms", type=int, default=100, help="slowdata pace per step (0: unpaced)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job-timeout", type=float, default=600.0)
    ap.add_argument("--lab", default=None, metavar="RATE", help="build a lab of --nodes nodes at RATE, one replica "
                    "per node, and take it down afterwards")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--prefix", default="swfb", help="lab prefix (never the default swlab)")
    ap.add_argument("--subnet", default="10.77.32.0/24")
    ap.add_argument("--work-dir", default="/tmp/syncwise-live-recovery")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    kinds = [k for k in args.failures.split(",") if k]
    bad = [p for p in paths if p not in ("ckpt", "ft")] + [k for k in kinds if k not in ("kill", "stop", "node")]
    if bad or ("node" in kinds and not args.lab):
        raise SystemExit(f"--paths ckpt,ft / --failures kill,stop,node (node needs --lab): got {bad or 'node'}")
    LAB_PREFIX[0] = args.prefix
    if args.lab:
        args.nodes = max(args.nodes, args.replicas)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(args.seed)
    jobs: list[dict] = []
    overhead: list[dict] = []

    def record(j: dict) -> dict:
        print(f"  {j['name']}: exit {j['exit_code']}, wall {j['wall_s']:.1f} s, step {j['step_s_median'] or 0:.3f} s, "
              f"{j['steps_logged']} rows, failures "
              + json.dumps([{k: (round(v, 2) if isinstance(v, float) else v) for k, v in f.items()
                             if k in ("kind", "survivors_s", "rejoined_s", "lost_s", "steps_lost")}
                            for f in j["failures"]]), flush=True)
        return j

    if args.lab:
        from syncwise import lab

        lab.up(args.nodes, args.lab, procs_per_node=1, subnet=args.subnet, prefix=args.prefix)
    try:
        for i in range(args.overhead_repeats):
            order = ["ddp", "ft"] if "ft" in paths else ["ddp", "ckpt"]
            rng.shuffle(order)
            pair = {p: record(run_job(args, p, f"overhead{i}-{p}", [], rng)) for p in order}
            overhead.append({p: {"wall_s": j["wall_s"], "step_s": j["step_s_median"], "exit_code": j["exit_code"]}
                             for p, j in pair.items()} | {"order": order})
        for i in range(args.repeats):
            plan = plan_failures(random.Random(args.seed * 1000 + i), kinds, args.steps, args.per_job)
            print(f"[repeat {i}] plan {plan}", flush=True)
            for path in paths:
                jobs.append(record(run_job(args, path, f"{path}{i}-free", [], rng)))
                jobs.append(record(run_job(args, path, f"{path}{i}-hit", plan, rng)))
    finally:
        if args.lab:
            from syncwise import lab

            lab.down(prefix=args.prefix)
    summary = summarise(jobs)
    if "ckpt" in summary and "ft" in summary:
        a, b = summary["ckpt"], summary["ft"]
        for key in ("lost_s_median", "wall_lost_s_per_failure_median"):
            if a.get(key) and b.get(key):
                summary[f"ckpt_over_ft_{key}"] = a[key] / b[key] if b[key] > 0 else None
    ok = [o for o in overhead if all(o[p]["exit_code"] == 0 for p in o if p != "order")]
    if ok:
        other = "ft" if "ft" in ok[0] else "ckpt"
        summary["overhead"] = {
            "pairs": len(ok), "vs": other,
            "step_ratio_median": statistics.median([o[other]["step_s"] / o["ddp"]["step_s"] for o in ok
                                                    if o[other]["step_s"] and o["ddp"]["step_s"]] or [float("nan")]),
            "wall_ratio_median": statistics.median([o[other]["wall_s"] / o["ddp"]["wall_s"] for o in ok])}
    out = Path(args.out) if args.out else RESULTS / f"live-recovery{'-lab' if args.lab else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "live_recovery", "command": "python benchmarks/live_recovery.py " + " ".join(argv), "machine": "shared: 2 CPU cores, other sessions' jobs running; only "
              "ratios measured side by side mean anything", "setup": {k: v for k, v in vars(args).items()
                                                                     if k not in ("work_dir", "out")},
              "summary": summary, "overhead_pairs": overhead, "jobs": jobs}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"results: {out}")
    return 0 if all(j["exit_code"] == 0 for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
