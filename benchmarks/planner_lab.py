"""The planner against the network lab: `syncwise plan --calibrate --lab` at each link rate, then predicted vs
measured step time of `syncwise train` jobs across the lab (issue 17).

For each rate the script reshapes its own lab's links (2 nodes × 2 workers, prefix `planlab`, subnet
10.78.0.0/24, taken down at the end), calibrates it (`syncwise.plan.calibrate.calibrate(lab=True)`: GEMM
FLOP/s, memory bandwidth, a single-process `small-dense` 8 × 128 reference step on every worker at once —
this sets the compute side, `matmul_efficiency` — and comm-bench's collectives over the link and inside each
node), then runs every configuration of that rate as a real 4-worker training job over the shaped link and
compares its measured steady step time (median of rank 0's steps after the first two) with
`syncwise.plan.predict` on the calibrated CloudConfig. Nothing of the training rows feeds the prediction.

    python benchmarks/planner_lab.py                       # ~10 min on the 2-core VM, quiet machine
    python benchmarks/planner_lab.py --only dp4-none@200mbit --steps 4      # a smoke test of one row
    python benchmarks/planner_lab.py --repredict benchmarks/results/planner-lab-repredict.json  # no jobs: the
                                        # committed rows predicted again by the current cost model
    python benchmarks/planner_lab.py --only fsdp4-none@200mbit,fsdp4-qgZ+qwZ+hpZ@200mbit,fsdp4-bf16@200mbit,\
        hsdp2x2-fp8@200mbit --json benchmarks/results/planner-lab-fsdp-compress.json   # issue 40's four jobs
    python benchmarks/planner_lab.py --json benchmarks/results/planner-lab-heldout.json \
        --against benchmarks/results/fsdp-compress-small-200mbit-partial.json   # no jobs: them, predicted from a
                                        # stored calibration, against fsdp_compress.py's measured steps

Writes benchmarks/results/planner-lab.json (every row, the calibrations, the summary) and prints the table.
Needs root and the lab's tools (ip netns, veth, bridge, tc tbf); the lab's 4 workers share this machine's
2 cores, so run it on a quiet machine: other load changes both the calibration and the rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from syncwise.config import build_config  # noqa: E402
from syncwise.lab import cluster  # noqa: E402
from syncwise.lab.launch import lab_torchrun  # noqa: E402
from syncwise.launch.run import launch  # noqa: E402
from syncwise.plan import Layout, cloud_from_dict, load_model, predict  # noqa: E402
from syncwise.plan.calibrate import (REFERENCE_BATCH, REFERENCE_PRESET, REFERENCE_SEQ, _median,  # noqa: E402
                                     calibrate, recipe_for, solve_efficiency)

PREFIX, SUBNET, NODES, PER_NODE = "planlab", "10.78.0.0/24", 2, 2
WORLD = NODES * PER_NODE
#: the cores of the VM that measured the committed rows (their calibrations predate Accelerator.shared_by)
MEASURED_CORES = 2
SEQ = 128
#: name -> (preset, global batch, parallel fields, compressor, sync)
CONFIGS = {
    "dp4-none": ("small-dense", 32, {}, "none", "every-step"),
    "dp4-bf16": ("small-dense", 32, {}, "bf16", "every-step"),
    "dp4-fp8": ("small-dense", 32, {}, "fp8", "every-step"),
    "dp4-powersgd": ("small-dense", 32, {}, "powersgd:rank=4,start_iter=2", "every-step"),  # compressed from step 3: the timed steps
    "dp4-localsgd4": ("small-dense", 32, {}, "none", "localsgd:period=4"),
    "fsdp4": ("small-dense", 32, {"dp_shard": 4}, "none", "every-step"),
    "dp2xfsdp2": ("small-dense", 32, {"dp_replicate": 2, "dp_shard": 2}, "none", "every-step"),
    "tp2xdp2": ("small-dense", 32, {"tp": 2, "dp_replicate": 2}, "none", "every-step"),
    "pp2xdp2": ("small-dense", 32, {"pp": 2, "dp_replicate": 2, "microbatches": 4}, "none", "every-step"),
    "ep2xdp2": ("small", 32, {"ep": 2}, "none", "every-step"),
    "ep4-bf16": ("small", 32, {"ep": 4, "ep_dispatch": "bf16"}, "none", "every-step"),
    # issue 40's jobs (benchmarks/fsdp_compress.py's rows on `small`, 8 × 128 per worker): fp32 FSDP2, qgZ + qwZ +
    # hpZ (int8 reduce-scatter, hierarchical on 2 × 2; int8 forward gathers; backward's gathers inside the node),
    # PyTorch's bf16 reduce dtype, and HSDP (shards inside a node, replicas across) with fp8 across the replicas
    "fsdp4-none": ("small", 32, {"dp_shard": 4}, "none", "every-step"),
    "fsdp4-qgZ+qwZ+hpZ": ("small", 32, {"dp_shard": 4, "fsdp_gather": "int8", "fsdp_reshard": "node"}, "int8",
                          "every-step"),
    "fsdp4-bf16": ("small", 32, {"dp_shard": 4}, "bf16", "every-step"),
    "hsdp2x2-fp8": ("small", 32, {"dp_replicate": 2, "dp_shard": 2}, "fp8", "every-step"),
}
#: issue 40's rows: what ``--only`` takes to run exactly them (and ``--against`` predicts)
FSDP_COMPRESS_ROWS = ("fsdp4-none@200mbit", "fsdp4-qgZ+qwZ+hpZ@200mbit", "fsdp4-bf16@200mbit", "hsdp2x2-fp8@200mbit")
#: benchmarks/fsdp_compress.py's configuration names (its partial JSON's and its own) → this script's rows
FSDP_COMPRESS_NAMES = {"fp32-fsdp2": "fsdp4-none", "qgZ+qwZ+hpZ": "fsdp4-qgZ+qwZ+hpZ", "qgZ_qwZ_hpZ": "fsdp4-qgZ+qwZ+hpZ",
                       "torch-fsdp2-bf16": "fsdp4-bf16", "hsdp-fp8": "hsdp2x2-fp8"}
#: rows whose measurement is known in advance not to be a timing reference on this machine (FIELD-NOTES.md:
#: "FSDP2's reduce-scatter on gloo is emulated (pytorch PR 149869): correct, not a timing reference"); shown and
#: counted in the overall error, and also left out of a second mean so the rest can be read on its own
CAVEATS = {"fsdp4": "FSDP2 on gloo: reduce-scatter emulated by PyTorch (all-reduce + slice), not a timing reference",
           "dp2xfsdp2": "FSDP2 on gloo: reduce-scatter emulated by PyTorch (all-reduce + slice), not a timing reference"}
#: rate -> configurations run at it
PLAN = {
    "200mbit": ["dp4-none", "dp4-fp8", "dp4-localsgd4", "fsdp4", "dp2xfsdp2", "tp2xdp2", "pp2xdp2", "ep2xdp2",
                "ep4-bf16", *[r.partition("@")[0] for r in FSDP_COMPRESS_ROWS]],
    "100mbit": ["dp4-none", "dp4-bf16", "dp4-powersgd", "tp2xdp2"],
}


#: dist.hierarchical arrived on 2026-11-24 (commit 164067a): jobs measured before it ran the flat gradient sync
HIERARCHICAL_SINCE = "2026-11-24 11:00 UTC"


def layout_of(fields: dict, compress: str, sync: str, hierarchical: str = "auto") -> Layout:
    """The planner's Layout of a `syncwise train` [parallel] table (a left-out dp_replicate takes the rest) with
    the job's dist.hierarchical (the default, auto)."""
    f = dict(fields)
    inner = f.get("pp", 1) * f.get("dp_shard", 1) * f.get("tp", 1)
    f.setdefault("dp_replicate", WORLD // inner)
    return Layout(**f, compress=compress, sync=sync, hierarchical=hierarchical)


def run_job(work: Path, name: str, preset: str, batch: int, fields: dict, compress: str, sync: str,
            steps: int) -> dict:
    """One real training job across the lab; its median steady step time (rank 0's metrics.jsonl)."""
    lay = layout_of(fields, compress, sync)
    dp = lay.dp
    run_dir = work / name
    overrides = {"run_dir": str(run_dir), "model.preset": preset, "train.steps": str(steps),
                 "train.val_interval": "0", "train.val_batches": "1", "ckpt.interval": "0", "dist.lab": "true",
                 "dist.nproc": str(PER_NODE), "data.seq_len": str(SEQ),
                 # data.batch_size is sequences per worker per micro-batch (per data-parallel rank: tp ranks share
                 # one); under pp it is the rank's batch and parallel.microbatches splits it
                 "data.batch_size": str(batch // dp), "compress.method": compress, "parallel.sync": sync,
                 **{f"parallel.{k}": str(v) for k, v in fields.items()}}
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(PER_NODE))   # check the job as its workers will
    try:
        cfg = build_config(overrides=overrides)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    run_dir.mkdir(parents=True)
    cfg.save(run_dir / "config.json")
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as quiet:      # node 0's output is in logs/node0.log too
        code = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")],
                            nproc_per_node=PER_NODE, prefix=PREFIX, log_dir=run_dir / "logs", timeout=300,
                            console=quiet)
    wall = time.perf_counter() - t0
    if code != 0 or not (run_dir / "metrics.jsonl").exists():
        log = run_dir / "logs" / "node0.log"
        return {"failed": f"exit code {code}: " + (log.read_text(errors="replace")[-1500:] if log.exists() else "")}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][2:]  # steps 3..: whole local-SGD periods
    summary = json.loads((run_dir / "summary.json").read_text())
    # the mean (not the median): a local-SGD step that averages the replicas is one of every `period` steps
    return {"measured_step_s": statistics.fmean(times), "step_times_s": times, "wall_s": wall,
            "layout_trained": summary.get("layout"), "final_loss": summary.get("final_loss"),
            "comm_exposed_share": summary.get("comm_exposed_share"),
            # the bytes per hop the run counted (rank 0's), beside the planner's priced FSDP2 bytes in the row
            "hop_bytes_per_step_cross": summary.get("hop_bytes_per_step_cross"),
            "hop_bytes_per_step_intra": summary.get("hop_bytes_per_step_intra")}


