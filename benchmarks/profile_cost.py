"""What `--profile.*` costs: steps recorded by torch.profiler against steps that are not, and a run with the
profiler off against one with it on (the steps it does not record: the idle profiler's cost).

Same model, data and steps, 2 local workers over gloo (OptimizedTrainer, as trainer_tax.py); per round three
runs back to back: profiling off, ``profile_every=N`` (one step in N recorded, the step before it a warm-up step),
off again. Reports, as medians over rounds:

- ``recorded_ratio``: recorded steps / plain steps of the same run (what a recorded step costs);
- ``idle_ratio``: the profiled run's plain steps (neither recorded nor warm-up) / the off runs' steps (the idle
  profiler's per-op flag test: expected 1.00);
- ``export_s_per_trace``: the profiled run's wall time beyond the off runs', per trace written (the JSON export
  and syncwise's rewrite of it, between steps).

    python benchmarks/profile_cost.py [--preset small] [--steps 40] [--every 4] [--rounds 3] [--out FILE]

Do not quote figures from a busy machine: run it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from syncwise.data import TokenBatchLoader, load_corpus
from syncwise.launch import run_local
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw, lm_loss

WARMUP = 3


def _worker(every: int, preset: str, steps: int, seq_len: int, batch: int, run_dir: str) -> dict:
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        rank, world = dist.get_rank(), dist.get_world_size()
        corpus = load_corpus("stdlib")
        torch.manual_seed(0)
        model = build_model(preset, vocab_size=corpus.vocab_size, seq_len=seq_len)
        loader = TokenBatchLoader(corpus.train, batch, seq_len, rank, world, seed=0)
        trainer = OptimizedTrainer(model, adamw(model, 1e-3, 0.1), lm_loss, show_progress=False, run_dir=run_dir,
                                   profile_every=every)
        times: list[float] = []
        original = trainer._train_step

        def timed(batches):
            result = original(batches)
            times.append(result.step_time_s)
            return result

        trainer._train_step = timed
        t = time.perf_counter()
        trainer.train(loader, steps=steps)
        return {"times": times, "wall": time.perf_counter() - t}
    finally:
        dist.destroy_process_group()


def _run(every: int, a: argparse.Namespace) -> tuple[list[float], float, int]:
    with tempfile.TemporaryDirectory() as d:
        res = run_local(_worker, a.nproc, every, a.preset, a.steps, a.seq_len, a.batch, str(Path(d) / "run"))
        traces = len(list((Path(d) / "run" / "traces").glob("rank0.*.json"))) if every else 0
    steps = [max(ts) for ts in zip(*(r["times"] for r in res.values()))]  # a step lasts as its slowest rank's
    return steps, max(r["wall"] for r in res.values()), traces


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_cost.json"))
    a = p.parse_args()
    recorded, idle, export = [], [], []
    for r in range(a.rounds):
        off1, wall1, _ = _run(0, a)
        on, wall_on, traces = _run(a.every, a)
        off2, wall2, _ = _run(0, a)
        off = off1[WARMUP:] + off2[WARMUP:]
        numbered = list(enumerate(on, 1))[WARMUP:]
        rec = [t for s, t in numbered if s % a.every == 0]
        plain = [t for s, t in numbered if s % a.every not in (0, a.every - 1)]
        recorded.append(statistics.median(rec) / statistics.median(plain))
        idle.append(statistics.median(plain) / statistics.median(off))
        extra = wall_on - (wall1 + wall2) / 2 - sum(on) + (sum(off1) + sum(off2)) / 2
        export.append(extra / max(traces, 1))
        print(f"round {r + 1}: recorded/plain {recorded[-1]:.2f}, idle profiler {idle[-1]:.3f}, "
              f"export {export[-1] * 1e3:.0f} ms per trace ({traces} traces)", flush=True)
    result = {"preset": a.preset, "nproc": a.nproc, "steps": a.steps, "every": a.every, "rounds": a.rounds,
              "recorded_ratio": statistics.median(recorded), "idle_ratio": statistics.median(idle),
              "export_s_per_trace": statistics.median(export), "torch": torch.__version__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
