"""Reliability benchmark: many random worker kills in a 2-worker run, recovered by torchrun's agent.

One uninterrupted reference run, then ``--runs`` runs in which ``--kills`` kills (random rank, random
step, seeded) are injected with ``--inject-fault kill:rank=R,step=S``. Every run is deterministic, saves an
async checkpoint every ``--interval`` steps and may restart ``kills + --spare-restarts`` times. Reported:

- recoveries / injections (kills fired, group restarts seen in the log, run finished with every step);
- redone steps (from the "resumed from step X; N step(s) after it are redone" lines, and checked against
  kill step − resume step);
- whether each final loss curve is bit-identical to the reference (every step's loss, as logged);
- wall-time overhead per kill, split into recomputed steps and restart cost (spawn, rendezvous, load);
- save cost from the reference run: blocking vs total seconds per save, and the step time of steps that
  ran while an async save was in flight (``ckpt_in_flight`` in metrics.jsonl) vs the other steps.

Local (2 workers on this host, `syncwise train` in a subprocess):
    python benchmarks/reliability.py --runs 2 --kills 5 --steps 60
Two lab nodes, one worker each (builds its own lab, prefix ``rlab``, and takes it down afterwards):
    python benchmarks/reliability.py --lab --runs 2 --kills 5 --steps 60

Hostile mode (``--hostile``): faults a user meets, across compressors and sync strategies, each counted as
tried / recovered / bit-exact / reported within the timeout — external SIGKILL of a random worker at a random
moment (torchrun restarts the group, which resumes), SIGSTOP of a random worker (the other rank must report
the hang within --dist.timeout_s + 5 s, naming the stopped rank), NaN on one rank (the step is listed as skipped
in every rank's summary and the run finishes with a finite loss; under local SGD the replica that saw it drops its
update and the others learn the step at the next average), a disk that fills during a save (a syncwise message, earlier checkpoints
intact), and two runs started 0.3 s apart in one run directory (exactly one refused, the other whole):
    python benchmarks/reliability.py --hostile --trials 2

Hostile across layouts (``--hostile --layouts all`` or a comma list of ``LAYOUTS`` names; issue 23): the same
faults under DDP, FSDP2, HSDP (4 ranks), tp 2, pp 2 with one schedule per family (1f1b, interleaved-1f1b, zbv,
dualpipev), ep 2, pp 2 × ep 2 (4 ranks) and local SGD, plus SIGTERM / SIGUSR1 preemption of the launcher (exit
83, then ``--resume auto``: bit-exact) and a corrupted newest checkpoint (truncated or one flipped byte: the
resume falls back to the previous checkpoint, bit-exact). ``--smoke`` shortens every run to prove the harness:
    python benchmarks/reliability.py --hostile --layouts all --trials 1
    python benchmarks/reliability.py --hostile --layouts pp2-1f1b --trials 1 --smoke
    python benchmarks/reliability.py --hostile --lab --layouts ddp,hsdp --trials 1   # each layout over 2 lab nodes

Security (``--hostile --security``; issue 42): the attacks of its rows 1-3, 5 and 11, each a count whose goal is 0 —
endpoints of a live-recovery run (`syncwise train --ft.replicas=2`: lighthouse, managers, stores, heal servers,
Prometheus) that listen on a non-loopback address or accept a connection from this host's external address;
planted pickle payloads executed (a heal transfer unsigned and signed, the transformers integration's
``syncwise_compress.pt``, a nanoGPT ``meta.pkl``); rows lost when a damaged ``metrics.jsonl`` is repaired on
resume; tracebacks, nonsense accepted and silent acceptances on bad input (the config values of row 11 through
``syncwise train --check``, wrong-typed ``OptimizedTrainer`` keywords, ``report``/``doctor`` on damaged run
directories). ``--smoke`` replaces the live-recovery run by the lighthouse alone (seconds):
    python benchmarks/reliability.py --hostile --security
    python benchmarks/reliability.py --hostile --security --smoke --out /tmp/security.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RESUMED_RE = re.compile(r"resumed from step (\d+); (\d+) step\(s\) after it are redone")
KILLED_RE = re.compile(r"injected fault: killing rank (\d+) at step (\d+)")
RESTARTED_RE = re.compile(r"worker group restarted \(restart (\d+)\)")
WARMUP_STEPS = 3  # first steps of a process: allocator warm-up and DDP bucket rebuild, not save effects


def plan_kills(rng: random.Random, kills: int, steps: int, world: int = 2) -> list[tuple[int, int]]:
    """``kills`` (rank, step) pairs at distinct steps in [2, steps], sorted by step."""
    if kills > steps - 1:
        raise SystemExit(f"--kills {kills}: at most steps-1 = {steps - 1} kills fit in {steps} steps")
    return [(rng.randrange(world), s) for s in sorted(rng.sample(range(2, steps + 1), kills))]


def train_args(args: argparse.Namespace) -> list[str]:
    """The `syncwise train` options every run shares (the reference and the killed runs)."""
    return ["--preset", args.preset, "--steps", str(args.steps), f"--data.seq_len={args.seq_len}",
            f"--data.batch_size={args.batch_size}", "--deterministic", f"--ckpt.interval={args.interval}",
            f"--ckpt.keep={args.keep}", "--train.val_interval=0", "--train.val_batches=1", "--nproc", "2"]


def run_local(run_dir: Path, args: argparse.Namespace, kills: list[tuple[int, int]], restarts: int) -> dict:
    """`syncwise train` in a subprocess (2 local workers under torchrun's agent); returns exit code, wall, log."""
    cmd = [sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), *train_args(args),
           "--max-restarts", str(restarts)]
    for rank, step in kills:
        cmd += ["--inject-fault", f"kill:rank={rank},step={step}"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=args.timeout)
        code, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
    wall = time.perf_counter() - t0
    (run_dir.parent / f"{run_dir.name}.log").write_text(out)
    return {"command": " ".join(cmd[2:]), "exit_code": code, "wall_s": wall, "log": out}