def stored_clouds(data: dict) -> dict:
    """The calibrated CloudConfig of every rate of a committed planner-lab JSON, as :func:`repredict` uses them:
    matmul_efficiency solved again from the stored reference steps (as `--calibrate` would now), the rest of each
    calibrated cluster kept, and the lab's tbf bucket at the rate and the workers per core (4 on the 2-core VM)
    added where the calibration predates ``burst_kbyte`` and ``shared_by``."""
    clouds = {}
    for rate, cal in data["calibrations"].items():
        cloud = cloud_from_dict(cal["cluster"], f"calibration at {rate}")
        if not cloud.inter_node.burst_bytes:     # calibrations older than burst_kbyte: the lab's bucket at that rate
            burst = cluster.default_burst(cluster.parse_rate(rate, "rate"))
            cloud = dataclasses.replace(cloud, inter_node=dataclasses.replace(cloud.inter_node, burst_bytes=burst))
        acc = dataclasses.replace(cloud.accelerator, matmul_efficiency=1.0)
        if "shared_by" not in cal["cluster"]["accelerator"]:   # older calibrations: 4 workers, 1 thread, 2 cores
            acc = dataclasses.replace(acc, shared_by=WORLD / MEASURED_CORES)
        eff = solve_efficiency(acc, load_model(REFERENCE_PRESET, REFERENCE_SEQ), REFERENCE_BATCH, REFERENCE_SEQ,
                               _median(cal["reference_step_s"]))
        clouds[rate] = dataclasses.replace(cloud, accelerator=dataclasses.replace(acc, matmul_efficiency=eff))
    return clouds


