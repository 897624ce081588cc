"""Where a 2-node `syncwise train` step goes as the link slows: compute / exposed comm / data wait.

Brings up its own 2-node network lab (prefix `splitlab`, taken down at the end), then for each bandwidth
reshapes the links and runs the same training job (same seed, steps, model) across both nodes, one worker
per node. Prints the step-time split per bandwidth and writes JSON.

    python benchmarks/lab_train_split.py --bandwidths 1gbit,100mbit --steps 30
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from syncwise.config import build_config
from syncwise.lab import cluster
from syncwise.lab.launch import lab_torchrun

PREFIX = "splitlab"


def run_at(bandwidth: str, steps: int, preset: str, work: Path) -> dict:
    cluster.shape(inter_node=bandwidth, prefix=PREFIX)
    run_dir = work / bandwidth
    cfg = build_config(overrides={"run_dir": str(run_dir), "model.preset": preset, "train.steps": str(steps),
                                  "train.val_interval": "0", "ckpt.interval": "0", "dist.lab": "true"})
    run_dir.mkdir(parents=True)
    cfg.save(run_dir / "config.json")
    code = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")], nproc_per_node=1,
                        prefix=PREFIX, log_dir=run_dir / "logs")
    if code != 0:
        raise SystemExit(f"lab run at {bandwidth} failed with exit code {code}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"bandwidth": bandwidth, "mean_step_time_s": summary["mean_step_time_s"],
            "compute_share": summary["compute_share"], "comm_exposed_share": summary["comm_exposed_share"],
            "data_wait_share": summary["data_wait_share"], "comm_bytes_per_step": summary["comm_bytes_per_step"],
            "final_loss": summary["final_loss"], "world_size": summary["world_size"], "preset": preset,
            "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidths", default="1gbit,100mbit")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preset", default="small")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "lab-train-split.json"))
    a = p.parse_args()
    rates = a.bandwidths.split(",")
    work = Path(tempfile.mkdtemp(prefix="syncwise-split-"))
    cluster.up(2, rates[0], prefix=PREFIX)
    try:
        rows = [run_at(rate, a.steps, a.preset, work) for rate in rates]
    finally:
        cluster.down(prefix=PREFIX)
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"2-node syncwise train ({a.preset}, {a.steps} steps, 1 worker per node)")
    for col in ("link", "step (s)", "compute", "exposed comm", "data wait", "MB/step"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["bandwidth"], f"{r['mean_step_time_s']:.3f}", f"{r['compute_share']:.0%}",
                      f"{r['comm_exposed_share']:.0%}", f"{r['data_wait_share']:.1%}",
                      f"{r['comm_bytes_per_step'] / 1e6:.1f}")
    Console().print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