def run_lab(run_dir: Path, args: argparse.Namespace, kills: list[tuple[int, int]], restarts: int) -> dict:
    """The same run across 2 lab nodes (one worker each): one torchrun agent per network namespace."""
    from syncwise.commands.train import prepare_run_dir
    from syncwise.config import build_config
    from syncwise.errors import SyncwiseError
    from syncwise.lab.launch import lab_torchrun

    flags = train_args(args)
    overrides = {"model.preset": args.preset, "train.steps": str(args.steps), "data.seq_len": str(args.seq_len),
                 "data.batch_size": str(args.batch_size), "train.deterministic": "true",
                 "ckpt.interval": str(args.interval), "ckpt.keep": str(args.keep), "train.val_interval": "0",
                 "train.val_batches": "1", "dist.nproc": "1", "dist.lab": "true",
                 "dist.max_restarts": str(restarts), "run_dir": str(run_dir),
                 "inject_fault": ";".join(f"kill:rank={r},step={s}" for r, s in kills)}
    cfg = build_config(None, overrides)
    prepare_run_dir(cfg)
    logs = run_dir / "lab-logs"
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.console.log", "wb") as console:
        try:
            code: Any = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")],
                                     nproc_per_node=1, max_restarts=restarts, log_dir=logs, timeout=args.timeout,
                                     prefix=args.prefix, console=console)
        except SyncwiseError as e:  # the job hung past --timeout: record it, do not hide it
            code = f"timeout: {e}"
    wall = time.perf_counter() - t0
    # Rank 0 may land on either node: read every node's log.
    out = "".join(f.read_text(errors="replace") for f in sorted(logs.glob("node*.log")))
    (run_dir.parent / f"{run_dir.name}.log").write_text(out)
    return {"command": "lab_torchrun(-m syncwise.commands.worker --config config.json) with " + " ".join(flags)
            .replace("--nproc 2", "--nproc 1 (per node)") + f" --max-restarts {restarts} "
            + " ".join(f"--inject-fault kill:rank={r},step={s}" for r, s in kills),
            "exit_code": code, "wall_s": wall, "log": out}


def read_rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def save_costs(run_dir: Path, rows: list[dict]) -> dict:
    """Blocking vs total save time, and step time with an async save in flight vs without."""
    summary_path = run_dir / "summary.json"
    saves = json.loads(summary_path.read_text()).get("checkpoint_saves", []) if summary_path.exists() else []
    steady = [r for r in rows if r["step"] > WARMUP_STEPS and r.get("loss") is not None]
    busy = [r["step_time_s"] for r in steady if r.get("ckpt_in_flight")]
    idle = [r["step_time_s"] for r in steady if r.get("ckpt_in_flight") is False]
    wall = sum(r["step_time_s"] for r in rows) + sum(s["blocking_s"] for s in saves)

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    out = {
        "saves": len(saves),
        "checkpoint_mb": round(statistics.median([s["bytes"] for s in saves]) / 2**20, 2) if saves else None,
        "blocking_s_median": med([s["blocking_s"] for s in saves]),
        "total_s_median": med([s["total_s"] for s in saves]),
        "blocking_share_of_train_time": sum(s["blocking_s"] for s in saves) / wall if wall else None,
        "steps_in_flight": len(busy), "steps_idle": len(idle),
        "step_s_in_flight_median": med(busy), "step_s_idle_median": med(idle),
        "step_s_in_flight_mean": statistics.fmean(busy) if busy else None,
        "step_s_idle_mean": statistics.fmean(idle) if idle else None,
        "per_save": saves,
    }
    if busy and idle:
        out["slowdown_in_flight_median"] = med(busy) / med(idle)
    return out


def analyse(run: dict, run_dir: Path, ref_losses: list[float] | None, kills: list[tuple[int, int]],
            steps: int, ref_wall: float | None, ref_step_s: float | None) -> dict:
    """Turn one run's log, metrics and fault markers into the reported numbers."""
    log = run.pop("log")
    rows = read_rows(run_dir)
    losses = [r["loss"] for r in rows]
    fired = sorted(p.name for p in (run_dir / "faults").glob("*.fired")) if (run_dir / "faults").is_dir() else []
    resumes = [(int(a), int(b)) for a, b in RESUMED_RE.findall(log)]
    killed = [(int(a), int(b)) for a, b in KILLED_RE.findall(log)]
    restarts = [int(n) for n in RESTARTED_RE.findall(log)]
    # Each kill at step S is followed by one resume from checkpoint X: steps X+1 .. S-1 were done twice.
    expected_redone = [s - 1 - x for (_, s), (x, _) in zip(killed, resumes)]
    complete = [r["step"] for r in rows] == list(range(1, steps + 1))
    out = dict(run, kills=[{"rank": r, "step": s} for r, s in kills], injected=len(kills), fired=len(fired),
               kills_in_log=len(killed), restarts=len(restarts), max_restart_index=max(restarts, default=0),
               resumes=[{"from_step": x, "redone": n} for x, n in resumes],
               redone_steps=sum(n for _, n in resumes), redone_steps_check=sum(expected_redone),
               finished=run["exit_code"] == 0 and (run_dir / "summary.json").exists() and complete,
               one_row_per_step=complete, final_loss=losses[-1] if losses else None)
    # A recovery: a kill that fired and was followed by a resume, in a run that then finished every step.
    out["recoveries"] = min(len(killed), len(resumes)) if out["finished"] else 0
    out["unplanned_restarts"] = max(0, len(restarts) - len(killed))
    if ref_losses is not None:
        out["curve_bit_exact"] = complete and losses == ref_losses
        out["final_loss_equal"] = bool(losses) and losses[-1] == ref_losses[-1]
        out["first_differing_step"] = next((i + 1 for i, (a, b) in enumerate(zip(losses, ref_losses)) if a != b),
                                           None)
    if ref_wall is not None and kills:
        over = run["wall_s"] - ref_wall
        out["wall_overhead_s"] = over
        out["wall_overhead_s_per_kill"] = over / len(kills)
        if ref_step_s:
            out["recompute_s_est"] = out["redone_steps"] * ref_step_s
            out["restart_s_per_kill_est"] = (over - out["recompute_s_est"]) / len(kills)
    out["tail_of_log"] = log.strip().splitlines()[-6:]
    return out


