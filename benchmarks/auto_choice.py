"""Does ``--compress auto --sync auto`` pick the strategy that reaches fp32 DDP's loss soonest? (issue 28, item 5)

At each lab link rate: resolve auto exactly as ``syncwise train`` does (``syncwise.plan.strategy.resolve_auto``: the
planner's step time on this lab's link × the measured steps to fp32 DDP's loss of ``syncwise/plan/convergence.json``),
then run benchmarks/time_to_loss.py across the lab at that rate with fp32 DDP, auto's pick and the next ``--top``
candidates of its ranking, and compare auto's pick with the best measured in the same run, in time to the target loss.
Goal: within 10 %.

    python benchmarks/auto_choice.py --rates 20mbit,100mbit,1gbit --prefix swau --subnet 10.77.35.0/24 \\
        --preset tiny --steps 300 --cap 600 --json benchmarks/results/auto-choice-lab.json

Writes one JSON with, per rate: the start-up line, the predicted ranking, the time-to-loss rows (and their own
results file) and the verdict. The machine may be shared: every time is measured within one run at one rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from syncwise.errors import ConfigError, SyncwiseError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="20mbit,100mbit,1gbit", help="lab link rates, comma list (tc units)")
    p.add_argument("--prefix", default="swau", help="lab name prefix (default swau)")
    p.add_argument("--subnet", default="10.77.35.0/24", help="lab subnet (when this script brings the lab up)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="workers per lab node (default 1)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300, help="fp32 DDP's steps (time_to_loss --steps)")
    p.add_argument("--cap", type=int, default=600, help="step cap of the others (time_to_loss --cap)")
    p.add_argument("--val-interval", type=int, default=20)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step (data.batch_size)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--top", type=int, default=3, help="candidates of auto's ranking to run beside fp32 DDP (default 3)")
    p.add_argument("--repeats", type=int, default=1, help="time_to_loss rounds (alternating order; default 1)")
    p.add_argument("--probe", type=int, default=0, help="auto's start-up probe (compress.auto_probe steps) as "
                   "`syncwise train` runs it; 0 (default): the catalog's figures")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    if args.top < 1:
        raise ConfigError("--top", args.top, "an integer ≥ 1")

    import os
    os.environ["SYNCWISE_LAB_PREFIX"] = args.prefix   # the lab syncwise's own auto reads (lab.cluster.PREFIX)
    from syncwise import lab
    from syncwise.commands.train import probe as run_probes
    from syncwise.config import auto_ranking, build_config
    from syncwise.lab.cluster import parse_rate
    from syncwise.plan.strategy import load_convergence
    import time_to_loss

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        parse_rate(r, "--rates")
    out_dir = Path(args.out_dir or Path("runs") / time.strftime("auto-choice-%Y%m%d-%H%M%S"))
    table = load_convergence()   # the convergence model, asked at --steps and the lab's replicas
    created = False
    if lab.status(prefix=args.prefix) is None:
        lab.up(args.nodes, rates[0], subnet=args.subnet, prefix=args.prefix)
        created = True
    results = []
    try:
        for rate in rates:
            lab.shape(inter_node=rate, prefix=args.prefix)
            # auto resolved exactly as `syncwise train --lab --compress auto --sync auto` resolves it for this job
            # (config.auto_ranking: the lab's link and bucket, workers sharing this host's cores, the convergence
            # model at the job's steps and replicas)
            cfg = build_config(None, {"dist.lab": "true", "dist.nproc": str(args.nproc), "model.preset": args.preset,
                                      "data.batch_size": str(args.batch_size), "data.seq_len": str(args.seq_len),
                                      "train.steps": str(args.steps), "compress.auto_probe": str(args.probe)})
            cfg.compress.method, cfg.parallel.sync = "auto", "auto"
            lay, line, ranked = auto_ranking(cfg, run_probes if args.probe else None)
            pick = str(lay.sync) if lay.sync is not None else lay.compress.text
            print(f"{rate}: {line}", flush=True)
            cands = [r.spec for r in ranked if not r.why_not]
            run = [s for s in [pick] + cands if s != "none"]
            run = list(dict.fromkeys(run))[:args.top]
            per_rate = Path(args.json).with_name(f"{Path(args.json).stem}-{rate}.json")   # next to the summary
            argv2 = ["--lab", rate, "--lab-prefix", args.prefix, "--nodes", str(args.nodes), "--preset", args.preset,
                     "--nproc", str(args.nproc),
                     "--steps", str(args.steps), "--cap", str(args.cap), "--val-interval", str(args.val_interval),
                     "--val-batches", str(args.val_batches), "--repeats", str(args.repeats), "--configs", ",".join(run), "--peers", "",
                     "--set", f"data.batch_size={args.batch_size}", "--set", f"data.seq_len={args.seq_len}",
                     "--out-dir", str(out_dir / rate), "--json", str(per_rate)]
            if run:
                time_to_loss.main(argv2)
            else:  # auto picked fp32 DDP and no other candidate: run fp32 DDP alone
                time_to_loss.main(argv2[:argv2.index("--configs")] + ["--configs", "none"] + argv2[argv2.index("--peers"):])
            ttl = json.loads(per_rate.read_text())
            measured = {r["name"]: r["time_to_target_s"] for r in ttl["rows"]}
            reached = {k: v for k, v in measured.items() if v}
            best = min(reached, key=reached.get) if reached else None
            auto_t = measured.get(pick)
            ratio = auto_t / reached[best] if auto_t and best else None
            fp32_t = measured.get("none")
            steps = {r["name"]: r.get("steps_to_target") for r in ttl["rows"]}
            picked = next((r for r in ranked if r.spec == pick), None)
            # the pick's printed "× sooner" against what came: predicted time ratio vs measured (goal ±30 %)
            measured_ratio = auto_t / fp32_t if auto_t and fp32_t else None
            predicted_ratio = picked.time_ratio if picked is not None else None
            # the convergence model's steps against the measured steps, for every strategy that ran
            model_steps = [{"spec": r.spec, "predicted_steps_ratio": r.steps_ratio,
                            "band": [r.steps_low, r.steps_high],
                            "measured_steps_ratio": (steps[r.spec] / steps["none"]
                                                     if steps.get(r.spec) and steps.get("none") else None)}
                           for r in ranked if r.spec in steps and r.spec != "none"]
            results.append({"rate": rate, "line": line, "pick": pick, "predicted": [
                                {"spec": r.spec, "step_time_s": r.step_time_s, "steps_ratio": r.steps_ratio,
                                 "steps_band": [r.steps_low, r.steps_high], "time_ratio": r.time_ratio, "not_a_candidate": r.why_not} for r in ranked],
                            "ran": ["none"] + run, "time_to_target_s": measured, "best_measured": best,
                            "auto_over_best": ratio, "within_10pct": ratio is not None and ratio <= 1.10,
                            "predicted_time_ratio": predicted_ratio, "measured_time_ratio": measured_ratio,
                            "prediction_error": (predicted_ratio / measured_ratio - 1
                                                 if predicted_ratio and measured_ratio else None),
                            "steps_to_target": steps, "convergence_model": model_steps,
                            "time_to_loss_results": str(per_rate), "time_to_loss_command": ttl["command"],
                            "efficiency": {r["name"]: r["parallel_efficiency"] for r in ttl["rows"]}})
            print(f"{rate}: auto picked {pick}; best measured {best}; auto / best = "
                  f"{ratio if ratio is None else round(ratio, 3)}", flush=True)
    finally:
        if created:
            lab.down(prefix=args.prefix)
    out = {"command": "python benchmarks/auto_choice.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "convergence_model": table.source, "machine": "2-core VM shared with other jobs: times are comparable "
           "only within one rate's run", "rates": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, SyncwiseError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
