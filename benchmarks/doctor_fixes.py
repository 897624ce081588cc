"""Does doctor's recommendation help? For each planted cause: run, ask `syncwise doctor`, apply its top
recommendation, run again, and print step time before / after side by side with doctor's prediction.

    python benchmarks/doctor_fixes.py                      # every cause except the link, the default sizes below
    python benchmarks/doctor_fixes.py --lab 20mbit         # + the link, on a 2-node network lab at that rate (root)
    python benchmarks/doctor_fixes.py --smoke              # tiny settings, to check the script (not a result)
    python benchmarks/doctor_fixes.py --causes straggler,checkpoint
    python benchmarks/doctor_fixes.py --live-only          # only the time from a straggler's onset to its naming

The straggler row is a compute straggler *inside the backward* under DDP (``slow:...,phase=backward``): its
slowness lands in the other ranks' all-reduce waits, and doctor finds it by arrival order at the collectives.
`--live` (on by default) also measures, on a run that trains while `doctor --follow`'s check watches it, the time
from a straggler's onset (rank 1's first slow step, its own flight-recorder record) to doctor first naming it.

Each run is a real `syncwise train` (2 workers, gloo, CPU) into its own run directory under --out. "fix" is the
flag doctor printed for the top cause, applied to the same command line. Where doctor's change is not a flag
(replace a straggler's node, make the loader keep up, rebalance experts), the rerun removes the planted fault
instead and the row says so: that measures what doctor says the cause costs, not a flag's effect.
Where doctor recommends no flag (it predicts none to help, or says it cannot tell) the row is not rerun and counts
as not helped; ``declined`` counts those rows and ``predicted_direction_right`` / ``_wrong`` the rows whose
prediction was tested.
Step = wall time per optimizer step including checkpoint stalls (doctor's wall_step_s), steady steps.
Results: benchmarks/results/doctor-fixes-<UTC date>.json (or --json).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from syncwise.doctor import diagnose, load_run  # noqa: E402

# cause -> (flags that plant it, the cause doctor should name)
CAUSES = {
    "straggler": (["--inject-fault", "slow:rank=1,factor=2,phase=backward"], "straggler"),
    "data_loader": (["--inject-fault", "slowdata:ms={data_ms},rank=1"], "data_loader"),
    "buckets_too_small": (["--dist.bucket_cap_mb=0.001"], "buckets_too_small"),
    "buckets_too_large": (["--dist.bucket_cap_mb=1000"], "buckets_too_large"),
    "compression": (["--compress", "topk:ratio=0.01"], "compression"),
    "checkpoint": (["--ckpt.interval=1", "--ckpt.async_save=false"], "checkpoint"),
    "pipeline_bubble": (["--parallel.pp=2", "--parallel.microbatches=2", "--parallel.pp_schedule=gpipe"],
                        "pipeline_bubble"),
    "expert_imbalance": (["--preset", "small", "--parallel.ep=2", "--inject-fault", "skew:experts=2"],
                         "expert_imbalance"),
}
LAB_PREFIX = os.environ.get("SYNCWISE_BENCH_LAB_PREFIX", "swdb")
NOT_A_FLAG = {"straggler": "node replaced (fault removed)", "data_loader": "loader fixed (fault removed)",
              "expert_imbalance": "routing rebalanced (skew removed)"}


def live_onset(out: Path, base: list[str], steps: int, onset: int, interval_s: float = 1.0) -> dict:
    """Train with a straggler from step ``onset`` on while doctor's --follow check looks every ``interval_s``:
    seconds from rank 1's first slow step (its flight-recorder row) to the first look naming it."""
    import threading

    from syncwise.doctor.follow import check

    run_dir = out / "live"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = [a for a in base] + ["--inject-fault", f"slow:rank=1,factor=2,step={onset},phase=backward"]
    argv[argv.index("--steps") + 1] = str(steps)
    looks: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            look = check(run_dir, window=20)
            if look is not None:
                looks.append(look)
            done.wait(interval_s)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        train(run_dir, argv, None, out / "live.log")
    finally:
        done.set()
        t.join()
    rows = [json.loads(x) for x in (run_dir / "ranks" / "arrivals1.jsonl").read_text().splitlines()]
    start = next(r["start_ns"] for r in rows if r["step"] == onset) / 1e9
    named = next((x for x in looks if x["cause"] == "straggler" and x["rank"] == 1 and x["time"] >= start), None)
    false = [x for x in looks if x["cause"] == "straggler" and x["time"] < start]
    return {"steps": steps, "onset_step": onset, "check_interval_s": interval_s, "window_steps": 20,
            "arrivals_read_every_s": 5.0, "looks": len(looks), "onset_time": start,
            "named_time": named["time"] if named else None, "named_at_step": named["step"] if named else None,
            "seconds_to_name": named["time"] - start if named else None,
            "straggler_named_before_onset": len(false)}