def lab_up(args: argparse.Namespace) -> None:
    from syncwise import lab

    lab.up(2, args.bandwidth, procs_per_node=1, subnet=args.subnet, prefix=args.prefix)


def lab_down(args: argparse.Namespace) -> None:
    from syncwise import lab

    lab.down(prefix=args.prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="runs with injected kills (each with its own kill plan)")
    ap.add_argument("--kills", type=int, default=5, help="kills injected per run")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    ap.add_argument("--interval", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    ap.add_argument("--spare-restarts", type=int, default=1,
                    help="restarts allowed beyond one per kill (a flaky restart shows up as 'unplanned')")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill plans")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before one run is declared hung")
    ap.add_argument("--lab", action="store_true", help="2 lab nodes with one worker each instead of 2 local workers "
                    "(--hostile --layouts: the layout's ranks split over 2 lab nodes, on the lab's default prefix)")
    ap.add_argument("--bandwidth", default="1gbit", help="lab link rate (with --lab)")
    ap.add_argument("--prefix", default="rlab", help="lab prefix (never the default 'swlab' others use)")
    ap.add_argument("--subnet", default="10.79.0.0/24", help="lab subnet (with --lab)")
    ap.add_argument("--work-dir", default="/tmp/syncwise-reliability", help="run directories (wiped first)")
    ap.add_argument("--hostile", action="store_true", help="the hostile suite (see above) instead of kill recovery")
    ap.add_argument("--trials", type=int, default=2, help="--hostile: trials of each fault per configuration")
    ap.add_argument("--layouts", default=None, help="--hostile: 'all' or a comma list of layouts (" +
                    ", ".join(LAYOUTS) + ") instead of the compressor configurations; adds preemption and a "
                    "corrupted newest checkpoint")
    ap.add_argument("--smoke", action="store_true", help="--hostile --layouts: short runs, to prove the harness; "
                    "--hostile --security: the lighthouse alone instead of a live-recovery run")
    ap.add_argument("--security", action="store_true", help="--hostile: the security and bad-input counts of issue 42 "
                    "(network, pickle, lost rows, tracebacks; goal 0 each) instead of the fault suite")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/reliability-<mode>.json)")
    args = ap.parse_args(argv)
    if args.hostile:
        return hostile_main(args)
    mode = "lab" if args.lab else "local"
    out_path = Path(args.out) if args.out else RESULTS / f"reliability-{mode}.json"
    work = Path(args.work_dir) / mode
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    runner = run_lab if args.lab else run_local
    if args.lab:
        lab_up(args)
    try:
        print(f"[{mode}] reference run ({args.steps} steps, no kills)", flush=True)
        ref_dir = work / "reference"
        ref = runner(ref_dir, args, [], 0)
        ref_rows = read_rows(ref_dir)
        ref_losses = [r["loss"] for r in ref_rows]
        reference = analyse(ref, ref_dir, None, [], args.steps, None, None)
        costs = save_costs(ref_dir, ref_rows)
        steady = [r["step_time_s"] for r in ref_rows if r["step"] > WARMUP_STEPS]
        ref_step_s = statistics.median(steady) if steady else None
        print(f"  exit {ref['exit_code']}, wall {ref['wall_s']:.1f} s, final loss {reference['final_loss']}",
              flush=True)
        runs = []
        for i in range(args.runs):
            kills = plan_kills(random.Random(args.seed * 1000 + i), args.kills, args.steps)
            print(f"[{mode}] run {i + 1}/{args.runs}: kills {kills}", flush=True)
            d = work / f"killed-{i}"
            r = analyse(runner(d, args, kills, args.kills + args.spare_restarts), d, ref_losses, kills, args.steps,
                        ref["wall_s"], ref_step_s)
            runs.append(r)
            print(f"  exit {r['exit_code']}, recoveries {r['recoveries']}/{r['injected']}, redone {r['redone_steps']}"
                  f", bit-exact {r.get('curve_bit_exact')}, wall {r['wall_s']:.1f} s", flush=True)
    finally:
        if args.lab:
            lab_down(args)
    injected = sum(r["injected"] for r in runs)
    result = {
        "benchmark": "reliability", "mode": mode,
        "setup": {k: getattr(args, k) for k in ("runs", "kills", "steps", "interval", "keep", "spare_restarts",
                                                 "preset", "seq_len", "batch_size", "seed")}
        | ({"bandwidth": args.bandwidth, "nodes": 2, "procs_per_node": 1} if args.lab else {"nproc": 2}),
        "reference": reference, "reference_step_s_median": ref_step_s, "save_cost": costs, "runs": runs,
        "totals": {
            "injected": injected, "fired": sum(r["fired"] for r in runs),
            "recoveries": sum(r["recoveries"] for r in runs),
            "runs_finished": sum(r["finished"] for r in runs), "runs": len(runs),
            "runs_bit_exact": sum(bool(r.get("curve_bit_exact")) for r in runs),
            "redone_steps": sum(r["redone_steps"] for r in runs),
            "unplanned_restarts": sum(r["unplanned_restarts"] for r in runs),
            "wall_overhead_s_per_kill_mean": statistics.fmean(
                [r["wall_overhead_s_per_kill"] for r in runs if "wall_overhead_s_per_kill" in r] or [float("nan")]),
        },
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    t, c = result["totals"], costs
    print(f"\n[{mode}] recoveries {t['recoveries']}/{t['injected']}, runs finished {t['runs_finished']}/{t['runs']}, "
          f"bit-exact curves {t['runs_bit_exact']}/{t['runs']}, redone steps {t['redone_steps']}, "
          f"unplanned restarts {t['unplanned_restarts']}, overhead {t['wall_overhead_s_per_kill_mean']:.1f} s/kill")
    if c["saves"]:
        print(f"[{mode}] save: blocking {c['blocking_s_median'] * 1e3:.0f} ms, total {c['total_s_median'] * 1e3:.0f} ms"
              f" (median of {c['saves']}); step {c['step_s_in_flight_median'] or float('nan'):.3f} s with a save in "
              f"flight ({c['steps_in_flight']} steps) vs {c['step_s_idle_median'] or float('nan'):.3f} s without "
              f"({c['steps_idle']} steps)")
    print(f"results: {out_path}")
    return 0 if t["runs_finished"] == t["runs"] and ref["exit_code"] == 0 else 1


# ----------------------------------------------------------------------------------------------------------
# Hostile mode

HOSTILE_CONFIGS = [["--compress", "none"], ["--compress", "fp16"], ["--compress", "topk:ratio=0.01"], ["--compress", "powersgd:rank=2"],
                   ["--compress", "fp8:error_feedback=true"], ["--sync", "localsgd:period=2"]]
HANG_TIMEOUT_S = 5


def _hostile_cmd(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), "--nproc", "2",
            "--preset", "tiny", "--steps", str(steps), "--data.seq_len=32", "--deterministic",
            "--train.val_interval=0", "--train.val_batches=1", *extra]


