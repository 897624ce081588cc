"""The train step's own host cost: OptimizedTrainer on a model so small that a step is almost all trainer code.

One process, no process group, fp32, a 2-layer MLP on 8 rows: what is left of a step is the loop itself (the
meter, the hooks, the optimizer call). With ``--compare SRC_A SRC_B`` the same measurement runs in fresh
interpreters with ``PYTHONPATH`` set to each of two syncwise source trees, alternating A B A B ... so a shared
machine's load drifts over both alike; the result is the median over rounds of each round's B/A ratio.

    python benchmarks/step_overhead.py --compare /path/to/old/src src [--rounds 8] [--steps 400]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WARMUP = 20


def measure(steps: int) -> float:
    """Median step time (s) of ``steps`` optimizer steps of a tiny MLP under OptimizedTrainer."""
    import torch
    from torch import nn

    from syncwise.train import OptimizedTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    batch = (x, x[:, :4].argmax(1))
    trainer = OptimizedTrainer(model, opt, nn.functional.cross_entropy, mixed_precision=False,
                               show_progress=False, preempt_grace_s=None)
    times: list[float] = []
    original = trainer._train_step

    def timed(batches):
        result = original(batches)
        times.append(result.step_time_s)
        return result

    trainer._train_step = timed

    def forever():
        while True:
            yield batch

    trainer.train(forever(), steps=steps)
    return statistics.median(times[WARMUP:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs=2, metavar=("SRC_A", "SRC_B"), help="two syncwise src/ trees")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--labels", nargs=2, default=("A", "B"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_overhead.json"))
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one measurement, printed
    a = p.parse_args()
    if a.measure or not a.compare:
        print(json.dumps({"median_step_s": measure(a.steps)}))
        return
    medians: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for key, src in zip("AB", a.compare):
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, __file__, "--measure", "--steps", str(a.steps)], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            medians[key].append(json.loads(out)["median_step_s"])
        print(f"round {r + 1}/{a.rounds}: {a.labels[0]} {medians['A'][-1] * 1e6:.0f} µs, "
              f"{a.labels[1]} {medians['B'][-1] * 1e6:.0f} µs", flush=True)
    paired = statistics.median(b / x for x, b in zip(medians["A"], medians["B"]))
    result = {"steps": a.steps, "rounds": a.rounds, "labels": list(a.labels), "sources": list(a.compare),
              "median_step_s": {a.labels[0]: statistics.median(medians["A"]),
                                a.labels[1]: statistics.median(medians["B"])},
              "round_medians_s": {a.labels[0]: medians["A"], a.labels[1]: medians["B"]},
              "paired_ratio_b_over_a": paired}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_step_s", "paired_ratio_b_over_a")}, indent=2))


if __name__ == "__main__":
    main()
