"""Doctor's straggler attribution by arrival order at the collectives (syncwise.comm.arrivals → doctor.arrivals).

Synthetic rank logs whose step times are even (as under DDP, where the all-reduce evens the ranks out) but whose
arrivals show the straggler; and one tiny real 2-rank gloo run with a ``slow:`` fault where doctor names the rank
from the flight recorder's arrival times.
"""
from __future__ import annotations

import json
from pathlib import Path

from syncwise.doctor import diagnose, load_run
from syncwise.doctor.arrivals import attribute, load

STEP = 0.100


def _write_run(root: Path, world: int, steps: int, late: dict[int, dict[int, float]],
               data_wait: dict[int, dict[int, float]] | None = None, calls: int = 4) -> Path:
    """A run directory: every rank's step time the same (STEP), arrivals late by late[rank][step] seconds."""
    root.mkdir(parents=True)
    (root / "ranks").mkdir()
    data_wait = data_wait or {}
    for r in range(world):
        rows, arrivals = [], []
        for s in range(1, steps + 1):
            dw = data_wait.get(r, {}).get(s, 0.0)
            delay = late.get(r, {}).get(s, 0.0)
            # the late rank's delay is its own compute (or input) and the others' wait in the gradient sync; the
            # step is the same on every rank (DDP evens it out)
            behind = max(late.get(q, {}).get(s, 0.0) for q in range(world))
            own = delay - dw
            rows.append({"step": s, "step_time_s": 0.08 + behind, "compute_s": 0.07 + own, "data_wait_s": dw,
                         "comm_exposed_s": 0.01 + behind - delay})
            start = 10**18 + int(s * STEP * 1e9)
            c = [[0, s * (calls + 1) + k, "all_reduce", 4096, int((0.02 + 0.01 * k + delay) * 1e9)]
                 for k in range(calls)]
            c.append([0, s * (calls + 1) + calls, "all_reduce", 1, int((0.09 + delay) * 1e9)])
            arrivals.append({"step": s, "start_ns": start, "end_ns": start + int(STEP * 1e9), "c": c})
        (root / "ranks" / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (root / "ranks" / f"arrivals{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in arrivals))
        if r == 0:
            (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (root / "summary.json").write_text(json.dumps({"world_size": world, "steps": steps}))
    return root


def test_a_hidden_persistent_compute_straggler_is_named_by_arrival_order(tmp_path):
    run = _write_run(tmp_path / "r", 4, 20, {2: {s: 0.030 for s in range(1, 21)}})
    d = diagnose(load_run(run), predict=False)
    assert d.top is not None and d.top.cause == "straggler", d.findings
    assert d.top.details["rank"] == 2 and d.top.details["stays_slow"] and "persistent" in d.top.title
    assert abs(d.parts["straggler_wait"] - 0.030) < 1e-3
    assert d.facts["arrivals"]["kind"] == "compute"
    assert d.facts["grad_calls_per_step"] == 4          # the scalar all-reduce is control traffic


def test_a_transient_straggler_is_told_from_a_persistent_one(tmp_path):
    run = _write_run(tmp_path / "r", 2, 20, {1: {10: 0.4, 11: 0.4}})
    arr = load(run, [0, 1])
    v = attribute(arr, list(range(3, 21)), STEP)
    assert v.rank == 1 and not v.persistent and v.late_steps == [10, 11] and v.onset == 10
    d = diagnose(load_run(run), predict=False)
    assert d.top is not None and d.top.cause == "straggler" and "transient" in d.top.title
    assert "10, 11" in d.top.evidence


def test_a_late_rank_that_waits_for_its_batches_is_input_not_compute(tmp_path):
    late = {1: {s: 0.040 for s in range(1, 21)}}
    run = _write_run(tmp_path / "r", 2, 20, late, data_wait={1: {s: 0.040 for s in range(1, 21)}})
    d = diagnose(load_run(run), predict=False)
    assert d.facts["arrivals"]["kind"] == "input" and d.parts["straggler_wait"] == 0.0
    assert d.top is not None and d.top.cause == "data_loader"


def test_jitter_that_moves_between_ranks_is_no_straggler(tmp_path):
    late = {r: {s: 0.002 for s in range(1, 21) if s % 2 == r} for r in (0, 1)}
    d = diagnose(load_run(_write_run(tmp_path / "r", 2, 20, late)), predict=False)
    assert all(f.cause != "straggler" for f in d.findings)


def test_a_real_gloo_run_names_the_slow_rank_from_its_arrivals(tmp_path):
    from test_doctor import BASE, train_runs

    run = tmp_path / "slow"
    train_runs([BASE + ["--run-dir", str(run), "--inject-fault", "slow:rank=1,factor=3"]])
    for r in (0, 1):
        rows = [json.loads(x) for x in (run / "ranks" / f"arrivals{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == list(range(1, 9))
        assert all(x["c"] for x in rows)          # every step issued collectives (DDP's all-reduce)
    d = diagnose(load_run(run), predict=False)
    assert d.verdict is not None and d.verdict.rank == 1 and d.verdict.kind == "compute"
    assert d.top is not None and d.top.cause == "straggler" and d.top.details["rank"] == 1
    assert d.top.details["by"] == "arrival order"
