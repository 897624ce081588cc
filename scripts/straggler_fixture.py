"""Derive tests/fixtures/straggler_analysis/ from ByteDance-Seed/StragglerAnalysis's public traces (Apache-2.0).

Run once, by hand (needs pandas + pyarrow to read the parquet traces; syncwise and its tests do not):

    git clone https://github.com/ByteDance-Seed/StragglerAnalysis /tmp/sa    # commit 8efcd7f (see README)
    python scripts/straggler_fixture.py /tmp/sa tests/fixtures/straggler_analysis

For each trace set (AR, SE, ST) it writes ``<name>.json.gz``: every worker's arrivals at the collectives of every
traced step in syncwise's arrivals format (``ranks/arrivals{R}.jsonl``, syncwise.comm.arrivals) and its per-step
timings in the rank-log format (``ranks/rank{R}.jsonl``), plus the job's layout and the trace set's known answer
(read from the artifact's result / M_W / M_S files). tests/test_doctor_straggler_traces.py turns it into a run
directory and runs doctor's arrival attribution on it.

The mapping (what a trace row becomes):

- a worker (one ``rank`` of the trace: one per (dp_rank, stage); the traces hold TP rank 0 only, and for SE one of
  each context-parallel pair) is one syncwise rank, numbered by the trace's global ``rank``;
- a collective's arrival is when the worker's own work let it issue the collective: the end of its last forward or
  backward compute that started before the collective, or the collective's ``start_ts`` (seconds after the step's
  start, on a clock the trace aligned across workers) where that is earlier or no compute precedes it. A traced
  collective's ``start_ts`` is when its kernel started on the GPU, which is later than its enqueue where the
  worker's communication stream was still busy with an earlier collective that waits for a peer: in AR the healthy
  pipelines' last-stage workers start their post-backward collectives ~22 s after their backward ended (queued,
  presumably, behind overlapped gradient buckets waiting for the slow pipeline), and their first-stage workers
  their reduce-scatter ~23 s after, behind the embedding all-reduce that waits for them. The flight recorder's
  ``time_created_ns`` (what syncwise logs) is the enqueue, which that queueing does not delay; the GPU start is
  kept as each entry's sixth element, and the test runs doctor on both;
- a collective's process group is the group the op synchronises (Megatron-LM's, as the artifact's dependency model
  pairs them): ``params-all-gather`` and ``grads-reduce-scatter`` the data-parallel group of the worker's stage
  (pg ``1 + stage``), ``embedding-grads-all-reduce`` the first and last stage of one pipeline (pg ``100 +
  dp_rank``), ``optimizer-clip-main-grad`` (the gradient norm's all-reduce) every worker (pg 0); the per-group
  sequence number counts those collectives over the traced steps, as c10d's ``collective_seq_id`` does;
  ``layernorm-grads-all-reduce`` (a tensor-parallel group of which the trace holds one member) and the pipeline's
  point-to-point sends and receives (syncwise's ArrivalLog skips p2p) are left out;
- elements are not in the trace: 0 for the gradient collectives, 1 for the scalar norm;
- a step's wall clock starts at ``1e18 + 100 s × its index`` (the traced steps are a sample: 16 … 1238, not
  consecutive), ``end_ns`` is the worker's last op's end;
- the rank rows (syncwise.metrics.RankLog's keys): ``step_time_s`` the step's span over all workers,
  ``comm_exposed_s`` the worker's time in the traced collectives (their waits for peers included; p2p excluded),
  ``compute_s`` the rest of the step, ``pp_bubble`` the share of the step in neither a collective nor its own
  forward / backward / optimizer (the pipeline's wait for its neighbours: syncwise's pipeline ranks count their
  bubble inside ``compute_s``), ``data_wait_s`` 0 (the traces record no input wait).
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SETS = ("AR", "SE", "ST")
COMPUTE = ("forward-compute", "backward-compute")
# per step, the collectives in the order a worker issues them (params gathered first, the norm last)
COLLECTIVES = ("params-all-gather", "grads-reduce-scatter", "embedding-grads-all-reduce",
               "optimizer-clip-main-grad")
STEP_NS = 100 * 10**9
BASE_NS = 10**18


def _pg(optype: str, stage: int, dp_rank: int) -> int:
    if optype in ("params-all-gather", "grads-reduce-scatter"):
        return 1 + stage
    if optype == "embedding-grads-all-reduce":
        return 100 + dp_rank
    return 0


def known_answer(src: Path, name: str) -> dict:
    """What the artifact says about the trace: its slowdown attributed per DP rank, per stage, per op type, and the
    M_W (individual worker issues) and M_S (stage partitioning imbalance) metrics."""
    result = json.loads((src / "data" / f"result-{name}.json").read_text())
    mw = json.loads((src / "data" / f"mw-{name}.json").read_text())["Mw"]
    ms = json.loads((src / "data" / f"ms-{name}.json").read_text())["Ms"]
    by_dp = {int(k): v for k, v in result["blocking_decompose_by_dp_rank"].items()}
    by_stage = {int(k): v for k, v in result["blocking_decompose_by_stage"].items()}
    by_op = result["blocking_decompose_by_optype"]
    comm = max(v for k, v in by_op.items() if k not in COMPUTE + ("optimizer", "gc"))
    # per step, the DP rank whose original durations cost the most (the artifact's per-step attribution), and the
    # slowdown it and the runner-up explain
    per_step = {}
    for step, by in result["blocking_decompose_by_dp_rank_per_step"].items():
        order = sorted(by, key=lambda k: -by[k])
        per_step[int(step)] = [int(order[0]), by[order[0]], by[order[1]] if len(order) > 1 else 1.0]
    return {"slowdown": result["blocking_slowdown"], "Mw": mw, "Ms": ms, "worst_dp_rank_per_step": per_step,
            "slowdown_by_dp_rank": by_dp, "slowdown_by_stage": by_stage, "slowdown_by_optype": by_op,
            "compute_dominates": max(by_op[k] for k in COMPUTE) > comm}


def derive(src: Path, name: str) -> dict:
    import pandas as pd
    import yaml

    meta = yaml.safe_load((src / "data" / f"meta-{name}.yaml").read_text())
    df = pd.read_parquet(src / "data" / f"trace-{name}.parquet")
    df["optype"] = df["optype"].astype(str)
    df["end"] = df["start_ts"].astype("float64") + df["duration"].astype("float64")
    steps = sorted(int(s) for s in df["step"].unique())
    span = df.groupby("step")["end"].max()
    workers = df.groupby("rank")[["dp_rank", "stage"]].first()
    coll = df[df["optype"].isin(COLLECTIVES)].copy()
    coll["order"] = coll["optype"].map(COLLECTIVES.index)
    # per (worker, step): its compute ops' starts and ends, for the moment its own work let it issue a collective
    comp = {k: (g["start_ts"].astype("float64").tolist(), g["end"].tolist())
            for k, g in df[df["optype"].isin(COMPUTE)].groupby(["rank", "step"])}
    seq: dict[int, int] = {}
    ranks: dict[str, dict] = {}
    out_rows: dict[int, list] = {int(r): [] for r in workers.index}
    for i, s in enumerate(steps):
        at = coll[coll["step"] == s]
        # per process group, the same sequence numbers on every member: count the group's collectives in issue order
        key = {}
        for (optype, stage, dp, sid) in sorted({(o, int(st), int(d), int(q)) for o, st, d, q in
                                                zip(at["optype"], at["stage"], at["dp_rank"], at["seq_id"])},
                                               key=lambda x: (COLLECTIVES.index(x[0]), x[1], x[2], x[3])):
            pg = _pg(optype, stage, dp)
            if (pg, optype, sid) not in key:
                key[(pg, optype, sid)] = seq.get(pg, 0)
                seq[pg] = seq.get(pg, 0) + 1
        start = BASE_NS + i * STEP_NS
        for r, wdf in at.sort_values(["order", "seq_id"]).groupby("rank"):
            w = workers.loc[r]
            c = []
            starts, ends = comp.get((int(r), s), ((), ()))
            for optype, sid, ts in zip(wdf["optype"], wdf["seq_id"], wdf["start_ts"]):
                pg = _pg(optype, int(w["stage"]), int(w["dp_rank"]))
                ts = float(ts)
                before = [e for b, e in zip(starts, ends) if b < ts]
                ready = min(ts, max(before)) if before else ts
                c.append([pg, key[(pg, optype, int(sid))], optype, 1 if pg == 0 else 0,
                          int(round(ready * 1e9)), int(round(ts * 1e9))])
            out_rows[int(r)].append({"step": s, "start_ns": start, "c": c})
    per = df.groupby(["rank", "step"])
    last = per["end"].max()
    compute = df[df["optype"].isin(COMPUTE)].groupby(["rank", "step"])["duration"].sum()
    optim = df[df["optype"].isin(("optimizer", "gc"))].groupby(["rank", "step"])["duration"].sum()
    # every non-p2p collective's time, its waits for peers included (the traced ones run on the critical path)
    comm = df[~df["optype"].isin(COMPUTE + ("optimizer", "gc", "forward-send", "forward-recv", "backward-send",
                                           "backward-recv"))].groupby(["rank", "step"])["duration"].sum()
    for r in workers.index:
        r = int(r)
        arrivals, rows = [], []
        for row in out_rows[r]:
            s = row["step"]
            row["end_ns"] = row["start_ns"] + int(round(float(last[(r, s)]) * 1e9))
            arrivals.append(row)
            step_s = float(span[s])
            busy = float(compute.get((r, s), 0.0)) + float(optim.get((r, s), 0.0))
            exposed = min(float(comm.get((r, s), 0.0)), step_s - busy)
            # syncwise's convention (a pipeline rank's compute_s holds its bubble, pp_bubble its share of the step):
            # what is neither computing nor a collective is the pipeline's wait for its neighbours
            rows.append({"step": s, "step_time_s": round(step_s, 6), "compute_s": round(step_s - exposed, 6),
                         "data_wait_s": 0.0, "comm_exposed_s": round(exposed, 6),
                         "pp_bubble": round(max(0.0, step_s - exposed - busy) / step_s, 6)})
        ranks[str(r)] = {"dp_rank": int(workers.loc[r, "dp_rank"]), "stage": int(workers.loc[r, "stage"]),
                         "arrivals": arrivals, "rows": rows}
    return {"trace": name, "meta": meta, "steps": steps, "known": known_answer(src, name), "ranks": ranks}


def main(argv: list[str]) -> int:
    src, dst = Path(argv[1]), Path(argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = argv[3] if len(argv) > 3 else "unknown"
    for name in SETS:
        data = derive(src, name)
        data["source"] = {"repo": "https://github.com/ByteDance-Seed/StragglerAnalysis", "commit": commit,
                          "license": "Apache-2.0", "files": [f"data/trace-{name}.parquet", f"data/meta-{name}.yaml",
                                                             f"data/result-{name}.json", f"data/mw-{name}.json",
                                                             f"data/ms-{name}.json"]}
        path = dst / f"{name}.json.gz"
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(json.dumps(data, separators=(",", ":"), sort_keys=True).encode())
        print(f"{path}: {path.stat().st_size:,} bytes, {len(data['ranks'])} workers, {len(data['steps'])} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
