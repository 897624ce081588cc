"""Does doctor read a planted cause from the profiler trace, and is the time it gives it right? For each cause: a
short real `syncwise train` with the cause planted and the same job without it, both recording a torch profiler
trace of a few steady steps (``--profile.steps``); doctor's trace reading (``syncwise.doctor.trace``) names the
causes from the cause run's trace alone, and gives the milliseconds the cause adds, compared with an independent
measure: the median steady step time with the cause minus without it.

    python benchmarks/trace_planted.py                     # every cause but the link, locally (2 workers, gloo, CPU)
    python benchmarks/trace_planted.py --lab 200mbit       # every cause on a 2-node network lab at that rate (root),
                                                           # the link too (RATE against --fast-rate)
    python benchmarks/trace_planted.py --smoke             # tiny settings: checks the script, not a result
    python benchmarks/trace_planted.py --causes straggler,compression --repeat 2
    python benchmarks/trace_planted.py --lab 200mbit --reuse   # read a finished run's traces again (no training)

What each row compares (``trace_added_ms`` against ``step_added_ms``; goal: within ±10 %):

- ``trace_added_ms`` — the change, cause run minus no-cause run, of the parts of the traced step the cause shows in
  (``syncwise.doctor.trace.CAUSE_PARTS``: a straggler in the others' extra wait inside the collectives, a compressor
  in its labelled work on the critical path plus the exposed communication, buckets in the exposed communication
  plus compute (what the backward does for its buckets), the link in the exposed communication, a pipeline bubble
  in the stages' exposed sends and receives) — the trace's own reading of what the
  cause costs, by interval unions (``parts_added_ms``: every part's change, to see where the rest of the step went);
- ``step_added_ms`` — the independent measure: median steady step time (rank 0's step timer, the profiled steps and
  their neighbours left out) with the cause minus without; ``step_added_profiled_ms`` the same over the profiled
  steps (the steps the trace saw, by the step timer);
- ``finding_ms`` — what doctor's trace reading names from the cause run alone (``trace.causes``: ms per step) for
  the expected cause, and ``named_first`` / ``named`` whether it is first / among the named;
- ``timers_added_ms`` — the same change by doctor's step timers (its breakdown's part for the cause), for reference.

The pairs (cause, no cause):

- straggler: ``--inject-fault slow:rank=1,factor=F,phase=backward`` against none;
- buckets_too_small: ``--dist.bucket_cap_mb=0.001`` (a collective per parameter tensor) against a quarter of the
  gradients per bucket (not the default 25 MB: on ``small-dense``, 19.5 MB of gradients, that is one bucket, the
  other cause);
- buckets_too_large: ``--dist.bucket_cap_mb=1000`` (one bucket: nothing overlaps the backward) against a quarter of
  the gradients per bucket (from the model's parameter count);
- compression: ``--compress SPEC`` (default ``topk:ratio=0.01``, a sort over every gradient) against none;
- pipeline_bubble (``--pp-plant interleave``, the default): pp 2, 1F1B against interleaved 1F1B with two stages a
  rank (the bubble halved, Narayanan et al. 2021), 2 micro-batches of --pp-batch-size sequences in both: the same
  micro-batches, so the same compute; on the lab both at --fast-rate (interleaving sends each activation over the
  link three times instead of once). ``--pp-plant microbatches``: GPipe with 2 micro-batches against --pp-many (the
  micro-batches' size changes what the last stage computes: +43 … +53 ms a step at 32 sequences, measured);
- link (``--lab`` only): the lab's links shaped to RATE against --fast-rate, buckets a quarter of the gradients.

Each pair runs back to back (with --repeat, alternating), on the same machine; a shared machine's load drifts, so the
ratio within a pair is what counts. Results: benchmarks/results/trace-planted-<UTC date>.json (or --json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import doctor_fixes  # noqa: E402  (the run helper: train(), shared with benchmarks/doctor_fixes.py)
from syncwise.doctor import diagnose, load_run  # noqa: E402
from syncwise.doctor.analyze import steady  # noqa: E402
from syncwise.doctor.trace import CAUSE_PARTS, added_ms, parts  # noqa: E402

#: doctor's step-timer parts for each cause (its breakdown, syncwise.doctor.analyze.PARTS), for reference
TIMER_PARTS = {"straggler": ("straggler_wait",), "compression": ("compress", "comm_dp"),
               "buckets_too_small": ("comm_dp",), "buckets_too_large": ("comm_dp",), "link": ("comm_dp",),
               "pipeline_bubble": ("pp_bubble",)}
ALL = ("straggler", "buckets_too_small", "buckets_too_large", "compression", "pipeline_bubble", "link")


def pairs(args: argparse.Namespace, quarter_mb: float) -> dict[str, tuple[list[str], list[str]]]:
    """cause -> (flags that plant it, flags of the same job without it)."""
    pp = ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"]
    quarter = f"--dist.bucket_cap_mb={quarter_mb:g}"
    bigger = f"--data.batch_size={args.pp_batch_size}"
    two = ["--parallel.pp=2", "--parallel.microbatches=2", bigger]
    bubble = (([*two, "--parallel.pp_schedule=1f1b"],
               [*two, "--parallel.pp_schedule=interleaved-1f1b", "--parallel.stages_per_rank=2"])
              if args.pp_plant == "interleave" else
              ([*pp, "--parallel.microbatches=2", bigger], [*pp, f"--parallel.microbatches={args.pp_many}", bigger]))
    return {
        "straggler": (["--inject-fault", f"slow:rank=1,factor={args.factor:g},phase=backward"], []),
        "buckets_too_small": (["--dist.bucket_cap_mb=0.001"], [quarter]),
        "buckets_too_large": (["--dist.bucket_cap_mb=1000"], [quarter]),
        "compression": (["--compress", args.compressor], []),
        "pipeline_bubble": bubble,
        "link": ([quarter], [quarter]),  # the same flags: the lab's rate is what changes
    }


def step_ms(run_dir: Path, window: tuple[int, int], profiled: bool = False) -> tuple[float, list[float]]:
    """Median steady step time of rank 0 (ms), the profiled window and the steps beside it left out (the warm-up
    step before it records under the profiler's start, the export follows it) — or, ``profiled``, over the profiled
    steps only (the steps the trace saw, by the trainer's step timer) — and the times it is taken over."""
    run = load_run(run_dir)
    rows = {r["step"]: r for r in run.ranks.get(0, run.rows)}
    use = ([s for s in sorted(rows) if window[0] <= s <= window[1]] if profiled else
           [s for s in steady(sorted(rows)) if not window[0] - 1 <= s <= window[1] + 1])
    times = [1e3 * float(rows[s]["step_time_s"]) for s in use]
    return statistics.median(times), times


def split(t: dict) -> dict:
    """Per rank, the trace's split of the mean profiled step (ms), and the parts the causes are read from."""
    keys = ("step_ms", "compute_ms", "exposed_ms", "compress_ms", "idle_ms", "comm_ms", "payload_calls")
    return {"ranks": {str(r): {k: v[k] for k in keys} for r, v in t["ranks"].items()}, "parts": parts(t)}


def timer_part(d, cause: str) -> float:
    return 1e3 * sum(d.parts[p] for p in TIMER_PARTS[cause])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-dense")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile", default="14:16", help="the profiled steps A:B (steady ones)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--factor", type=float, default=2.0, help="the straggler's slow-down factor")
    ap.add_argument("--compressor", default="topk:ratio=0.01", help="the compressor planted on the critical path")
    ap.add_argument("--pp-plant", choices=("interleave", "microbatches"), default="interleave",
                    help="how the pipeline bubble is planted (the module's docstring)")
    ap.add_argument("--pp-many", type=int, default=8, help="micro-batches of the pipeline's no-cause run "
                    "(--pp-plant microbatches)")
    ap.add_argument("--pp-batch-size", type=int, default=32, help="the pipeline pair's batch: with --batch-size's 8, "
                    "--pp-many micro-batches are one sequence each, whose per-micro-batch cost cancels the bubble "
                    "they remove (measured: 2 against 8 micro-batches −3 ms a step, ±10)")
    ap.add_argument("--causes", default=None, help=f"comma-separated subset of {','.join(ALL)} (default: all; the "
                    "link only with --lab)")
    ap.add_argument("--lab", default=None, metavar="RATE", help="run every pair on a 2-node network lab whose links "
                    "are shaped to RATE (root; the link cause compares RATE with --fast-rate)")
    ap.add_argument("--fast-rate", default="10gbit", help="the link cause's no-cause rate (--lab)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="workers per lab node (--lab)")
    ap.add_argument("--lab-prefix", default=None, help="the lab's namespace prefix (default swdb)")
    ap.add_argument("--repeat", type=int, default=1, help="cause / no-cause pairs per row, alternating (medians)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="the goal: |trace/step − 1| within this")
    ap.add_argument("--reuse", action="store_true", help="train nothing that --out already holds (a finished run of "
                    "the same name): read the traces again, e.g. after a change to doctor's reading")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 8 steps: checks the script, not a result")
    ap.add_argument("--out", default="/tmp/syncwise-trace-planted", help="run directories go here")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" /
                                          f"trace-planted-{time.strftime('%Y-%m-%d', time.gmtime())}.json"))
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.steps, args.seq_len, args.profile, args.pp_many = "tiny", 8, 32, "5:6", 4
        args.pp_batch_size, args.pp_plant = args.batch_size, "microbatches"  # tiny: 2 layers, no interleaving
    doctor_fixes.LAB_PREFIX = args.lab_prefix or doctor_fixes.LAB_PREFIX
    a, _, b = args.profile.partition(":")
    window = (int(a), int(b or a))
    causes = [c for c in (args.causes.split(",") if args.causes else ALL) if c]
    unknown = [c for c in causes if c not in ALL]
    if unknown:
        ap.error(f"unknown cause(s) {unknown}: choose from {', '.join(ALL)}")
    if "link" in causes and not args.lab:
        if args.causes:
            ap.error("the link cause needs --lab RATE (a shaped link)")
        causes.remove("link")
    workers = 2 * args.nproc_per_node if args.lab else 2
    base = ["--nproc", str(workers), "--preset", args.preset, "--steps", str(args.steps),
            f"--data.seq_len={args.seq_len}", f"--data.batch_size={args.batch_size}", "--train.val_interval=0",
            "--train.val_batches=1", "--ckpt.interval=0", f"--profile.steps={args.profile}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from syncwise.lab import cluster as lab_cluster
    lab_up = []  # the lab, brought up before the first run that trains (--reuse may train none)

    def run(name: str, flags: list[str], rate: str | None = None) -> Path:
        if args.reuse and (out / name / "summary.json").exists():
            return out / name
        if args.lab:
            if not lab_up:
                lab_cluster.up(2, args.lab, procs_per_node=args.nproc_per_node, prefix=doctor_fixes.LAB_PREFIX)
                lab_up.append(True)
            lab_cluster.shape(inter_node=rate or args.lab, prefix=doctor_fixes.LAB_PREFIX)
        doctor_fixes.train(out / name, base + flags, args.lab, out / f"{name}.log", args.nproc_per_node)
        return out / name

    rows, t_all = [], time.time()
    plain: dict[int, Path] = {}  # the plain job (no flag added): the no-cause run of several rows, run once

    def plain_run(i: int) -> Path:
        if i not in plain:
            plain[i] = run(f"plain-{i}", [])
        return plain[i]

    try:
        quarter_mb = 5.0
        if set(causes) & {"buckets_too_small", "buckets_too_large", "link"}:  # a quarter of the gradients, from the plain job's params
            params = load_run(plain_run(0)).summary.get("params")
            if isinstance(params, (int, float)) and params > 0:
                quarter_mb = round(max(4.0 * params / 2**20 / 4, 0.05), 2)
        for cause in causes:
            t0 = time.time()
            plant, without = pairs(args, quarter_mb)[cause]
            with_dirs, without_dirs = [], []
            fast = cause == "pipeline_bubble" and args.pp_plant == "interleave"  # both at the fast rate
            for i in range(args.repeat):
                sfx = f"-{i}" if i else ""
                if not without:
                    without_dirs.append(plain_run(i))
                else:
                    without_dirs.append(run(f"{cause}-without{sfx}", without,
                                            rate=args.fast_rate if cause == "link" or fast else None))
                with_dirs.append(run(f"{cause}-with{sfx}", plant, rate=args.fast_rate if fast else None))
            row = measure(cause, plant, without, with_dirs, without_dirs, window, args)
            row["seconds"] = time.time() - t0
            rows.append(row)
            ratio = f" (trace/step {row['ratio']:.2f})" if row["ratio"] is not None else ""
            print(f"{cause}: the trace names {row['named_causes']}; trace {row['trace_added_ms']:+,.1f} ms, step "
                  f"{row['step_added_ms']:+,.1f} ms{ratio}", flush=True)
    finally:
        if lab_up:
            lab_cluster.down(doctor_fixes.LAB_PREFIX)
    print_table(rows, args)
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "machine": "shared: 2 CPU cores used by several sessions at once; each row's runs are paired (back to "
                         "back), absolute times are not a speed claim",
              "smoke": args.smoke, "preset": args.preset, "steps": args.steps, "profile_steps": args.profile,
              "seq_len": args.seq_len, "batch_size": args.batch_size, "pp_batch_size": args.pp_batch_size,
              "pp_plant": args.pp_plant,
              "workers": workers, "lab_rate": args.lab,
              "fast_rate": args.fast_rate if args.lab else None, "repeat": args.repeat,
              "tolerance": args.tolerance, "cause_parts": {c: list(CAUSE_PARTS[c]) for c in causes},
              "named_first": sum(r["named_first"] for r in rows), "named": sum(r["named"] for r in rows),
              "within_tolerance": sum(bool(r["within_tolerance"]) for r in rows), "rows_total": len(rows),
              "seconds": time.time() - t_all, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.json}")
    return 0


def measure(cause: str, plant: list[str], without: list[str], with_dirs: list[Path], without_dirs: list[Path],
            window: tuple[int, int], args: argparse.Namespace) -> dict:
    """One row: per pair the trace's and the step timer's added ms; medians over the pairs."""
    pairs_out = []
    for w, wo in zip(with_dirs, without_dirs):
        dw, dwo = diagnose(load_run(w), predict=False), diagnose(load_run(wo), predict=False)
        if dw.trace is None or dwo.trace is None:
            raise SystemExit(f"no trace in {w if dw.trace is None else wo}: was --profile.steps={args.profile} inside "
                             f"the {args.steps} steps?")
        sw, times_w = step_ms(w, window)
        swo, times_wo = step_ms(wo, window)
        pw, pwo = step_ms(w, window, profiled=True)[0], step_ms(wo, window, profiled=True)[0]
        named = dw.trace.get("causes") or []
        mine = next((c for c in named if c["cause"] == cause), None)
        pairs_out.append({
            "with": str(w), "without": str(wo),
            "named_causes": [c["cause"] for c in named], "finding": mine,
            "trace_added_ms": added_ms(dw.trace, dwo.trace, cause),
            "step_with_ms": sw, "step_without_ms": swo, "step_added_ms": sw - swo,
            # the same difference over the profiled steps (the trainer's step timer on the steps the trace saw)
            "step_added_profiled_ms": pw - pwo,
            "steps_with_ms": times_w, "steps_without_ms": times_wo,
            "timers_added_ms": timer_part(dw, cause) - timer_part(dwo, cause),
            "timer_top_cause": dw.top.cause if dw.top else None,
            "trace_with": split(dw.trace), "trace_without": split(dwo.trace),
            "parts_added_ms": {k: v - parts(dwo.trace)[k] for k, v in parts(dw.trace).items()
                               if isinstance(v, float) and k != "late_rank"},
        })
    med = lambda k: statistics.median(p[k] for p in pairs_out)  # noqa: E731
    trace_ms, step_added = med("trace_added_ms"), med("step_added_ms")
    first = pairs_out[0]
    ratio = trace_ms / step_added if abs(step_added) > 1e-9 else None
    return {"cause": cause, "planted": plant, "without": without,
            "named_causes": first["named_causes"],
            "named_first": bool(first["named_causes"]) and first["named_causes"][0] == cause,
            "named": cause in first["named_causes"],
            "finding_ms": first["finding"]["ms"] if first["finding"] else None,
            "finding_evidence": first["finding"]["evidence"] if first["finding"] else None,
            "trace_parts": list(CAUSE_PARTS[cause]), "trace_added_ms": trace_ms, "step_added_ms": step_added,
            "step_added_profiled_ms": med("step_added_profiled_ms"),
            "ratio_profiled": (trace_ms / med("step_added_profiled_ms") if abs(med("step_added_profiled_ms")) > 1e-9
                               else None),
            "ratio": ratio, "within_tolerance": ratio is not None and abs(ratio - 1) <= args.tolerance,
            "timers_added_ms": med("timers_added_ms"), "timer_top_cause": first["timer_top_cause"],
            "pairs": pairs_out}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planted causes read from the trace ({args.preset}, {args.steps} steps, profiled "
                        f"{args.profile}{', lab ' + args.lab if args.lab else ', local'})")
    for col in ("cause", "trace names (first …)", "finding ms", "trace +ms", "step +ms", "trace / step",
                "profiled steps +ms (ratio)", "timers +ms", "timers' top"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["cause"], ", ".join(r["named_causes"]) or "-",
                      f"{r['finding_ms']:,.1f}" if r["finding_ms"] is not None else "-",
                      f"{r['trace_added_ms']:,.1f}", f"{r['step_added_ms']:,.1f}",
                      f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
                      f"{r['step_added_profiled_ms']:,.1f}" + (f" ({r['ratio_profiled']:.2f})"
                                                                if r["ratio_profiled"] is not None else ""),
                      f"{r['timers_added_ms']:,.1f}", r["timer_top_cause"] or "-")
    Console(width=160).print(table)


if __name__ == "__main__":
    sys.exit(main())
