"""syncwise's trace reading (``syncwise.doctor.trace``) and HolisticTraceAnalysis (HTA) on the same trace files,
side by side (issue 44: "where a field tool already does a part, show that syncwise's reading agrees").

Two inputs:

1. a synthetic multi-rank GPU trace in Kineto's format, written here (``synthetic_gpu_trace``): host step windows,
   ``cpu_op``s, runtime launch calls (``cudaLaunchKernel``, ``cudaMemcpyAsync``, a ``cudaStreamSynchronize``)
   joined by ``correlation`` to kernels on two streams — GEMMs, a copy, and three DDP-style bucket all-reduces
   named as modern NCCL names them (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, HTA #360), with
   ``record_param_comms`` and ``distributedInfo`` as torch writes them. The forward is launch-bound (short kernels
   the host issues one by one), the backward device-bound (the host runs ahead), the last bucket's all-reduce runs
   after the backward (exposed), the optimizer waits for it. No GPU is needed to write or read it.
2. a real CPU (gloo) trace of a tiny 2-rank run, e.g.::

       syncwise train --preset tiny --steps 6 --nproc 2 --profile.steps=3:4 --run-dir /tmp/h44run \\
           --data.seq_len=32 --train.val_interval=0 --train.val_batches=1 --ckpt.interval=0

Per rank it prints syncwise's split (compute, communication union, exposed, overlap, idle = launch overhead +
host-bound) and HTA's temporal breakdown (idle / compute / non-compute over its kernel span), its
communication–computation overlap ratio, its GPU kernel breakdown by type, and its critical path's breakdown by
what bounds it (HTA's ``critical_path_analysis`` over the ``ProfilerStep`` windows), with syncwise / HTA ratios
where both measure the same thing, and where HTA finds nothing or fails, the error it raised.

HTA is optional (not a syncwise dependency; nothing in ``src/`` imports it): run this with a Python that has
``holistictraceanalysis`` (0.5.0) and torch, and ``PYTHONPATH=src``::

    python3 -m venv /tmp/htavenv && /tmp/htavenv/bin/pip install torch==2.13.0 holistictraceanalysis==0.5.0
    PYTHONPATH=src /tmp/htavenv/bin/python benchmarks/hta_side_by_side.py --cpu-run /tmp/h44run \\
        --out benchmarks/results/hta-side-by-side.json
"""
from __future__ import annotations

import argparse
import warnings
import io
import json
import logging
import platform
import sys
import tempfile
import traceback
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Optional

from syncwise.doctor.trace import _DEVICE_CATS, clip, comm_kind, length, split_trace, union

WORLD = 2
STEPS = 3            # HTA drops a trace's last ProfilerStep by default; it is told to keep it here
FIRST_STEP = 10


