"""Parallel layouts across the network lab: 2 nodes × 2 ranks, tensor parallel inside a node, data parallel
across, at two link rates, side by side in one run (issue 15); expert and pipeline parallel layouts of a MoE preset
and the expert dispatch precision (issue 16: --preset small --layouts dp4,fsdp4,ep2×dp2,pp2×dp2,pp2×ep2,ep4-fp32,
ep4-bf16,ep4-fp8).

Each (rate, layout) is one `syncwise train --lab --nproc 2` job (4 ranks: ranks 0-1 on node 0, 2-3 on node 1;
`tp` is the innermost mesh dimension, so a tp group never crosses the shaped link). Reported per job: the
steady step time (the trainer's summary) at one global batch for every layout (--global-batch sequences:
data.batch_size is per data-parallel rank, so tp layouts read twice as many per rank), the bytes that crossed the inter-node link (the lab's tbf egress
counters of both nodes, read from the kernel before and after: every collective included, FSDP2's and
DTensor's too), rank 0's bytes per parallel dimension (metrics.jsonl: comm_bytes_dp / _tp / _pp / _ep), the
measured pipeline bubble, peak memory, and the final loss.

    syncwise cluster down; python benchmarks/lab_layouts.py [--rates 100mbit,1gbit] [--steps 20]

Needs root and the lab's tools (ip netns, veth, bridge, tc tbf). The lab's nodes share this machine's cores, so
step times compare layouts with each other at one rate, not with a real cluster (docs/network-lab.md).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from syncwise import lab

LAYOUTS = {"dp4": {}, "fsdp4": {"dp_shard": 4}, "tp2×dp2": {"tp": 2, "dp_replicate": 2},
           "tp2×fsdp2": {"tp": 2, "dp_shard": 2},
           # issue 16 (MoE presets): ep borrows data-parallel ranks; ep2 stays inside a node, ep4 crosses the link
           "ep2×dp2": {"ep": 2}, "ep4-fp32": {"ep": 4, "ep_dispatch": "fp32"},
           "ep4-bf16": {"ep": 4, "ep_dispatch": "bf16"}, "ep4-fp8": {"ep": 4, "ep_dispatch": "fp8"},
           "pp2×dp2": {"pp": 2}, "pp2×ep2": {"pp": 2, "ep": 2}}
DIMS = ("dp", "tp", "pp", "ep")


def _link_bytes(state) -> int:
    """Bytes the nodes have sent into the shaped inter-node link so far (tbf egress counters)."""
    return sum(d.get("egress", {}).get("bytes", 0) for d in lab.qdisc_stats(state).values())


def run_one(out: Path, preset: str, steps: int, layout: dict, extra: list[str], global_batch: int) -> dict:
    state = lab.require()
    # The same global batch for every layout: data.batch_size is per data-parallel rank, and tp ranks share one.
    dp = 4 // (layout.get("tp", 1) * layout.get("pp", 1))
    before = _link_bytes(state)
    argv = [sys.executable, "-m", "syncwise.cli", "train", "--lab", "--nproc", "2", "--preset", preset,
            "--steps", str(steps), "--run-dir", str(out), "--train.val_interval=0", "--train.val_batches=1",
            "--ckpt.interval=0", f"--data.batch_size={global_batch // dp}",
            *[f"--parallel.{k}={v}" for k, v in layout.items()], *extra]
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"failed": (proc.stderr or proc.stdout)[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    rows = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    steady = rows[len(rows) // 5:] or rows  # rank 0's rows; the first steps include set-up

    def mean(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {"bytes_per_dim_rank0": {d: mean(f"comm_bytes_{d}") for d in DIMS if mean(f"comm_bytes_{d}") is not None},
            "pp_bubble_rank0": mean("pp_bubble"),"batch_per_dp_rank": global_batch // dp, "step_s": summary["mean_step_time_s"], "link_bytes_per_step": (_link_bytes(state) - before) / steps,
            "syncwise_dp_bytes_per_step": summary["comm_bytes_per_step"],
            "comm_exposed_share": summary["comm_exposed_share"], "final_loss": summary["final_loss"],
            "layout": summary["layout"], "peak_mem_mb": summary["peak_mem_mb"], "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--preset", default="small-dense")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step over all data-parallel ranks")
    p.add_argument("--set", action="append", default=[], help="extra train flag, e.g. --set=--data.batch_size=16")
    p.add_argument("--out-dir", default="runs/lab-layouts")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "lab-layouts.json"))
    a = p.parse_args()
    rows = []
    out = Path(a.out_dir)
    for rate in a.rates.split(","):
        lab.up(2, rate, procs_per_node=2)
        try:
            for name in a.layouts.split(","):
                r = run_one(out / rate / name, a.preset, a.steps, LAYOUTS[name], a.set, a.global_batch)
                rows.append({"rate": rate, "layout_name": name, **r})
                if "failed" in r:
                    print(f"{rate:8s} {name:10s} FAILED: {r['failed'][-300:]}", flush=True)
                    continue
                dims = " ".join(f"{d} {v / 2**20:.1f}" for d, v in r["bytes_per_dim_rank0"].items())
                print(f"{rate:8s} {name:10s} step {r['step_s'] * 1e3:8.0f} ms   link {r['link_bytes_per_step'] / 2**20:7.1f}"
                      f" MiB/step   rank 0 MiB/step: {dims}   peak {r['peak_mem_mb']:.0f} MB"
                      f"   loss {r['final_loss']:.4f}", flush=True)
        finally:
            lab.down()
    for rate in a.rates.split(","):
        base = next((r for r in rows if r["rate"] == rate and r["layout_name"] == "dp4" and "step_s" in r), None)
        for r in rows:
            if r["rate"] == rate and base and "step_s" in r:
                r["step_vs_dp4"] = r["step_s"] / base["step_s"]
                r["link_bytes_vs_dp4"] = r["link_bytes_per_step"] / base["link_bytes_per_step"]
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"preset": a.preset, "steps": a.steps, "nodes": 2, "procs_per_node": 2,
                                        "global_batch": a.global_batch,
                                        "extra": a.set, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
