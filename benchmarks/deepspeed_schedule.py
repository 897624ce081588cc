"""DeepSpeed's pipeline schedule, simulated: does its "synchronous" 1F1B cost more than a 1F1B, and is a pipeline
with a heavier last stage paced as the planner prices it (issue 41)?

DeepSpeed's ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py; MT-NLG and Megatron-DeepSpeed ran it) runs
2 × (M + S - 1) steps per rank, each a forward or a backward of one micro-batch (the step-to-micro-batch map below
is DeepSpeed's, line for line). A forward step first exchanges with the previous stage (SendGrad of the last
backward, RecvActivation), a backward step with the next (RecvGrad, SendActivation), and those sends block: a step
starts when both ranks of its exchange have finished their previous step. Each rank alternates forward and
backward steps, its neighbours the opposite, so the exchanges pair the stages like a brick wall.

The simulation runs that rule with a forward of F and a backward of B per stage (the last stage's scaled by its
extra work, e.g. the head) and compares the step with

* a 1F1B's, (M + S - 1) × (F + B) for equal stages — what the cost model prices as 1F1B;
* the cost model's pipeline with a busiest stage, τ × (M + S - 1) + (M - 1) × (τ_max - τ) with τ the stages'
  mean (``syncwise.plan.cost``, ``pp_imbalance``).

    python benchmarks/deepspeed_schedule.py      # -> benchmarks/results/deepspeed-schedule.json (pure Python, seconds)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def step_to_micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """DeepSpeed TrainSchedule._step_to_micro_batch: (micro-batch id, is_forward) of ``stage`` at ``step``."""
    even_step, even_stage = step % 2 == 0, stage % 2 == 0
    if even_step and even_stage:
        return step // 2 - stage // 2, True
    if not even_step and not even_stage:
        return (step - 1) // 2 - stage // 2, True
    if even_step and not even_stage:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def simulate(M: int, S: int, fwd: list[float], bwd: list[float]) -> float:
    """The step time of DeepSpeed's TrainSchedule with blocking neighbour exchanges at the start of every step."""
    end = [0.0] * S
    prev = [-1] * S
    for step in range(2 * (M + S - 1)):
        plan = [step_to_micro_batch(step, s, S) for s in range(S)]
        start = []
        for s, (mb, forward) in enumerate(plan):
            valid = 0 <= mb < M or 0 <= prev[s] < M
            partner = (s - 1 if forward else s + 1) if valid else None
            ok = partner is not None and 0 <= partner < S
            start.append(max(end[s], end[partner]) if ok else end[s])
        for s, (mb, forward) in enumerate(plan):
            work = (fwd[s] if forward else bwd[s]) if 0 <= mb < M else 0.0
            end[s] = start[s] + work
            prev[s] = mb
    return max(end)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "deepspeed-schedule.json"))
    a = p.parse_args()
    rows = []
    # MT-NLG's pipelines (35 stages; 240 / 192 / 160 micro-batches), a small one, backward 2× / 3× the forward
    # (3×: full recomputation), the last stage 0 / 9 % heavier (MT-NLG's head makes its last stage ~4 % heavier)
    for M, S in ((240, 35), (192, 35), (160, 35), (8, 4), (32, 8)):
        for ratio in (2.0, 3.0):
            for heavy in (0.0, 0.09):
                f = [1.0] * S
                b = [ratio] * S
                f[-1], b[-1] = 1.0 + heavy, ratio * (1.0 + heavy)
                sim = simulate(M, S, f, b)
                tau = [x + y for x, y in zip(f, b)]
                mean = sum(tau) / S
                model = mean * (M + S - 1) + (M - 1) * (max(tau) - mean)
                rows.append({"microbatches": M, "stages": S, "backward_over_forward": ratio, "last_stage_extra": heavy,
                             "simulated": sim, "one_f_one_b_equal_stages": (M + S - 1) * (1.0 + ratio),
                             "cost_model": model, "simulated_over_cost_model": sim / model})
                print(f"M {M:3d} S {S:2d} B/F {ratio:.0f} last +{heavy:.0%}: simulated {sim:8.2f}  "
                      f"1F1B {(M + S - 1) * (1 + ratio):8.2f}  cost model {model:8.2f}  ratio {sim / model:.4f}")
    worst = max(abs(r["simulated_over_cost_model"] - 1) for r in rows)
    print(f"largest |simulated / cost model - 1|: {worst:.4f}")
    Path(a.json).write_text(json.dumps({"rows": rows, "largest_deviation": worst}, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
