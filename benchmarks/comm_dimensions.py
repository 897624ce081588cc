"""Communication per parallel dimension over the network lab (issue 28 item 2): for each layout, the bytes, the
seconds and the exposed share of its dimension, at two link rates, interleaved in one run.

Each (repeat, rate, layout) is one 2-rank job, one rank per lab node (`syncwise.commands.worker` under
`lab_torchrun`), so every collective crosses the shaped link. Reported per job from its summary.json: the steady
step time, and per dimension `comm_bytes_per_step_<dim>`, `comm_s_per_step_<dim>`, `comm_exposed_share_<dim>`
(rank 0) and `job_comm_bytes_per_step_<dim>` (every rank's). The rates alternate job by job, so a load change on
this shared machine falls on both; compare the rates' ratios, not absolute times.

    python benchmarks/comm_dimensions.py [--rates 20mbit,200mbit] [--repeats 2] [--prefix swdm]

Needs root and the lab's tools. Uses only its own lab prefix and subnet, and takes that lab down at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from syncwise.commands.train import prepare_run_dir
from syncwise.config import config_from_argv
from syncwise.lab import cluster as lab
from syncwise.lab.launch import lab_torchrun

LAYOUTS = {"ddp": ("tiny", {"dp_replicate": 2}, "dp"), "fsdp2": ("tiny", {"dp_shard": 2}, "fsdp"),
           "tp": ("tiny", {"tp": 2}, "tp"), "pp": ("tiny", {"pp": 2, "microbatches": 2}, "pp"),
           "ep-fp32": ("tiny-moe", {"ep": 2, "ep_dispatch": "fp32"}, "ep"),
           "ep-fp8": ("tiny-moe", {"ep": 2, "ep_dispatch": "fp8"}, "ep")}
KEYS = ("comm_bytes_per_step", "comm_s_per_step", "comm_exposed_share", "job_comm_bytes_per_step")


def run_one(tmp: Path, name: str, steps: int, prefix: str) -> dict:
    preset, layout, dim = LAYOUTS[name]
    run_dir = tmp / name
    argv = ["--preset", preset, "--steps", str(steps), "--data.seq_len=64", "--train.val_interval=0",
            "--train.val_batches=1", "--ckpt.interval=0", "--run-dir", str(run_dir), "--dist.lab=true",
            "--dist.nproc=1", *[f"--parallel.{k}={v}" for k, v in layout.items()]]
    prepare_run_dir(config_from_argv(argv)).release()
    rc = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")],
                      log_dir=tmp / f"logs-{name}", timeout=300, prefix=prefix)
    if rc != 0:
        return {"failed": (tmp / f"logs-{name}" / "node1.log").read_text()[-1500:]}
    s = json.loads((run_dir / "summary.json").read_text())
    out = {"dimension": dim, "mean_step_time_s": s["mean_step_time_s"], "comm_exposed_share": s["comm_exposed_share"]}
    for d in ("dp", "fsdp", "tp", "pp", "ep"):
        for k in KEYS:
            if f"{k}_{d}" in s:
                out[f"{k}_{d}"] = s[f"{k}_{d}"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="20mbit,200mbit")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--prefix", default="swdm")
    p.add_argument("--subnet", default="10.77.33.0/24")
    p.add_argument("--out", default="benchmarks/results/comm_dimensions.json")
    args = p.parse_args()
    rates, names = args.rates.split(","), args.layouts.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SYNCWISE_LAB_DIR"] = str(Path(tmp) / "state")
        try:
            lab.up(2, rates[0], subnet=args.subnet, prefix=args.prefix)
            for rep in range(args.repeats):
                for name in names:
                    for rate in (rates if rep % 2 == 0 else rates[::-1]):  # interleaved, order alternating
                        lab.shape(inter_node=rate, prefix=args.prefix)
                        r = run_one(Path(tmp) / f"{rep}-{rate}", name, args.steps, args.prefix)
                        rows.append({"layout": name, "rate": rate, "repeat": rep, **r})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            lab.down(args.prefix)
    result = {"what": "per-dimension bytes, seconds and exposed share, 2 lab nodes (one rank each), tiny presets",
              "command": "python " + " ".join(sys.argv), "machine": "shared: 2 CPU cores used by 6 sessions at "
              "once; compare rates within a layout, not absolute times", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