def train(run_dir: Path, argv: list[str], lab: str | None, log: Path, nproc_per_node: int = 1) -> None:
    """One `syncwise train` run (on the lab's nodes with --lab, ``nproc_per_node`` workers on each)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if lab:
        from syncwise.commands.train import prepare_run_dir
        from syncwise.config import config_from_argv
        from syncwise.lab.launch import lab_torchrun

        cfg = config_from_argv(argv + ["--run-dir", str(run_dir), "--dist.lab=true",
                                       f"--dist.nproc={nproc_per_node}"])
        prepare_run_dir(cfg).release()
        rc = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")],
                          nproc_per_node=nproc_per_node, log_dir=log.parent / f"{run_dir.name}-logs", timeout=1800,
                          prefix=LAB_PREFIX)
    else:
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), *argv],
                                stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"training failed ({rc}): {run_dir} (log {log})")


def without_fault(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--inject-fault":
            skip = True
            continue
        out.append(a)
    return out


def same_settings(after: Path, before: Path) -> bool:
    """Whether the rerun ``after`` has the model, steps and sequence length of ``before`` (for --rediagnose: a
    directory left by an earlier run with other settings is not this row's rerun)."""
    try:
        a, b = (json.loads((d / "config.json").read_text()) for d in (after, before))
    except (OSError, ValueError):
        return False
    key = lambda c: (c.get("model", {}).get("preset"), c.get("train", {}).get("steps"),  # noqa: E731
                     c.get("data", {}).get("seq_len"))
    return key(a) == key(b)


def applied(after: Path, argv: list[str]) -> bool:
    """Whether the run in ``after`` was trained with ``argv`` (for --rediagnose: a rerun left by an earlier doctor
    that recommended another change is not this recommendation's rerun)."""
    from syncwise.config import config_from_argv

    try:
        have = json.loads((after / "config.json").read_text())
        want = config_from_argv(list(argv)).to_dict()
    except Exception:
        return False
    skip = {"run_dir", "nproc", "lab", "run"}

    def flat(d: dict, pre: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{pre}{k}."))
            elif k not in skip:
                out[pre + k] = v
        return out
    h, w = flat(have), flat(want)
    return all(h.get(k) == v for k, v in w.items() if k in h)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-dense")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data-ms", type=int, default=200, help="the planted loader delay")
    ap.add_argument("--causes", default=",".join(CAUSES), help="comma-separated subset")
    ap.add_argument("--lab", default=None, metavar="RATE", help="also the link cause, on a 2-node lab at RATE")
    ap.add_argument("--lab-prefix", default=None, help="the lab's namespace prefix (default swdb)")
    ap.add_argument("--lab-subnet", default="10.77.0.0/24", help="the lab's subnet")
    ap.add_argument("--no-live", action="store_true", help="skip the onset-to-naming measurement")
    ap.add_argument("--repeat", type=int, default=1, help="before/after pairs per row, alternating (medians)")
    ap.add_argument("--live-only", action="store_true", help="only the onset-to-naming measurement")
    ap.add_argument("--live-steps", type=int, default=120)
    ap.add_argument("--live-onset", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 6 steps: checks the script, not a result")
    ap.add_argument("--out", default="/tmp/syncwise-doctor-fixes", help="run directories go here")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" /
                                          f"doctor-fixes-{time.strftime('%Y-%m-%d', time.gmtime())}.json"))
    ap.add_argument("--rediagnose", action="store_true", help="train nothing: diagnose the run directories a "
                    "previous run of this script left in --out (same settings) and rewrite the table and JSON")
    args = ap.parse_args()
    global LAB_PREFIX
    LAB_PREFIX = args.lab_prefix or LAB_PREFIX
    if args.smoke:
        args.preset, args.steps, args.seq_len = "tiny", 6, 32
    base = ["--nproc", "2", "--preset", args.preset, "--steps", str(args.steps), f"--data.seq_len={args.seq_len}",
            f"--data.batch_size={args.batch_size}", "--train.val_interval=0", "--train.val_batches=1",
            "--ckpt.interval=0"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(name, [f.format(data_ms=args.data_ms) for f in CAUSES[name][0]], CAUSES[name][1])
            for name in args.causes.split(",") if name] if not args.live_only else []
    if args.lab and not args.live_only:
        plan.append(("link", [], "link"))
    rows, console = [], Console(width=max(160, Console().width))
    if args.lab and not args.rediagnose and not args.live_only:
        from syncwise.lab import cluster as lab_cluster
        lab_cluster.up(2, args.lab, prefix=LAB_PREFIX)
    try:
        for name, flags, cause in plan:
            if args.smoke and name == "expert_imbalance":
                flags = ["--preset", "tiny-moe", *flags[2:]]
            argv = base + flags
            lab = args.lab if name == "link" else None
            t0 = time.time()
            if not args.rediagnose:
                train(out / f"{name}-before", argv, lab, out / f"{name}-before.log")
            d = diagnose(load_run(out / f"{name}-before"))
            top = d.top
            if name in NOT_A_FLAG:
                fix, how = without_fault(argv), NOT_A_FLAG[name]
            elif top is not None and top.flag:
                fix, how = argv + shlex.split(top.flag), top.flag
            else:  # doctor predicted no change to help, or said it cannot tell (its predicted_by says which)
                fix, how = None, "none recommended" + (f" ({top.predicted_by})" if top is not None and
                                                       top.predicted_by else "")
            after = None
            if fix is not None and args.rediagnose and not (
                    same_settings(out / f"{name}-after", out / f"{name}-before")
                    and (name in NOT_A_FLAG or applied(out / f"{name}-after", fix))):
                fix, how = None, how + " (no rerun with these settings in --out)"
            if fix is not None:
                if not args.rediagnose:
                    train(out / f"{name}-after", fix, lab, out / f"{name}-after.log")
                after = diagnose(load_run(out / f"{name}-after"), predict=False)
            # --repeat: more before / after pairs, alternating (a shared machine's load drifts: paired, interleaved)
            befores, afters = [d.wall_s], [after.wall_s] if after else []
            for i in range(1, args.repeat if fix is not None and not args.rediagnose else 1):
                train(out / f"{name}-before{i}", argv, lab, out / f"{name}-before{i}.log")
                befores.append(diagnose(load_run(out / f"{name}-before{i}"), predict=False).wall_s)
                train(out / f"{name}-after{i}", fix, lab, out / f"{name}-after{i}.log")
                afters.append(diagnose(load_run(out / f"{name}-after{i}"), predict=False).wall_s)
            before_s = statistics.median(befores)
            after_s = statistics.median(afters) if afters else None
            predicted = top.predicted_step_s if top else None
            row = {"cause": name, "planted": flags, "named_first": top.cause if top else None,
                   "named_correctly": bool(top and top.cause == cause), "fix": how,
                   "helped": bool(after_s and after_s < before_s),
                   "declined": bool(top is not None and name not in NOT_A_FLAG and not top.flag),
                   "verdict": (top.details or {}).get("verdict") if top else None,
                   "predicted_direction_right": (None if after_s is None or predicted is None else
                                                 (predicted < d.wall_s) == (after_s < before_s)),
                   "step_before_s": before_s, "step_after_s": after_s,
                   "steps_before_s": befores, "steps_after_s": afters,
                   "pair_ratios": [b / a for b, a in zip(befores, afters)],
                   "ratio": before_s / after_s if after_s else None,
                   "predicted_step_s": top.predicted_step_s if top else None,
                   "predicted_by": top.predicted_by if top else None,
                   "efficiency_before": d.efficiency, "efficiency_after": after.efficiency if after else None,
                   "predicted_efficiency": top.predicted_efficiency if top else None,
                   "seconds": time.time() - t0}
            rows.append(row)
            console.print(f"{name}: doctor names {row['named_first']}; {how}: {before_s * 1e3:,.0f} → "
                          f"{(after_s * 1e3 if after_s else float('nan')):,.0f} ms")
    finally:
        if args.lab and not args.rediagnose and not args.live_only:
            lab_cluster.down(LAB_PREFIX)
    table = Table(title=f"doctor's fixes ({args.preset}, {args.steps} steps, seq {args.seq_len}, 2 workers)")
    for col in ("cause", "doctor names", "fix applied", "step before ms", "after ms", "before/after",
                "predicted ms", "efficiency before → after (predicted)"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["cause"], r["named_first"] or "-", r["fix"], f"{r['step_before_s'] * 1e3:,.1f}",
                      f"{r['step_after_s'] * 1e3:,.1f}" if r["step_after_s"] else "-",
                      f"{r['ratio']:.2f}×" if r["ratio"] else "-",
                      f"{r['predicted_step_s'] * 1e3:,.1f}" if r["predicted_step_s"] else "-",
                      f"{r['efficiency_before']:.2f} → {r['efficiency_after']:.2f} ({r['predicted_efficiency']:.2f})"
                      if r["efficiency_after"] is not None and r["predicted_efficiency"] is not None else "-")
    console.print(table)
    live = None
    if not args.no_live and not args.rediagnose:
        live = live_onset(out, base, args.live_steps, args.live_onset)
        console.print(f"live: straggler from step {live['onset_step']} named after {live['seconds_to_name']} s "
                      f"(step {live['named_at_step']})")
    result = {"command": " ".join([Path(sys.argv[0]).name, *[a for a in sys.argv[1:] if a != "--rediagnose"]]),
              "machine": "shared: 2 CPU cores used by several sessions at once; ratios within a row are paired "
                         "(before and after back to back), absolute times are not a speed claim",
              "named_first": sum(r["named_correctly"] for r in rows), "helped": sum(r["helped"] for r in rows),
              "declined": sum(r["declined"] for r in rows),
              "predicted_direction_right": sum(r["predicted_direction_right"] is True for r in rows),
              "predicted_direction_wrong": sum(r["predicted_direction_right"] is False for r in rows),
              "rows_total": len(rows), "live": live,
              "smoke": args.smoke,
              "repeat": args.repeat, "preset": args.preset, "steps": args.steps, "seq_len": args.seq_len,
              "batch_size": args.batch_size,
              "lab_rate": args.lab, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