class _Job:
    """A `syncwise train` subprocess whose stderr lines are kept with their arrival times (with ``--lab`` in the
    command also its stdout: node 0's workers print there through the lab launcher)."""

    def __init__(self, cmd: list[str]):
        import threading

        self.t0 = time.monotonic()
        self.lab = "--lab" in cmd
        self.run_dir = cmd[cmd.index("--run-dir") + 1]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if self.lab else subprocess.DEVNULL, stderr=subprocess.STDOUT if self.lab else
            subprocess.PIPE, text=True, start_new_session=True)
        stream = self.proc.stdout if self.lab else self.proc.stderr
        self.lines: list[tuple[float, str]] = []
        self._pump = threading.Thread(target=lambda: self.lines.extend(
            (time.monotonic(), x.rstrip()) for x in stream), daemon=True)
        self._pump.start()

    def workers(self) -> list[int]:
        """The job's worker processes, in rank order."""
        if not self.lab:
            out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-f", "spawn_main"], capture_output=True,
                                 text=True)
            return sorted(int(p) for p in out.stdout.split())  # spawned in local-rank order
        # On the lab each node's torchrun agent (in its own session) starts `python -u -m syncwise.commands.worker
        # --config RUN_DIR/config.json`; a worker's rank is in its environment.
        out = subprocess.run(["pgrep", "-f", f"syncwise.commands.worker --config {self.run_dir}/"],
                             capture_output=True, text=True)
        ranked = []
        for pid in (int(p) for p in out.stdout.split()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
            except OSError:
                continue
            if b"RANK" in env and not any(b"torchrun" in c or b"distributed.run" in c or b"netns" in c for c in cmd):
                ranked.append((int(env[b"RANK"]), pid))
        return [pid for _, pid in sorted(ranked)]

    def wait(self, timeout: float) -> object:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return "timeout"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()

    def err(self) -> str:
        self._pump.join(timeout=5)
        return "\n".join(x for _, x in self.lines)


def _wait_for_step(run_dir: Path, step: int, job: _Job, limit: float = 120) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and job.proc.poll() is None:
        if len(read_rows(run_dir)) >= step if (run_dir / "metrics.jsonl").exists() else False:
            return True
        time.sleep(0.1)
    return False


def _losses(run_dir: Path) -> list:
    return [r.get("loss") for r in read_rows(run_dir)]


def _name(config: list[str]) -> str:
    return '-'.join(config)[2:].replace(':', '_').replace('=', '_')


def hostile_kill(work: Path, config: list[str], trial: int, rng: random.Random, ref: list, steps: int = 40) -> dict:
    run = work / f"kill-{trial}-{_name(config)}"
    job = _Job(_hostile_cmd(run, steps, *config, "--ckpt.interval=4", "--max-restarts", "2"))
    row: dict[str, Any] = {"fault": "SIGKILL", "config": " ".join(config), "trial": trial}
    at = rng.randrange(min(6, steps - 2), max(min(30, steps - 1), min(6, steps - 2) + 1))
    if not _wait_for_step(run, at, job):
        job.kill()
        return {**row, "tried": False, "err": job.err()[-2000:]}
    workers = job.workers()
    rank = rng.randrange(len(workers))
    time.sleep(rng.random() * 0.5)  # a random moment inside the step, not only its start
    os.kill(workers[rank], signal.SIGKILL)
    code = job.wait(300)
    done = [r["step"] for r in read_rows(run)]
    return {**row, "tried": True, "rank": rank, "after_step": at, "exit_code": code,
            "recovered": code == 0 and done == list(range(1, steps + 1)), "bit_exact": _losses(run) == ref}


def hostile_stop(work: Path, config: list[str], trial: int, rng: random.Random) -> dict:
    run = work / f"stop-{trial}-{_name(config)}"
    job = _Job(_hostile_cmd(run, 100000, *config, "--ckpt.interval=0", f"--dist.timeout_s={HANG_TIMEOUT_S}"))
    row: dict[str, Any] = {"fault": "SIGSTOP", "config": " ".join(config), "trial": trial}
    if not _wait_for_step(run, rng.randrange(5, 40), job):
        job.kill()
        return {**row, "tried": False, "err": job.err()[-2000:]}
    workers = job.workers()
    rank = rng.randrange(len(workers))
    os.kill(workers[rank], signal.SIGSTOP)
    stopped = time.monotonic()
    deadline = stopped + HANG_TIMEOUT_S + 60
    report = None
    while time.monotonic() < deadline and report is None:
        report = next(((t, x) for t, x in list(job.lines) if "did not complete" in x), None)
        time.sleep(0.1)
    job.kill()
    after = report[0] - stopped if report else None
    return {**row, "tried": True, "rank": rank, "reported_after_s": after,
            "reported_within": after is not None and after <= HANG_TIMEOUT_S + 5,
            "names_rank": report is not None and f"Did not arrive: rank {rank} " in report[1],
            "report": report[1] if report else job.err()[-2000:]}


def hostile_nan(work: Path, config: list[str], trial: int, rng: random.Random, world: int = 2) -> dict:
    run = work / f"nan-{trial}-{_name(config)}"
    step, rank = rng.randrange(3, 20), rng.randrange(world)
    job = _Job(_hostile_cmd(run, 20, *config, "--ckpt.interval=0", f"--dist.timeout_s={HANG_TIMEOUT_S}",
                            "--inject-fault", f"nan:step={step},rank={rank}"))
    code = job.wait(300)
    rows = read_rows(run) if (run / "metrics.jsonl").exists() else []
    # The run's record on every rank (summary.json is rank 0's; ranks/rankR.json each rank's): under local SGD
    # only the replica that saw the NaN drops its update, and every replica learns the step at the next average.
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    per_rank = [json.loads(p.read_text()).get("skipped_steps") for p in sorted((run / "ranks").glob("rank*.json"))]
    skipped = summary.get("skipped_steps")
    final = summary.get("final_loss")
    return {"fault": "NaN on one rank", "config": " ".join(config), "trial": trial, "tried": True, "rank": rank,
            "step": step, "exit_code": code, "skipped": skipped, "skipped_per_rank": per_rank,
            "skipped_rows": [r["step"] for r in rows if r.get("skipped")], "final_loss": final,
            "recovered": code == 0 and len(rows) == 20 and skipped == [step] and len(per_rank) == world
            and all(s == [step] for s in per_rank) and final is not None and math.isfinite(final)}


def hostile_disk_full(work: Path, trial: int) -> dict:
    mnt = work / f"disk-{trial}"
    mnt.mkdir(parents=True)
    row: dict[str, Any] = {"fault": "disk full during save", "config": "--compress none", "trial": trial}
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)]).returncode != 0:
        return {**row, "tried": False}
    try:
        job = _Job(_hostile_cmd(mnt / "run", 60, "--ckpt.interval=2"))
        code = job.wait(300)
        err = job.err()
        from syncwise.checkpoint.storage import latest_valid

        return {**row, "tried": True, "exit_code": code, "traceback": "Traceback" in err,
                "message": next((x for x in err.splitlines() if "saving the checkpoint" in x), None),
                "recovered": code == 2 and "Traceback" not in err and "is full" in err
                and latest_valid(mnt / "run" / "checkpoints") is not None}
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def hostile_concurrent(work: Path, trial: int) -> dict:
    run = work / f"concurrent-{trial}"
    first = _Job(_hostile_cmd(run, 30, "--ckpt.interval=5"))
    time.sleep(0.3)
    second = _Job(_hostile_cmd(run, 30, "--ckpt.interval=5"))
    codes = sorted([first.wait(300), second.wait(300)], key=str)
    refused = [j for j in (first, second) if j.proc.returncode == 2]
    steps = [r["step"] for r in read_rows(run)] if (run / "metrics.jsonl").exists() else []
    return {"fault": "two starts 0.3 s apart", "config": "--compress none", "trial": trial, "tried": True,
            "exit_codes": codes, "recovered": codes == [0, 2] and steps == list(range(1, 31))
            and "in use by another syncwise run" in refused[0].err()}