# ---- a synthetic Kineto trace ------------------------------------------------------------------------------------
def synthetic_gpu_trace(rank: int, world: int = WORLD, steps: int = STEPS) -> dict[str, Any]:
    """One rank's Kineto-format trace of ``steps`` training steps (µs); rank r's kernels are (1 + 0.15 r) times
    longer, so the ranks differ."""
    slow = 1.0 + 0.15 * rank
    host_pid, host_tid, gpu_pid = 1000 + rank, 1000 + rank, 0
    compute_stream, comm_stream = 7, 20
    ev: list[dict] = []
    ids = {"corr": 0, "ext": 0}
    free = {compute_stream: 0.0, comm_stream: 0.0}   # when each stream's last kernel ends

    def host(name: str, ts: float, dur: float, cat: str = "cpu_op", **args: Any) -> None:
        ids["ext"] += 1
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": host_pid, "tid": host_tid, "ts": ts, "dur": dur,
                   "args": {"External id": ids["ext"], **args}})

    def launch(ts: float, kernel: str, dur: float, stream: int, after: float = 0.0, cat: str = "kernel",
               call: str = "cudaLaunchKernel", **args: Any) -> float:
        """A runtime launch call at ``ts`` (8 µs) and its kernel: it starts 5 µs after the call returns, once its
        stream is free and ``after`` (an event it waits on) has passed. Returns the kernel's end."""
        ids["corr"] += 1
        c = ids["corr"]
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": host_pid, "tid": host_tid, "ts": ts,
                   "dur": 8.0, "args": {"correlation": c, "External id": ids["ext"], "cbid": 211}})
        start = max(ts + 8.0 + 5.0, free[stream], after)
        ev.append({"ph": "X", "cat": cat, "name": kernel, "pid": gpu_pid, "tid": stream, "ts": start, "dur": dur,
                   "args": {"correlation": c, "External id": ids["ext"], "device": 0, "stream": stream,
                            "queued": 0, **args}})
        free[stream] = start + dur
        return start + dur

    def wait(ts: float, stream: int, on: int) -> None:
        """``stream`` waits for the work launched so far on stream ``on``, as CUDA events do it: the host records
        an event (cudaEventRecord) and makes the stream wait on it (cudaStreamWaitEvent); Kineto draws the wait
        on the device as a zero-length ``cuda_sync`` "Stream Wait Event" naming the record's correlation id."""
        ids["corr"] += 2
        rec, w = ids["corr"] - 1, ids["corr"]
        for name, at, c in (("cudaEventRecord", ts, rec), ("cudaStreamWaitEvent", ts + 3, w)):
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": host_pid, "tid": host_tid, "ts": at,
                       "dur": 2.0, "args": {"correlation": c, "External id": ids["ext"]}})
        ev.append({"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": gpu_pid, "tid": stream,
                   "ts": ts + 5, "dur": 0.0, "args": {"correlation": w, "device": 0, "stream": stream,
                                                     "wait_on_stream": on, "wait_on_cuda_event_record_corr_id": rec}})

    t = 1_000_000.0
    for k in range(steps):
        s0 = t
        host("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t + 50, 900, cat="user_annotation")
        t += 1000                                                          # the loader: host-bound
        host("aten::to", t, 30)
        launch(t + 10, "Memcpy HtoD (Pageable -> Device)", 80, compute_stream, cat="gpu_memcpy",
               call="cudaMemcpyAsync")
        t += 60
        for _ in range(24):                                                # forward: short kernels, launch-bound
            host("aten::linear", t, 40)
            launch(t + 20, "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x64x32", 60 * slow, compute_stream)
            t += 100
        bucket_end = []
        for i in range(24):                                                # backward: the host runs ahead
            host("aten::mm", t, 25)
            end = launch(t + 10, "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32", 150 * slow,
                         compute_stream)
            t += 30
            if i in (7, 15, 23):                                           # a DDP bucket is ready: all-reduce it
                meta = {"Collective name": "allreduce", "In msg nelems": 2_000_000, "Out msg nelems": 2_000_000,
                        "dtype": "Float", "Group size": world, "Process Group Name": "0",
                        "Process Group Description": "default_pg"}
                host("record_param_comms", t, 30, **meta)
                host("nccl:all_reduce", t + 2, 26, cat="user_annotation")
                wait(t + 3, comm_stream, on=compute_stream)                  # the bucket's gradients are ready
                bucket_end.append(launch(t + 10, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 700.0, comm_stream,
                                         after=end, **meta))
                t += 40
        host("aten::_foreach_add_", t, 300)                                # optimizer: waits for the last bucket
        wait(t + 1, compute_stream, on=comm_stream)
        for j in range(6):
            launch(t + 10 + 40 * j, "multi_tensor_apply_kernel", 50 * slow, compute_stream, after=bucket_end[-1])
        t += 300
        host("aten::item", t, 10)
        launch(t + 2, "Memcpy DtoH (Device -> Pinned)", 4, compute_stream, cat="gpu_memcpy", call="cudaMemcpyAsync")
        done = free[compute_stream]
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": host_pid,
                   "tid": host_tid, "ts": t + 12, "dur": max(done - (t + 12), 1.0), "args": {"cbid": 131}})
        t = max(t + 13, done) + 200                                        # Python after the step
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": host_pid,
                   "tid": host_tid, "ts": s0, "dur": t - s0, "args": {"External id": 0}})
    return {"schemaVersion": 1, "traceName": f"rank{rank}", "baseTimeNanoseconds": 1_700_000_000_000_000_000,
            "deviceProperties": [{"id": 0, "name": "synthetic", "totalGlobalMem": 80 << 30}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config":
                                               "cuda:nccl", "pg_size": world, "ranks": list(range(world))}]},
            "syncwise": {"rank": rank, "first_step": FIRST_STEP},
            "traceEvents": sorted(ev, key=lambda e: e["ts"])}