def repredict(path: str, out: str) -> int:
    """Predict every measured row of a committed planner-lab JSON again with the current cost model, from the
    calibration stored beside it (no lab, no jobs; :func:`stored_clouds`); jobs measured before dist.hierarchical
    existed are predicted flat. Writes ``out``."""
    data = json.loads(Path(path).read_text())
    clouds = stored_clouds(data)
    rows = []
    for r in data["rows"]:
        if "measured_step_s" not in r:
            continue
        preset, batch, fields, compress, sync = CONFIGS[r["name"]]
        cloud = clouds[r["rate"]]
        flat = data["calibrations"][r["rate"]].get("measured_at", "") < HIERARCHICAL_SINCE
        pred = predict(cloud, load_model(preset, SEQ), layout_of(fields, compress, sync, "off" if flat else "auto"),
                       batch, SEQ, training=recipe_for(cloud.accelerator), syncwise_rules=True)
        rows.append({"name": r["name"], "rate": r["rate"], "measured_step_s": r["measured_step_s"],
                     "predicted_step_s_committed": r["predicted_step_s"], "error_committed": r["error"],
                     "predicted_step_s": pred.step_time_s, "error": pred.step_time_s / r["measured_step_s"] - 1,
                     "caveat": r.get("caveat"), "predicted_breakdown": pred.breakdown})
        print(f"{r['rate']:8s} {r['name']:14s} measured {r['measured_step_s'] * 1e3:7.0f} ms   committed "
              f"{r['predicted_step_s'] * 1e3:7.0f} ms ({r['error']:+6.1%})   now {pred.step_time_s * 1e3:7.0f} ms "
              f"({rows[-1]['error']:+6.1%})")
    mae = lambda rs, k: sum(abs(x[k]) for x in rs) / len(rs) if rs else None  # noqa: E731
    clean = [x for x in rows if not x["caveat"]]
    summary = {"source": os.path.relpath(path, Path(__file__).resolve().parents[1]), "rows": len(rows),
               "mean_abs_error_committed": mae(rows, "error_committed"),
               "mean_abs_error": mae(rows, "error"), "mean_abs_error_without_caveats_committed":
               mae(clean, "error_committed"), "mean_abs_error_without_caveats": mae(clean, "error"),
               "matmul_efficiency": {rate: c.accelerator.matmul_efficiency for rate, c in clouds.items()}}
    print(json.dumps(summary, indent=2))
    Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def measured_steps(path: str) -> dict:
    """Row name (:data:`FSDP_COMPRESS_ROWS`, without the rate) → measured step time of a benchmarks/fsdp_compress.py
    result: its partial JSON's ``median_step_s`` per configuration, or its own JSON's rows' median (else mean) step
    time."""
    data = json.loads(Path(path).read_text())
    rows = data["rows"]
    items = rows.items() if isinstance(rows, dict) else ((r["name"], r) for r in rows)
    out = {}
    for name, r in items:
        step = r.get("median_step_s") or r.get("median_step_time_s") or r.get("mean_step_time_s")
        if name in FSDP_COMPRESS_NAMES and step:
            out[FSDP_COMPRESS_NAMES[name]] = float(step)
    return out