def hostile_preempt(work: Path, config: list[str], trial: int, rng: random.Random, ref: list, sig: signal.Signals,
                    steps: int = 40) -> dict:
    """``sig`` (SIGTERM or SIGUSR1, as Slurm's scancel / a preemption sends) to the launcher at a random step: the
    workers agree on a step, save, exit 83; ``--resume auto`` must then finish bit-identical to the reference."""
    run = work / f"{sig.name.lower()}-{trial}-{_name(config)}"
    cmd = _hostile_cmd(run, steps, *config, "--ckpt.interval=4")
    job = _Job(cmd)
    row: dict[str, Any] = {"fault": f"{sig.name} preemption", "config": " ".join(config), "trial": trial}
    at = rng.randrange(2, max(3, steps // 2))  # early enough that the run is still going when the signal lands
    if not _wait_for_step(run, at, job):
        job.kill()
        return {**row, "tried": False, "err": job.err()[-2000:]}
    time.sleep(rng.random() * 0.5)
    job.proc.send_signal(sig)
    code = job.wait(300)
    marker = json.loads((run / "preempted.json").read_text()) if (run / "preempted.json").exists() else {}
    resumed = _Job([*cmd, "--resume", "auto"])
    code2 = resumed.wait(300)
    done = [r["step"] for r in read_rows(run)]
    return {**row, "tried": True, "after_step": at, "exit_code": code, "stopped_at": marker.get("step"),
            "saved": marker.get("saved"), "resume_exit_code": code2,
            "recovered": code == 83 and bool(marker.get("saved")) and code2 == 0 and done == list(range(1, steps + 1)),
            "bit_exact": _losses(run) == ref, "err": resumed.err()[-2000:] if code2 != 0 else None}


def hostile_corrupt(work: Path, config: list[str], trial: int, rng: random.Random, ref_dir: Path, ref: list) -> dict:
    """A copy of the finished reference run whose newest checkpoint is damaged (truncated, or one flipped byte) and
    whose summary is gone (as if it died after that save): ``--resume auto`` must skip it with a warning, resume
    from the previous one and finish bit-identical."""
    from syncwise.checkpoint import corrupt_checkpoint
    from syncwise.checkpoint.storage import published_checkpoints

    run = work / f"corrupt-{trial}-{_name(config)}"
    shutil.copytree(ref_dir, run)
    newest = published_checkpoints(run / "checkpoints")[0]
    mode = rng.choice(["truncate", "flip"])
    corrupt_checkpoint(newest, mode=mode)
    (run / "summary.json").unlink()
    steps = len(ref)
    job = _Job(_hostile_cmd(run, steps, *config, "--ckpt.interval=4", "--resume", "auto"))
    code = job.wait(300)
    err = job.err()
    done = [r["step"] for r in read_rows(run)]
    return {"fault": "corrupted newest checkpoint", "config": " ".join(config), "trial": trial, "tried": True,
            "damage": mode, "checkpoint": newest.name, "exit_code": code, "skipped_it": newest.name in err,
            "recovered": code == 0 and done == list(range(1, steps + 1)) and newest.name in err,
            "bit_exact": _losses(run) == ref, "err": err[-2000:] if code != 0 else None}


PACE_MS = 100
# Layouts for --hostile --layouts: each a `syncwise train` flag list on top of _hostile_cmd's tiny 2-rank defaults.
_SMALL_PP2 = ["--preset", "small", "--parallel.pp", "2", "--parallel.stages_per_rank", "2", "--data.batch_size", "4",
              "--parallel.microbatches", "4"]
LAYOUTS: dict[str, list[str]] = {
    "ddp": ["--parallel.dp_replicate", "2"],
    "fsdp": ["--parallel.dp_shard", "2"],
    "hsdp": ["--nproc", "4", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
    "tp2": ["--parallel.tp", "2"],
    "pp2-1f1b": ["--parallel.pp", "2"],
    "pp2-interleaved-1f1b": [*_SMALL_PP2, "--parallel.pp_schedule", "interleaved-1f1b"],
    "pp2-zbv": [*_SMALL_PP2, "--parallel.pp_schedule", "zbv"],
    "pp2-dualpipev": [*_SMALL_PP2, "--parallel.pp_schedule", "dualpipev"],
    "ep2": ["--preset", "tiny-moe", "--parallel.ep", "2"],
    "pp2xep2": ["--nproc", "4", "--preset", "tiny-moe", "--parallel.pp", "2", "--parallel.ep", "2"],
    "localsgd": ["--sync", "localsgd:period=2"],
}
LAYOUTS_WORLD = {name: int(c[c.index("--nproc") + 1]) if "--nproc" in c else 2 for name, c in LAYOUTS.items()}


def hostile_layouts_main(args: argparse.Namespace) -> int:
    names = list(LAYOUTS) if args.layouts == "all" else [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise SystemExit(f"--layouts {args.layouts!r}: 'all' or a comma list of {', '.join(LAYOUTS)}")
    steps = 12 if args.smoke else 40
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(args.seed)
    results: list[dict] = []

    def record(row: dict) -> None:
        row["layout"] = layout
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("err", "report")}), flush=True)

    for layout in names:
        # Every step waits PACE_MS for its data (an injected slow loader; the losses do not change), so a signal
        # sent at a random step lands while the run is still going (a tiny model's step takes ~15 ms).
        config = [*LAYOUTS[layout], "--inject-fault", f"slowdata:ms={PACE_MS}"]
        world = LAYOUTS_WORLD[layout]
        if args.lab:  # the layout across 2 lab nodes (`syncwise train --lab`: the lab's default prefix)
            from syncwise import lab

            lab.up(2, args.bandwidth, procs_per_node=world // 2)
            config += ["--lab", "--nproc", str(world // 2)]
        ref_dir = work / f"ref-{layout}"
        ref_job = _Job(_hostile_cmd(ref_dir, steps, *config, "--ckpt.interval=4"))
        if ref_job.wait(600) != 0:
            record({"fault": "reference run", "config": " ".join(config), "tried": True, "recovered": False,
                    "err": ref_job.err()[-2000:]})
            continue
        ref = _losses(ref_dir)
        for trial in range(args.trials):
            record(hostile_kill(work, config, trial, rng, ref, steps))
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                record(hostile_preempt(work, config, trial, rng, ref, sig, steps))
            record(hostile_stop(work, config, trial, rng))
            record(hostile_nan(work, config, trial, rng, world))
            record(hostile_corrupt(work, config, trial, rng, ref_dir, ref))
    if args.lab:
        from syncwise import lab

        lab.down()
    table: dict[str, dict[str, dict[str, int]]] = {}
    for r in results:
        t = table.setdefault(r["layout"], {}).setdefault(r["fault"], {"tried": 0, "ok": 0, "bit_exact": 0})
        t["tried"] += bool(r.get("tried"))
        t["ok"] += bool(r.get("recovered") if r["fault"] != "SIGSTOP" else r.get("reported_within")
                        and r.get("names_rank"))
        t["bit_exact"] += bool(r.get("bit_exact"))
    out = Path(args.out) if args.out else RESULTS / ("reliability-hostile-layouts" + ("-smoke" if args.smoke else "")
                                                     + ".json")
    out.write_text(json.dumps({"command": f"python benchmarks/reliability.py --hostile --layouts {args.layouts} "
                                          f"--trials {args.trials} --seed {args.seed}" + (" --smoke" if args.smoke else "")
                                          + (f" --lab --bandwidth {args.bandwidth}" if args.lab else ""),
                               "lab": {"nodes": 2, "bandwidth": args.bandwidth} if args.lab else None,
                               "steps": steps, "hang_timeout_s": HANG_TIMEOUT_S, "summary": table, "runs": results},
                              indent=1) + "\n")
    faults = sorted({f for t in table.values() for f in t})
    print("| layout | " + " | ".join(faults) + " |")
    print("|---|" + "---|" * len(faults))
    for layout, t in table.items():
        cells = [f"{t[f]['ok']}/{t[f]['tried']}" + (f" ({t[f]['bit_exact']} exact)" if t[f]["bit_exact"] else "")
                 if f in t else "–" for f in faults]
        print(f"| {layout} | " + " | ".join(cells) + " |")
    print("ok: recovered and finished (SIGSTOP: the hang reported within the timeout + 5 s, naming the rank); "
          f"exact: the loss curve bit-identical to the layout's reference. results: {out}")
    return 0 if all(r.get("tried") for r in results) else 1


def hostile_main(args: argparse.Namespace) -> int:
    if args.security:
        return security_main(args)
    if args.layouts:
        return hostile_layouts_main(args)
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(args.seed)
    results: list[dict] = []
    for config in HOSTILE_CONFIGS:
        ref_job = _Job(_hostile_cmd(work / f"ref-{_name(config)}", 40, *config, "--ckpt.interval=4"))
        ref_job.wait(300)
        ref = _losses(work / f"ref-{_name(config)}")
        for trial in range(args.trials):
            for fn in (lambda: hostile_kill(work, config, trial, rng, ref), lambda: hostile_stop(work, config, trial, rng),
                       lambda: hostile_nan(work, config, trial, rng)):
                results.append(fn())
                print(json.dumps({k: v for k, v in results[-1].items() if k not in ("err", "report")}), flush=True)
    for trial in range(args.trials):
        for fn in (lambda: hostile_disk_full(work, trial), lambda: hostile_concurrent(work, trial)):
            results.append(fn())
            print(json.dumps({k: v for k, v in results[-1].items() if k != "err"}), flush=True)
    table: dict[str, dict[str, int]] = {}
    for r in results:
        t = table.setdefault(r["fault"], {"tried": 0, "recovered": 0, "bit_exact": 0, "hangs_reported_in_time": 0,
                                          "names_stopped_rank": 0})
        t["tried"] += bool(r.get("tried"))
        t["recovered"] += bool(r.get("recovered"))
        t["bit_exact"] += bool(r.get("bit_exact"))
        t["hangs_reported_in_time"] += bool(r.get("reported_within"))
        t["names_stopped_rank"] += bool(r.get("names_rank"))
    out = Path(args.out) if args.out else RESULTS / "reliability-hostile.json"
    out.write_text(json.dumps({"command": "python benchmarks/reliability.py --hostile --trials "
                                          f"{args.trials} --seed {args.seed}", "hang_timeout_s": HANG_TIMEOUT_S,
                               "summary": table, "runs": results}, indent=1) + "\n")
    print("| fault | tried | recovered / finished as specified | bit-exact | hang reported ≤ timeout+5 s | names the stopped rank |")
    print("|---|---|---|---|---|---|")
    for fault, t in table.items():
        print(f"| {fault} | {t['tried']} | {t['recovered']} | {t['bit_exact']} | {t['hangs_reported_in_time']} | "
              f"{t['names_stopped_rank']} |")
    print(f"results: {out}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# Security counts (issue 42)

class _Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _external_address() -> str | None:
    import ipaddress
    import socket

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def _exposed(pids: set[int]) -> dict[str, Any]:
    """The listening sockets of ``pids``: how many, how many bound to a non-loopback address, and how many of those
    accept a connection from this host's external address."""
    import ipaddress
    import socket

    import psutil

    listening = [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    outside = [x for x in listening if not ipaddress.ip_address(x[1].split("%")[0]).is_loopback]
    host, reached = _external_address(), []
    for _, _, port in outside:
        try:
            socket.create_connection((host, port), timeout=1).close()
            reached.append(port)
        except (OSError, TypeError):
            pass
    return {"listening": len(listening), "non_loopback": len(outside), "reachable_from_outside": len(reached),
            "external_address": host, "sockets": [f"{ip}:{port}" for _, ip, port in listening]}


def security_network(work: Path, smoke: bool) -> dict[str, Any]:
    import psutil

    if smoke:  # the lighthouse alone, as the launcher starts it
        from syncwise.launch.ft import Lighthouse

        lh = Lighthouse(1, work / "lighthouse.log")
        try:
            return {"what": "lighthouse alone (--smoke)", **_exposed({lh.proc.pid})}
        finally:
            lh.shutdown()
    run = work / "ft-run"
    job = subprocess.Popen([sys.executable, "-m", "syncwise.cli", "train", "--preset", "tiny", "--nproc", "1",
                            "--ft.replicas=2", "--steps", "200", "--inject-fault", "slowdata:ms=150",
                            "--metrics.prometheus_bind=127.0.0.1", "--run-dir", str(run)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:  # both groups training: every endpoint is up
            status = list((run / "ft" / "status").glob("replica*.json")) if (run / "ft" / "status").is_dir() else []
            if len(status) >= 2:
                time.sleep(3)
                break
            time.sleep(1)
        pids = {job.pid} | {c.pid for c in psutil.Process(job.pid).children(recursive=True)}
        return {"what": "syncwise train --ft.replicas=2 (lighthouse, managers, stores, heal servers)", **_exposed(pids)}
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def security_pickle(work: Path) -> dict[str, Any]:
    """Planted payloads at every load site that used to unpickle; counts the ones that ran."""
    import io
    import pickle
    import threading
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    import torch

    tried, executed, sites = 0, 0, {}

    def site(name: str, attempt) -> None:
        nonlocal tried, executed
        marker = work / f"marker-{name}"
        tried += 1
        how = "loaded without running it"
        try:
            attempt(str(marker))
        except Exception as e:  # noqa: BLE001 — a refusal is the goal; only the marker counts
            how = f"refused: {type(e).__name__}: {str(e)[:160]}"
        ran = marker.exists()
        executed += ran
        sites[name] = "EXECUTED" if ran else how

    def heal(signed: bool):
        def attempt(marker: str) -> None:
            from torch.distributed._serialization import _streaming_save

            from syncwise.train.heal_transport import fetch, payload_tag

            buf = io.BytesIO()
            _streaming_save({"model": _Payload(marker)}, buf)
            payload, secret = buf.getvalue(), b"a" * 64
            body = payload + (payload_tag(secret, 3, payload) if signed else b"\0" * 32)

            class Handler(BaseHTTPRequestHandler):
                def log_message(self, *a):
                    pass

                def do_GET(self):
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(body)

            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                fetch(f"http://127.0.0.1:{server.server_address[1]}/checkpoint/3/full", 3, secret,
                      timedelta(seconds=5))
            finally:
                server.shutdown()
        return attempt

    def integration(marker: str) -> None:
        from syncwise.integrations.transformers import FILENAME, SyncwiseTrainerCallback

        folder = work / "hf-out" / "checkpoint-3"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "syncwise.compress/per-rank/1", "world_size": 1, "ranks": [_Payload(marker)]},
                   folder / FILENAME)
        SyncwiseTrainerCallback("powersgd:rank=2").on_train_begin(
            SimpleNamespace(output_dir=str(work / "hf-out"), world_size=1, process_index=0),
            SimpleNamespace(global_step=3), None, model=torch.nn.Linear(2, 2))

    def meta_pkl(marker: str) -> None:
        from syncwise.data import load_corpus

        folder = work / "nano"
        folder.mkdir(exist_ok=True)
        (torch.arange(1000) % 50).to(torch.int16).numpy().tofile(folder / "train.bin")
        (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 50, "x": _Payload(marker)}))
        load_corpus(str(folder), cache_dir=work / "cache")

    site("heal transfer, unsigned", heal(False))
    site("heal transfer, signed by an insider", heal(True))
    site("transformers syncwise_compress.pt", integration)
    site("nanoGPT meta.pkl", meta_pkl)
    return {"tried": tried, "payloads_executed": executed, "sites": sites}


def security_rows(work: Path) -> dict[str, Any]:
    """Row 5: line 4 of an 8-step metrics.jsonl cut, the run resumed at step 8: every other row must stay."""
    from syncwise.metrics import MetricsLogger
    from syncwise.metrics.logger import read_jsonl

    run = work / "rows"
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "loss": 5.0, "step_time_s": 0.1} for i in range(1, 9)]
    lines = [json.dumps(r) for r in rows]
    lines[3] = lines[3][:10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    logger = MetricsLogger(run, 10, start_step=8, show=False, tensorboard=False)
    logger.finish({"steps": 8})
    kept = {r["step"] for r in read_jsonl(run / "metrics.jsonl")}
    return {"valid_rows": 7, "rows_lost": len({1, 2, 3, 5, 6, 7, 8} - kept)}


def security_bad_input(work: Path) -> dict[str, Any]:
    """Row 11: tracebacks and accepted nonsense through the CLI, the Python API and report/doctor."""
    import contextlib
    import io

    import torch
    from torch import nn

    from syncwise.cli import main
    from syncwise.errors import ConfigError

    counts = {"cli_tried": 0, "cli_tracebacks": 0, "cli_nonsense_accepted": 0, "api_tried": 0,
              "api_tracebacks": 0, "api_silently_accepted": 0, "rundir_tried": 0, "rundir_tracebacks": 0,
              "long_echoes": 0}

    def quiet(argv: list[str]) -> tuple[Any, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                return main(argv), err.getvalue()
            except SystemExit as e:
                return e.code, err.getvalue()
            except Exception as e:  # noqa: BLE001 — what is counted
                return e, err.getvalue()

    nonsense = [["--train.lr=4.9e-324"], ["--train.warmup_steps=1000000000", "--steps", "1"],
                ["--train.clip_grad=5e-324"], ["--run-dir", str(work / "r\u202eun")],
                ["--run-dir", str(work / "a\x07b")], ["--ft.replicas=2", "--metrics.prometheus_port=9400"],
                ["--run-dir", "x" * 1_000_000]]
    for args in nonsense:
        counts["cli_tried"] += 1
        code, err = quiet(["train", "--check", "--preset", "tiny", *args])
        counts["cli_tracebacks"] += isinstance(code, BaseException) or "Traceback" in err
        counts["cli_nonsense_accepted"] += code == 0
        counts["long_echoes"] += len(err) > 1000
    wrong = {"show_progress": "no", "compile": "yes", "tf32": 1, "device": 3.5, "grad_accum_steps": "2",
             "clip_grad_norm": "1", "bucket_cap_mb": [1], "min_numel": "x", "val_loader": "abc", "run_dir": 5,
             "val_interval": 1.5, "log_interval": None, "flops_per_token": "1e9", "checkpointer": "dir",
             "lr_scheduler": 3, "dynamic_batch": True, "collective_timeout_s": "60", "preempt_grace_s": [],
             "inject_faults": 5, "live_recovery": "yes", "compress_gradients": 4, "sync": 2, "parallel": "ddp",
             "tp_plan": [1], "pipeline_split": 5, "mixed_precision": torch.zeros(2), "activation_checkpointing": 0,
             "data_seed": "0"}
    for name, value in wrong.items():
        counts["api_tried"] += 1
        model = nn.Linear(4, 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                from syncwise.train import OptimizedTrainer

                OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
                                 **{name: value})
            counts["api_silently_accepted"] += 1
        except ConfigError:
            pass
        except Exception:  # noqa: BLE001
            counts["api_tracebacks"] += 1
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    try:
        from test_damaged_rundir import DAMAGES, _good
    except ImportError:
        DAMAGES = {}
    from syncwise.commands import report

    draw, report.draw = report.draw, (lambda runs: b"png")
    try:
        for i, (name, damage) in enumerate(sorted(DAMAGES.items())):
            run = work / "damaged" / f"{i}"
            _good(run)
            damage(run)
            for argv in (["report", str(run)], ["doctor", str(run)]):
                counts["rundir_tried"] += 1
                code, err = quiet(argv)
                counts["rundir_tracebacks"] += isinstance(code, BaseException) or "Traceback" in err
    finally:
        report.draw = draw
    return counts


def security_main(args: argparse.Namespace) -> int:
    work = Path(args.work_dir) / "security"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result = {"network": security_network(work, args.smoke), "pickle": security_pickle(work),
              "rows": security_rows(work), "bad_input": security_bad_input(work)}
    b = result["bad_input"]
    counts = {
        "endpoints reachable from a non-loopback address": result["network"]["reachable_from_outside"],
        "endpoints bound to a non-loopback address": result["network"]["non_loopback"],
        "payloads executed": result["pickle"]["payloads_executed"],
        "rows lost on resume (damaged metrics.jsonl)": result["rows"]["rows_lost"],
        "tracebacks on bad input": b["cli_tracebacks"] + b["api_tracebacks"] + b["rundir_tracebacks"],
        "nonsense or wrong types accepted": b["cli_nonsense_accepted"] + b["api_silently_accepted"],
        "echoes over 1,000 characters": b["long_echoes"],
    }
    result["counts"] = counts
    out = Path(args.out) if args.out else RESULTS / "reliability-security.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("| attack (issue 42) | count (goal 0) |")
    print("|---|---|")
    for name, n in counts.items():
        print(f"| {name} | {n} |")
    print(f"tried: {result['network']['listening']} listening sockets ({result['network']['what']}), "
          f"{result['pickle']['tried']} payloads, {b['cli_tried']} config values, {b['api_tried']} API keywords, "
          f"{b['rundir_tried']} report/doctor runs on damaged directories")
    print(f"results: {out}")
    return 0 if not any(counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