# ---- syncwise's side ----------------------------------------------------------------------------------------------
def syncwise_side(path: Path) -> dict[str, Any]:
    """syncwise.doctor.trace's split of one rank's file, summed over its steps (ms)."""
    data = json.loads(path.read_text())
    t = split_trace(data, path=path)
    out: dict[str, Any] = {"device": t.device, "steps": [s.step for s in t.steps]}
    for key in ("step_ms", "compute_ms", "comm_ms", "exposed_ms", "overlap_ms", "idle_ms", "host_ms"):
        out[key] = sum(getattr(s, key) for s in t.steps)
    out["launch_ms"] = (sum(s.launch_ms for s in t.steps)
                        if t.steps and all(s.launch_ms is not None for s in t.steps) else None)
    out["overlap_share"] = out["overlap_ms"] / out["comm_ms"] if out["comm_ms"] else None
    # for HTA's definitions: its compute counts kernels only (not copies), its window is first kernel -> last
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    windows = [(s["ts"], s["ts"] + s["dur"]) for s in events if str(s.get("name", "")).startswith("ProfilerStep#")
               and s.get("cat") != "gpu_user_annotation"]
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") == "kernel"
               and comm_kind(e) is None]
    dev = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in _DEVICE_CATS]
    out["compute_kernels_only_ms"] = sum(length(union(clip(kernels, a, b))) for a, b in windows) / 1e3
    dev_u = union(x for a, b in windows for x in clip(dev, a, b))
    out["kernel_span_ms"] = (dev_u[-1][1] - dev_u[0][0]) / 1e3 if dev_u else None
    # idle inside that span: the span less the union of device work (HTA's idle, by syncwise's arithmetic)
    out["idle_in_kernel_span_ms"] = out["kernel_span_ms"] - length(dev_u) / 1e3 if dev_u else None
    out["kinds"] = {k: {"count": sum(s.kinds[k]["count"] for s in t.steps if k in s.kinds)}
                    for k in sorted({k for s in t.steps for k in s.kinds})}
    return out


# ---- HTA's side -----------------------------------------------------------------------------------------------
def _err(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e)[:300]}{where}"


