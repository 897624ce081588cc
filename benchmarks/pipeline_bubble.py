"""The measured pipeline bubble of every schedule at pp 2 and pp 4 with M = 4, 8, 16 microbatches, against theory
(issue 16).

Each (pp, schedule) is one gloo job of pp processes (torchrun's agent, `syncwise.launch.run_local`) training a dense
DeepSeek model of 8 layers through `syncwise.parallel.AsyncPipeline` (one stage per rank; interleaved schedules two).
A rank's bubble is `AsyncPipeline.last_bubble`: 1 − (its stages' forward/backward/loss compute time ÷ the step's wall
time), averaged over the steps after the first (which includes torch's set-up) and over the ranks. Theory:
(p − 1)/(m + p − 1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021), (p − 1)/(v·m + p − 1) for
v stages per rank interleaved (Narayanan et al. 2021, §2.2.2). Zero-bubble schedules have no closed form here
(theory left empty): they fill the bubble with split weight-gradient work when backward-input and backward-weight
costs allow (Qi et al. 2024).

    python benchmarks/pipeline_bubble.py [--pp 2,4] [--microbatches 4,8,16] [--steps 4]

On this machine the pp 4 jobs run 4 processes on 2 cores: a rank also waits for a core, not only for its
neighbours, and Python's schedule overhead is a large share of a small stage's time, so the measured bubble sits
above theory; compare schedules with each other at one (pp, M), and the trend with M.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from syncwise.launch import run_local

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "looped-bfs": 2, "interleaved-zb": 2, "zbv": 2,
             "dualpipev": 2}  # name -> stages per rank


def _worker(pp: int, schedule: str, per_rank: int, microbatches: list[int], steps: int, d_model: int,
            seq: int, mb_rows: int) -> dict:
    import torch.distributed as dist

    from syncwise.models import build_model
    from syncwise.parallel.pipeline import AsyncPipeline, check_pipeline

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    out = {}
    for m in microbatches:
        try:
            check_pipeline(8, pp, schedule, m, per_rank)
        except Exception as e:  # noqa: BLE001 - a schedule's own rule (e.g. 1f1b needs M >= pp): reported as such
            out[m] = {"refused": str(e)}
            continue
        model = build_model("small-dense", n_layers=8, d_model=d_model, n_heads=4, ffn_hidden=4 * d_model,
                            seq_len=seq, vocab_size=256)
        pipe = AsyncPipeline(pp * per_rank, schedule=schedule, microbatches=m)
        pipe.partition_model(model)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        bubbles, times = [], []
        for step in range(steps + 1):
            data = torch.randint(0, 256, (m * mb_rows, seq + 1), generator=g)
            opt.zero_grad()
            pipe.step(data[:, :-1], data[:, 1:])
            opt.step()
            if step:  # the first step includes torch's P2P set-up and shape inference
                bubbles.append(pipe.last_bubble)
                times.append(pipe.last_step_s)
        out[m] = {"bubble": sum(bubbles) / len(bubbles), "step_s": sum(times) / len(times),
                  "p2p_bytes": pipe.last_p2p_bytes}
    dist.destroy_process_group()
    return out


def theory(pp: int, m: int, per_rank: int, schedule: str):
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return (pp - 1) / (per_rank * m + pp - 1)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", default="2,4")
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mb-rows", type=int, default=2, help="rows per microbatch")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline-bubble.json"))
    a = p.parse_args()
    ms = [int(x) for x in a.microbatches.split(",")]
    rows = []
    print(f"{'pp':>3s} {'schedule':18s} {'M':>3s} {'bubble':>7s} {'theory':>7s} {'step s':>7s}")
    for pp in [int(x) for x in a.pp.split(",")]:
        for schedule in a.schedules.split(","):
            per_rank = SCHEDULES[schedule]
            t = time.perf_counter()
            per = run_local(_worker, pp, pp, schedule, per_rank, ms, a.steps, a.d_model, a.seq, a.mb_rows)
            for m in ms:
                ranks = [r[m] for r in per.values()]
                if "refused" in ranks[0]:
                    rows.append({"pp": pp, "schedule": schedule, "microbatches": m, "refused": ranks[0]["refused"]})
                    print(f"{pp:3d} {schedule:18s} {m:3d}  refused: {ranks[0]['refused'][:90]}")
                    continue
                bubble = sum(r["bubble"] for r in ranks) / len(ranks)
                th = theory(pp, m, per_rank, schedule)
                step_s = max(r["step_s"] for r in ranks)
                rows.append({"pp": pp, "schedule": schedule, "stages_per_rank": per_rank, "microbatches": m,
                             "bubble": bubble, "bubble_per_rank": [r["bubble"] for r in ranks], "theory": th,
                             "step_s": step_s, "p2p_bytes_per_rank": [r["p2p_bytes"] for r in ranks]})
                print(f"{pp:3d} {schedule:18s} {m:3d} {bubble:7.3f} {th if th is not None else float('nan'):7.3f}"
                      f" {step_s:7.3f}", flush=True)
            print(f"    ({time.perf_counter() - t:.0f} s)", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": f"dense, 8 layers, d_model {a.d_model}, seq {a.seq}",
                                       "rows_per_microbatch": a.mb_rows, "steps": a.steps,
                                       "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