def against(calibration_json: str, measured_json: str, out: Optional[str], rate: str = "200mbit") -> int:
    """Issue 40's rows predicted from a committed calibration (``calibration_json``'s at ``rate``,
    :func:`stored_clouds`: no lab, no jobs) against the step times benchmarks/fsdp_compress.py measured on the same
    lab shape (``measured_json``). The calibration and the measurement are of different sessions: a check of the
    cost model's structure before the rows are run here against a calibration of their own (``--only``)."""
    data = json.loads(Path(calibration_json).read_text())
    cloud = stored_clouds(data)[rate]
    measured = measured_steps(measured_json)
    rows = []
    for row in FSDP_COMPRESS_ROWS:
        name = row.partition("@")[0]
        preset, batch, fields, compress, sync = CONFIGS[name]
        pred = predict(cloud, load_model(preset, SEQ), layout_of(fields, compress, sync), batch, SEQ,
                       training=recipe_for(cloud.accelerator), syncwise_rules=True)
        got = measured.get(name)
        rows.append({"name": name, "rate": rate, "layout": pred.layout.text(), "predicted_step_s": pred.step_time_s,
                     "measured_step_s": got, "error": pred.step_time_s / got - 1 if got else None,
                     "predicted_breakdown": pred.breakdown, "predicted_dominant": pred.dominant,
                     "fsdp_bytes_per_step": pred.info.get("fsdp_bytes_per_step")})
        print(f"{rate:8s} {name:20s} predicted {pred.step_time_s * 1e3:7.0f} ms   measured "
              + (f"{got * 1e3:7.0f} ms   error {rows[-1]['error']:+6.1%}" if got else "      -"), flush=True)
    ok = [r for r in rows if r["error"] is not None]
    summary = {"calibration": os.path.relpath(calibration_json, Path(__file__).resolve().parents[1]),
               "calibration_measured_at": data["calibrations"][rate].get("measured_at"),
               "measured": os.path.relpath(measured_json, Path(__file__).resolve().parents[1]),
               "mean_abs_error": sum(abs(r["error"]) for r in ok) / len(ok) if ok else None,
               "max_abs_error": max((abs(r["error"]) for r in ok), default=None)}
    print(json.dumps(summary, indent=2))
    if out:
        Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="training steps per job (the first two are not timed; "
                   "10 leaves 8, two whole periods of localsgd:period=4)")
    p.add_argument("--only", default=None, help="comma list of NAME@RATE rows to run (default: every row)")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "planner-lab.json"))
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    p.add_argument("--repredict", metavar="OUT", default=None,
                   help="no lab, no jobs: predict the measured rows of --json again with the current cost model "
                        "from its stored calibrations and write OUT (e.g. benchmarks/results/planner-lab-repredict.json)")
    p.add_argument("--against", metavar="MEASURED", default=None,
                   help="no lab, no jobs: predict issue 40's rows (fsdp4-none, fsdp4-qgZ+qwZ+hpZ, fsdp4-bf16, "
                        "hsdp2x2-fp8 at 200mbit) from --json's stored calibration and compare them with the step times "
                        "of a benchmarks/fsdp_compress.py result MEASURED; --out writes the rows")
    p.add_argument("--out", default=None, help="with --against: the JSON to write")
    a = p.parse_args()
    if a.repredict:
        return repredict(a.json, a.repredict)
    if a.against:
        return against(a.json, a.against, a.out)
    plan = {rate: list(names) for rate, names in PLAN.items()}
    if a.only:
        wanted = [x.strip() for x in a.only.split(",") if x.strip()]
        for w in wanted:
            name, _, rate = w.partition("@")
            if name not in CONFIGS or not rate:
                raise SystemExit(f"--only: {w!r} is not NAME@RATE with NAME one of {', '.join(CONFIGS)}")
        plan = {}
        for w in wanted:
            name, _, rate = w.partition("@")
            plan.setdefault(rate, []).append(name)
    work = Path(tempfile.mkdtemp(prefix="syncwise-planner-lab-"))
    rows, calibrations = [], {}
    started = time.perf_counter()
    cluster.up(NODES, next(iter(plan)), procs_per_node=PER_NODE, prefix=PREFIX, subnet=SUBNET)
    try:
        for rate, names in plan.items():
            cluster.shape(inter_node=rate, prefix=PREFIX)
            result = calibrate(lab=True, prefix=PREFIX, nproc=PER_NODE, launcher=launch)
            cloud = cloud_from_dict(result["cluster"], f"calibration at {rate}")
            calibrations[rate] = {"cluster": result["cluster"], "seconds": result["seconds"],
                                  "measured_at": result["measured_at"],
                                  "reference_step_s": [w["reference_step_s"] for w in result["workers"]]}
            training = recipe_for(cloud.accelerator)
            print(f"--- {rate}: calibrated in {result['seconds']:.0f} s: {cloud.describe()}, "
                  f"{cloud.accelerator.peak_bf16_flops / 1e9:.1f} GFLOP/s per worker × efficiency "
                  f"{cloud.accelerator.matmul_efficiency:.2f}, link {cloud.inter_node.effective * 8 / 1e6:.0f} Mbit/s "
                  "achieved", flush=True)
            for name in names:
                preset, batch, fields, compress, sync = CONFIGS[name]
                lay = layout_of(fields, compress, sync)
                model = load_model(preset, SEQ)
                pred = predict(cloud, model, lay, batch, SEQ, training=training, syncwise_rules=True)
                row = {"name": name, "rate": rate, "preset": preset, "global_batch": batch, "seq_len": SEQ,
                       "layout": pred.layout.text(), "runnable": pred.runnable,
                       "predicted_step_s": pred.step_time_s, "predicted_breakdown": pred.breakdown,
                       "predicted_dominant": pred.dominant}
                if "fsdp_bytes_per_step" in pred.info:      # FSDP2's bytes per hop, priced as the run counts them
                    row["predicted_fsdp_bytes_per_step"] = pred.info["fsdp_bytes_per_step"]
                if name in CAVEATS:
                    row["caveat"] = CAVEATS[name]
                row.update(run_job(work / rate, name, preset, batch, fields, compress, sync, a.steps))
                if "measured_step_s" in row:
                    row["error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
                    print(f"{rate:8s} {name:14s} predicted {row['predicted_step_s'] * 1e3:7.0f} ms   measured "
                          f"{row['measured_step_s'] * 1e3:7.0f} ms   error {row['error']:+6.1%}   "
                          f"(dominant: {pred.dominant})", flush=True)
                else:
                    print(f"{rate:8s} {name:14s} FAILED: {row['failed'][-400:]}", flush=True)
                rows.append(row)
    finally:
        cluster.down(prefix=PREFIX)
        if a.keep:
            print(f"run directories: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in rows if "error" in r]
    summary = {"rows": len(rows), "measured": len(ok), "failed": len(rows) - len(ok),
               "mean_abs_error": sum(abs(r["error"]) for r in ok) / len(ok) if ok else None,
               "max_abs_error": max((abs(r["error"]) for r in ok), default=None),
               "mean_error": sum(r["error"] for r in ok) / len(ok) if ok else None,
               "mean_abs_error_without_caveats": (lambda rs: sum(abs(r["error"]) for r in rs) / len(rs) if rs else None)(
                   [r for r in ok if "caveat" not in r]),
               "caveats": CAVEATS,
               "steps": a.steps, "wall_s": time.perf_counter() - started, "nodes": NODES, "procs_per_node": PER_NODE,
               "compute_from": "each rate's calibration: GEMM microbenchmark (peak, GEMM-size efficiency) and a "
                               "single-process small-dense 8x128 reference step (matmul_efficiency), all workers "
                               "at once; comm from the calibration's comm-bench"}
    print(f"\n{'rate':8s} {'config':14s} {'layout':58s} {'predicted':>10s} {'measured':>10s} {'error':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['rate']:8s} {r['name']:14s} {r['layout'][:58]:58s} {r['predicted_step_s'] * 1e3:8.0f}ms "
                  f"{r['measured_step_s'] * 1e3:8.0f}ms {r['error']:+7.1%}{'  (*)' if 'caveat' in r else ''}")
        else:
            print(f"{r['rate']:8s} {r['name']:14s} FAILED")
    print(json.dumps(summary, indent=2))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"summary": summary, "calibrations": calibrations, "rows": rows}, indent=2)
                            + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