def hta_side(files: dict[int, Path], steps: int) -> dict[str, Any]:
    """HTA 0.5.0's analyses of the same files, each in its own try (what it raised, where it fails)."""
    try:
        from hta.trace_analysis import TraceAnalysis
        import hta
    except ImportError as e:
        return {"error": f"HTA not installed: {e}"}
    out: dict[str, Any] = {"version": getattr(hta, "__version__", None)}
    try:
        from hta.version import __version__ as v
        out["version"] = v
    except ImportError:
        pass
    logging.getLogger("hta").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="hta")  # pandas deprecation noise from inside HTA
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="hta")
    try:
        quiet = io.StringIO()
        with redirect_stdout(quiet):
            ta = TraceAnalysis(trace_files={r: str(p) for r, p in files.items()},
                               trace_dir=str(next(iter(files.values())).parent), include_last_profiler_step=True)
    except Exception as e:  # noqa: BLE001 - the point is to say what HTA does with the trace
        out["load_error"] = _err(e)
        return out
    per_rank: dict[int, dict[str, Any]] = {r: {} for r in files}

    def attempt(name: str, fn):
        try:
            with redirect_stdout(io.StringIO()):
                return fn()
        except Exception as e:  # noqa: BLE001
            out.setdefault("errors", {})[name] = _err(e)
            return None

    tb = attempt("temporal_breakdown", lambda: ta.get_temporal_breakdown(visualize=False))
    if tb is not None:
        for row in tb.to_dict("records"):
            per_rank[int(row["rank"])].update({
                "idle_ms": row["idle_time(us)"] / 1e3, "compute_ms": row["compute_time(us)"] / 1e3,
                "non_compute_ms": row["non_compute_time(us)"] / 1e3, "kernel_span_ms": row["kernel_time(us)"] / 1e3})
    ov = attempt("comm_comp_overlap", lambda: ta.get_comm_comp_overlap(visualize=False))
    if ov is not None:
        for row in ov.to_dict("records"):
            share = row["comp_comm_overlap_pctg"] / 100  # HTA rounds it to 0.01 %
            if share != share:  # NaN: HTA divided 0 by 0 (no communication kernels)
                out.setdefault("errors", {})["comm_comp_overlap"] = ("NaN for every rank: no communication "
                                                                    "kernels (HTA's ratio is 0 / 0)")
                share = None
            per_rank[int(row["rank"])]["overlap_share"] = share
    kb = attempt("gpu_kernel_breakdown", lambda: ta.get_gpu_kernel_breakdown(visualize=False))
    if kb is not None:
        types = kb[0]
        out["kernel_types_all_ranks_ms"] = {str(r["kernel_type"]): r["sum"] / 1e3 for r in types.to_dict("records")}
        if not out["kernel_types_all_ranks_ms"]:
            out.setdefault("errors", {})["gpu_kernel_breakdown"] = "empty: no GPU kernels in the traces"
    for r in files:
        # one ProfilerStep instance at a time, summed over the steps (HTA's range form, instance_id=(0, n-1),
        # returned a shorter path than the sum of its steps on the synthetic trace, whose steps are identical)
        def critical(rank=r, k=0):
            graph, ok = ta.critical_path_analysis(rank=rank, annotation="ProfilerStep", instance_id=k)
            if not ok:
                raise RuntimeError("critical_path_analysis returned success=False")
            df = graph.get_critical_path_breakdown()
            by = df.groupby("bound_by").duration.sum() / 1e3
            return {str(k) or "dependency (0-weight)": float(v) for k, v in by.items()}
        per_step = [attempt(f"critical_path_rank{r}_step{k}", lambda k=k: critical(k=k)) for k in range(steps)]
        if per_step and None not in per_step:
            per_rank[r]["critical_path_per_step_ms"] = [sum(x.values()) for x in per_step]
            per_rank[r]["critical_path_ms"] = {b: sum(x.get(b, 0.0) for x in per_step)
                                               for b in sorted({b for x in per_step for b in x})}
    out["ranks"] = per_rank
    return out


# ---- side by side ---------------------------------------------------------------------------------------------
def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b not in (None, 0) else None


def compare(sw: dict[int, dict], hta: dict[str, Any]) -> dict[int, list[dict]]:
    """Per rank, rows (what, syncwise, HTA, ratio, note)."""
    rows: dict[int, list[dict]] = {}
    hr = hta.get("ranks") or {}
    for rank, s in sw.items():
        h = hr.get(rank, {})
        cp = h.get("critical_path_ms") or {}
        rows[rank] = [
            {"what": "steps (ms)", "syncwise": s["step_ms"], "hta": sum(cp.values()) if cp else None,
             "note": "syncwise: the host's ProfilerStep windows; HTA: the length of its critical path, per step"},
            {"what": "kernel span (ms)", "syncwise": s["kernel_span_ms"], "hta": h.get("kernel_span_ms"),
             "note": "the same quantity: first device event to last, within the steps"},
            {"what": "compute, kernels only (ms)", "syncwise": s["compute_kernels_only_ms"],
             "hta": h.get("compute_ms"), "note": "union of non-communication kernels (HTA leaves copies out)"},
            {"what": "compute, with copies (ms)", "syncwise": s["compute_ms"], "hta": None,
             "note": "syncwise's compute counts memcpy/memset as device work; HTA has them in non-compute"},
            {"what": "communication, union (ms)", "syncwise": s["comm_ms"], "hta": None,
             "note": "HTA reports no per-rank union; its kernel breakdown sums COMMUNICATION kernels over ranks"},
            {"what": "overlap / communication", "syncwise": s["overlap_share"], "hta": h.get("overlap_share"),
             "note": "|comm ∩ compute| / |comm|"},
            {"what": "exposed communication (ms)", "syncwise": s["exposed_ms"],
             "hta": cp.get("gpu_communication_bound"),
             "note": "HTA: communication kernels on its critical path (a different measure; compare loosely)"},
            {"what": "idle in the steps (ms)", "syncwise": s["idle_ms"], "hta": h.get("idle_ms"),
             "note": "HTA's idle lies inside its kernel span; syncwise's also counts the step's ends"},
            {"what": "idle in the kernel span (ms)", "syncwise": s["idle_in_kernel_span_ms"], "hta": h.get("idle_ms"),
             "note": "the same window: first device event to last"},
            {"what": "launch overhead (ms)", "syncwise": s["launch_ms"], "hta": cp.get("gpu_kernel_launch_overhead"),
             "note": "syncwise: all device idle while a launch is under way; HTA: launch delays on its critical path"},
            {"what": "host-bound (ms)", "syncwise": s["host_ms"], "hta": cp.get("cpu_bound"),
             "note": "HTA: CPU time on its critical path (includes the host's time beside device work)"},
        ]
        for row in rows[rank]:
            row["ratio"] = _ratio(row["syncwise"], row["hta"])
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:,.3f}" if isinstance(x, float) else str(x)


