"""The planner's communication and codec terms against what lab runs measured (issue 28 items 1, 4 and 5).

For each strategy of an ``benchmarks/auto_choice.py`` run (its ``--out-dir``: one folder per rate, one training run
per strategy), compares the mean measured ``comm_exposed_s`` + ``compress_s`` of rank 0's steps (after the first
20) with the planner's ``dp_comm_exposed`` + ``compress_compute`` for the same job (2 lab nodes × 1 worker, the
catalog's CPU-lab worker, the lab's rate) — with the lab's tbf bucket modelled (``Fabric.burst_bytes``) and
without, with the measured codec cost (``Accelerator.codec_cost``) and without. Compute is left out: it moves
20-30 % between runs on the shared VM and is the same term for every strategy.

    python benchmarks/comm_model_check.py /tmp/t29/auto [/tmp/t28/auto ...] --json benchmarks/results/comm-model-check.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RATES = {"20mbit": 20e6, "100mbit": 100e6, "1gbit": 1e9}


def measured(metrics: Path, skip: int = 20) -> tuple[float, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time_s" in r][skip:]
    # means, not medians: a local-step strategy's outer sync lands on one step in H
    return (statistics.mean(r.get("comm_exposed_s", 0.0) for r in steps),
            statistics.mean(r.get("compress_s", 0.0) for r in steps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="auto_choice.py --out-dir folders")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from syncwise.lab.cluster import default_burst
    from syncwise.plan import Layout, load_model, predict
    from syncwise.layout import EVERY_STEP
    from syncwise.plan.strategy import job_cloud

    model = load_model(args.preset, args.seq_len)
    variants = {"burst+codec": (True, True), "burst": (True, False), "codec": (False, True), "neither": (False, False)}
    rows = []
    for run in args.runs:
        for rate, bps in RATES.items():
            for metrics in sorted(Path(run, rate).glob("round*/*/metrics.jsonl")):
                name = metrics.parent.name
                if name == "compute-only":
                    continue
                cfg = json.loads((metrics.parent / "config.json").read_text())   # what the run itself trained
                comp, sync = cfg["compress"]["method"], cfg["parallel"]["sync"]
                spec = sync if comp == "none" and sync != EVERY_STEP else comp
                comm, codec = measured(metrics)
                row = {"run": run, "rate": rate, "strategy": spec, "measured_ms": 1e3 * (comm + codec),
                       "measured_comm_ms": 1e3 * comm, "measured_codec_ms": 1e3 * codec}
                for label, (burst, cal) in variants.items():
                    cloud = job_cloud(2, 1, bps, burst_bytes=default_burst(int(bps)) if burst else 0.0)
                    if not cal:
                        cloud = dataclasses.replace(cloud, accelerator=dataclasses.replace(cloud.accelerator,
                                                                                           codec_cost=()))
                    lay = Layout(dp_replicate=2, compress=comp, sync=None if sync == EVERY_STEP else sync,
                                 micro_batch=args.batch_size)
                    b = predict(cloud, model, lay, 2 * args.batch_size, args.seq_len).breakdown
                    row[label + "_ms"] = 1e3 * (b["dp_comm_exposed"] + b["sync_exposed"] + b["compress_compute"])
                rows.append(row)
    print(f"{'rate':8s} {'strategy':20s} {'measured':>9s} " + " ".join(f"{v:>12s}" for v in variants))
    for r in rows:
        print(f"{r['rate']:8s} {r['strategy']:20s} {r['measured_ms']:9.1f} "
              + " ".join(f"{r[v + '_ms']:12.1f}" for v in variants))
    summary = {}
    for v in variants:
        err = [abs(r[v + "_ms"] - r["measured_ms"]) for r in rows]
        summary[v] = {"mean_abs_error_ms": statistics.mean(err) if err else None,
                      "by_rate_ms": {rate: statistics.mean([abs(r[v + "_ms"] - r["measured_ms"]) for r in rows
                                                            if r["rate"] == rate] or [0.0]) for rate in RATES}}
        print(f"{v:12s}: mean |predicted - measured| = {summary[v]['mean_abs_error_ms']:.2f} ms per step  ("
              + ", ".join(f"{k} {x:.1f}" for k, x in summary[v]["by_rate_ms"].items()) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/comm_model_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "what": "per-step communication exposed + codec: measured (rank 0 mean) vs the planner's",
            "rows": rows, "summary": summary}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