def show(title: str, sw: dict[int, dict], hta: dict[str, Any], rows: dict[int, list[dict]]) -> None:
    print(f"\n== {title} ==  (HTA {hta.get('version')})")
    if hta.get("load_error"):
        print(f"HTA could not load the traces: {hta['load_error']}")
    for name, err in (hta.get("errors") or {}).items():
        print(f"HTA {name}: {err}")
    for rank, rs in rows.items():
        print(f"rank {rank} ({sw[rank]['device']} trace, steps {sw[rank]['steps']}):")
        print(f"  {'':30s} {'syncwise':>10s} {'HTA':>10s} {'ratio':>7s}")
        for r in rs:
            print(f"  {r['what']:30s} {_fmt(r['syncwise']):>10s} {_fmt(r['hta']):>10s} {_fmt(r['ratio']):>7s}")
        cp = (hta.get("ranks") or {}).get(rank, {}).get("critical_path_ms")
        if cp:
            print(f"  HTA critical path, total (ms): {sum(cp.values()):,.3f}")
        if cp:
            print("  HTA critical path by bound (ms): " + ", ".join(f"{k} {v:,.3f}" for k, v in sorted(cp.items())))


def _kernel_types(hta: dict[str, Any]) -> None:
    if hta.get("kernel_types_all_ranks_ms"):
        print("HTA kernel time by type, summed over ranks and kernels (ms): "
              + ", ".join(f"{k} {v:,.3f}" for k, v in hta["kernel_types_all_ranks_ms"].items()))


def run(title: str, files: dict[int, Path], steps: int) -> dict[str, Any]:
    sw = {r: syncwise_side(p) for r, p in sorted(files.items())}
    hta = hta_side(files, steps)
    rows = compare(sw, hta)
    show(title, sw, hta, rows)
    _kernel_types(hta)
    return {"files": {r: str(p) for r, p in files.items()}, "syncwise": sw, "hta": hta, "side_by_side": rows}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-run", type=Path, help="a run directory whose traces/ hold a real CPU (gloo) run's traces")
    ap.add_argument("--out", type=Path, help="write everything as JSON here")
    ap.add_argument("--keep", type=Path, help="write the synthetic GPU traces here (default: a temporary dir)")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch
        result["torch"] = torch.__version__
    except ImportError:
        result["torch"] = None
    try:
        import pandas
        result["pandas"] = pandas.__version__  # HTA 0.5.0's critical path fails under pandas 3 (drop(axis=, columns=))
    except ImportError:
        result["pandas"] = None
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        files = {}
        for r in range(WORLD):
            files[r] = where / f"rank{r}.step{FIRST_STEP}-{FIRST_STEP + STEPS - 1}.json"
            files[r].write_text(json.dumps(synthetic_gpu_trace(r)))
        result["synthetic_gpu"] = run(f"synthetic GPU (Kineto-format) trace, {WORLD} ranks, {STEPS} steps, "
                                      "ncclDevKernel_* all-reduces", files, STEPS)
        if not args.keep:
            result["synthetic_gpu"]["files"] = "temporary (benchmarks/hta_side_by_side.py:synthetic_gpu_trace)"
    if args.cpu_run:
        found = sorted((args.cpu_run / "traces").glob("rank*.step*.json"))
        files = {int(p.name[4:].split(".")[0]): p for p in found}
        steps = max(len(json.loads(p.read_text()).get("syncwise", {}).get("steps", [])) for p in found) or 2
        result["cpu_run"] = run(f"real CPU (gloo) trace: {args.cpu_run}", files, steps)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
