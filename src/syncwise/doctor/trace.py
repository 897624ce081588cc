"""Reading the profiler traces of a run (``RUN_DIR/traces/rank{R}.step{A}-{B}.json``, ``--profile.*``): where each
profiled step went, per rank, by interval arithmetic on the trace's own events.

Per step (the host's ``ProfilerStep#k`` window, trainer step ``first_step + k``):

- **communication**: the *union* of the intervals of every communication event in the window, on any thread or
  stream — never their summed durations (two collectives in flight at once count once); not the control
  collectives (a recorded payload of at most 8 bytes — a flag, a loss scalar — and not a send or receive: issued
  asynchronously and read a step later, their time in flight is the ranks' skew, not a transfer the step waits on;
  they are still counted per kind);
- **compute**: the union of the compute intervals: on a GPU trace the device's kernels that are not
  communication; on a CPU trace (gloo) the main thread's operators, each whole (its own dispatch and autograd
  bookkeeping included), less the communication the main thread ran inside them (what the CPU computed; Python
  between operators is not compute);
- **exposed communication** = |communication \\ compute|: communication nothing computed beside;
- **compression** = the gradient compressor's own work (its ``syncwise:compress`` label, ``syncwise.profiling``;
  on any thread) while the step neither computed nor communicated: the compressor on the critical path (on a CPU
  trace the operators inside the label on the main thread are the compressor's, not compute);
- **overlap** = |communication ∩ compute|; **overlap achieved** = overlap / communication;
- **idle** = the step − |compute ∪ communication ∪ compression|: the device (or the CPU's compute) waited on the
  host; on a GPU (Kineto) trace it splits in two:
  - **launch overhead** = the idle time during which a kernel launch was under way: the host inside a launch call
    of the CUDA/HIP runtime or driver (``cudaLaunchKernel``, ``cudaLaunchKernelExC``, ``cuLaunchKernel``,
    ``cudaGraphLaunch``, ``cudaMemcpyAsync``, ``cudaMemsetAsync``, ...; category ``cuda_runtime``/``cuda_driver``)
    or, after the call returned, the work it launched not yet started on the device (the call's ``correlation`` id
    names its kernel) — the device had been given work and was waiting for it to arrive;
  - **host-bound** = the rest of idle: Python, the data loader, synchronisation — the host had not yet asked.
  On a CPU (gloo) trace nothing is launched: launch overhead is not defined (``None``) and all of idle is host-bound.

So compute + exposed + compression + idle is the step, exactly, and idle = launch overhead + host-bound.
Communication is recognised by what the trace says about an event, in this order: a ``Collective name`` argument
(torch's ``record_param_comms`` and NCCL kernels carry it), the backend's own annotation (``gloo:all_reduce``,
``nccl:all_reduce``, ``ucc:``, ``mpi:``), c10d's operators (``c10d::allreduce_``: the host side that issues it),
syncwise's label around a blocking collective (``syncwise:wait broadcast``: the host waiting in it, whatever its
size — a control collective the host waits on is a wait, not skew), and
NCCL's kernels under both names they have had (``ncclKernel_*``, ``ncclDevKernel_*``) — the last only where nothing
else marks a device event. On a GPU trace
whose device events include communication, only those count (the device's time is what is split; the host's
``record_param_comms`` and ``nccl:`` annotations around a launch are not the collective running).
Pure Python over JSON (no torch); HolisticTraceAnalysis's critical-path and overlap analyses follow the same rule
(interval unions of the kernels of the communication and compute streams).
"""
from __future__ import annotations

import bisect
import collections
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from ..profiling import COMPRESS_LABEL, WAIT_LABEL
from ..rundir import RunDir

_FILE = re.compile(r"^rank(\d+)\.step(\d+)-(\d+)\.json$")
_BACKENDS = ("gloo:", "nccl:", "ucc:", "mpi:", "xccl:")
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: point-to-point kinds (the pipeline's sends and receives): not a gradient collective
_P2P = ("send", "recv", "isend", "irecv", "batchisendirecv", "sendrecv", "barrier")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
#: the runtime / driver calls that launch work on the device (CUDA and HIP; not the synchronous copies and waits)
_LAUNCH = re.compile(r"^(?:cuda|cu|hip)(?:\w*Launch\w*|Memcpy\w*(?:Async|WithStream)\w*|Memset\w*Async\w*)$")
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "c10::half": 2, "half": 2, "float16": 2,
                "c10::bfloat16": 2, "bfloat16": 2, "long int": 8, "int64": 8, "int": 4, "int32": 4, "short int": 2,
                "signed char": 1, "unsigned char": 1, "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
                "uint8": 1, "int8": 1,
                # the flight recorder's names (c10::ScalarType): ``syncwise.train.profile`` stores its entries
                "long": 8, "short": 2, "char": 1, "byte": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


# ---- interval arithmetic (half-open [a, b), microseconds) ------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``intervals`` (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two disjoint sorted unions."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``x`` without ``y`` (both disjoint sorted unions), in one pass over each."""
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:  # y's intervals wholly before this one are done with
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            c, d = y[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if d >= b:
                break
            k += 1
        if a < b:
            out.append((a, b))
    return out


def clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


# ---- recognising events ------------------------------------------------------------------------------------------
def comm_kind(event: dict) -> Optional[str]:
    """The collective an event is part of ('allreduce', 'allgather', ...), or None when it is not communication."""
    args = event.get("args") or {}
    name = str(event.get("name", ""))
    named = args.get("Collective name")
    if named:
        return _norm(str(named))
    if name.startswith(_BACKENDS):
        return _norm(name.split(":", 1)[1])
    if name.startswith("c10d::"):
        return _norm(name[len("c10d::"):])
    if name.startswith(WAIT_LABEL) and event.get("cat") != "gpu_user_annotation":
        return _norm(name[len(WAIT_LABEL):])
    m = _NCCL_KERNEL.match(name)
    if m and event.get("cat") in _DEVICE_CATS:
        return _norm(m.group(1))
    return None


def _norm(kind: str) -> str:
    k = kind.lower().strip().rstrip("_")
    for suffix in ("_coalesced", "_tensor", "_base", "_into_tensor", "_base_"):
        k = k.replace(suffix, "")
    return k.replace("_", "")


def is_launch(event: dict) -> bool:
    """A kernel-launch call of the CUDA/HIP runtime or driver (the host enqueuing device work)."""
    return event.get("cat") in _RUNTIME_CATS and bool(_LAUNCH.match(str(event.get("name", ""))))


#: the largest recorded payload of a control collective (a flag, a loss scalar), in bytes
_CONTROL_BYTES = 8


def _is_control(event: dict, kind: str, size: Optional[int]) -> bool:
    """A control collective: one whose payload (``size`` bytes) is at most 8 bytes (a flag, a loss scalar), not a
    pipeline send or receive (those wait for their peer whatever their size)."""
    if kind in _P2P or _is_issue(event):
        return False
    return size is not None and size <= _CONTROL_BYTES


def _is_issue(event: dict) -> bool:
    """The host side of a collective (c10d's operator; syncwise's label around a blocking one, the host waiting in
    it), not its execution (the backend's work, a kernel)."""
    return str(event.get("name", "")).startswith(("c10d::", WAIT_LABEL))


def event_bytes(event: dict) -> Optional[int]:
    """Bytes of a collective's input, from the trace's recorded shapes (``record_shapes``) or message size."""
    args = event.get("args") or {}
    dtype = str(args.get("dtype", "")).lower()
    if "In msg nelems" in args and dtype in _DTYPE_BYTES:
        return int(args["In msg nelems"]) * _DTYPE_BYTES[dtype]
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    total, seen = 0, False
    for shape, t in zip(dims, types):
        size = _DTYPE_BYTES.get(str(t).lower())
        if size is None or not isinstance(shape, list):
            continue
        shapes = shape if shape and all(isinstance(s, list) for s in shape) else [shape]  # a tensor list
        for s in shapes:
            total += math.prod(int(d) for d in s) * size
            seen = True
    return total if seen else None


def _entry_bytes(entry: dict) -> Optional[int]:
    """Bytes of a flight-recorder entry's inputs (``comm.arrivals.window``'s rows)."""
    total = 0
    for shape, dtype in zip(entry.get("sizes") or [], entry.get("dtypes") or []):
        size = _DTYPE_BYTES.get(str(dtype).lower())
        if size is None:
            return None
        total += math.prod(int(d) for d in shape) * size
    return total


def recorded(data: dict, comm: list[tuple[dict, str]]) -> dict[int, tuple[Optional[int], Optional[str]]]:
    """``id(event)`` -> (bytes, process group name) for the trace's communication events, from the flight recorder's
    entries the profiler stored beside it (``syncwise.collectives``: a trace recorded without shapes).

    - The host side (``c10d::allreduce_``): the entry of the same op created inside the operator's span.
    - The execution (``gloo:all_reduce`` on the group's worker thread, a kernel on the group's stream): a process
      group runs its collectives first in first out, each group on threads or streams of its own. In start order,
      each execution takes the oldest unmatched entry of a group whose oldest is of its op and was created before it
      started: the group its thread already ran for, else the group with the fewest threads seen (a thread new to
      the trace belongs to a group not yet seen running), then the oldest entry.
    An event left unmatched (its entry created before the window, the ring wrapped) keeps what the trace records."""
    meta = data.get("syncwise") or {}
    rows, base = meta.get("collectives"), data.get("baseTimeNanoseconds")
    if not rows or not isinstance(base, int):
        return {}
    entries = []
    for r in rows:  # creation in the trace's microseconds (integers first: the base alone exceeds a float's ns)
        kind = comm_kind({"name": r.get("op", "")})
        if kind:
            entries.append({**r, "kind": kind, "ts": (int(r["t_ns"]) - base) / 1e3, "bytes": _entry_bytes(r)})
    entries.sort(key=lambda r: r["ts"])
    created = [r["ts"] for r in entries]
    out: dict[int, tuple[Optional[int], Optional[str]]] = {}
    slack = 1.0  # µs: the trace's float timestamps
    for e, k in comm:
        if _is_issue(e):
            a, b = float(e["ts"]) - slack, float(e["ts"]) + float(e.get("dur", 0.0)) + slack
            inside = [r for r in entries[bisect.bisect_left(created, a):bisect.bisect_right(created, b)]
                      if r["kind"] == k]
            if len(inside) == 1:
                out[id(e)] = (inside[0]["bytes"], inside[0]["pg"])
    queues: dict[str, collections.deque] = {}
    for r in entries:
        queues.setdefault(r["pg"], collections.deque()).append(r)
    thread_of: dict[Any, str] = {}
    seen: dict[str, set] = {}
    for e, k in sorted(((e, k) for e, k in comm if not _is_issue(e)), key=lambda ek: float(ek[0]["ts"])):
        where = (e.get("pid"), e.get("tid"))
        ready = [g for g, q in queues.items() if q and q[0]["kind"] == k and q[0]["ts"] <= float(e["ts"]) + slack]
        if where in thread_of:
            ready = [g for g in ready if g == thread_of[where]]
        if not ready:
            continue
        g = min(ready, key=lambda g: (len(seen.get(g, ())), queues[g][0]["ts"]))
        r = queues[g].popleft()
        thread_of[where] = g
        seen.setdefault(g, set()).add(where)
        out[id(e)] = (r["bytes"], g)
    return out


#: a process group's description -> the parallel dimension its collectives serve: DeviceMesh names its groups
#: ``mesh_<dim>`` (syncwise.parallel.mesh), syncwise's own groups are named by purpose (``ops.new_group(desc=...)``)
DIM_OF_GROUP = {"default_pg": "dp", "mesh_dp_replicate": "dp", "mesh_dp_shard": "fsdp", "mesh_tp": "tp",
                "mesh_pp": "pp", "mesh_ep": "ep", "mesh_ep_replicate": "dp", "compress": "dp",
                "checkpoint": "control", "preemption": "control", "calibrate-node": "dp"}


def process_groups(data: dict) -> dict[str, tuple[str, int]]:
    """The trace's process groups (``distributedInfo.pg_config``): name -> (description, size)."""
    info = data.get("distributedInfo") or {}
    out = {}
    for g in info.get("pg_config") or []:
        if isinstance(g, dict) and "pg_name" in g:
            out[str(g["pg_name"])] = (str(g.get("pg_desc", "")), int(g.get("pg_size") or 0))
    return out


def group_of(event: dict, groups: dict[str, tuple[str, int]],
             pg: Optional[str] = None) -> tuple[Optional[str], Optional[int]]:
    """(the parallel dimension, the group's size) of a communication event, where the trace names its process group
    (torch's ``record_param_comms`` does: NCCL on GPUs) or the flight recorder's entry does (``pg``, from
    :func:`recorded`); (None, None) where neither does."""
    args = event.get("args") or {}
    name = args.get("Process Group Name", pg)
    desc, size = groups.get(str(name), ("", 0)) if name is not None else ("", 0)
    desc = str(args.get("Process Group Description") or desc)
    size = int(args.get("Group size") or size or 0) or None
    if not desc:
        return None, size
    return DIM_OF_GROUP.get(desc, desc[len("mesh_"):] if desc.startswith("mesh_") else desc), size


#: the trace's collective kinds under the cost model's names (``syncwise.plan.whatif.moved_bytes``: the bytes a rank
#: moves for its input, nccl-tests' bus factors); other kinds move their input once
_COST_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
             "alltoall": "all_to_all", "alltoallbase": "all_to_all"}


# ---- one trace -------------------------------------------------------------------------------------------------
@dataclass
class StepSplit:
    """One profiled step on one rank (milliseconds)."""

    step: int
    step_ms: float
    compute_ms: float
    comm_ms: float          # |union of communication|
    exposed_ms: float       # |communication \ compute|
    overlap_ms: float       # |communication ∩ compute|
    idle_ms: float          # step − |compute ∪ communication ∪ compression| = launch_ms + host_ms
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> count, bytes, ms (union of its events)
    # dimension -> ms (union of its collectives) and exposed_ms (of those, nothing computed beside): only where the
    # trace or the flight recorder's entries name the process groups
    dims: dict[str, dict[str, float]] = field(default_factory=dict)
    # the step's intervals in ms from its start: compute, exposed and overlapped communication, and per dimension
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # of idle, the device waiting on a kernel launch under way (GPU trace); None on a CPU trace: nothing is launched
    launch_ms: Optional[float] = None
    host_ms: float = 0.0    # of idle, the rest: host-bound (all of idle on a CPU trace)
    compress_ms: float = 0.0  # the compressor's labelled work while nothing computed or communicated
    # collectives that carry a payload (more than 8 bytes: not a flag or a loss scalar) this step, executions only,
    # point-to-point sends and receives left out, and their bytes (None where a size is not recorded)
    payload_calls: int = 0
    payload_bytes: Optional[int] = None
    # the gradient buckets: each payload collective the step executed on the data-parallel dimension (its group
    # named: ``dp``/``fsdp``; else any payload collective), in start order — its bytes, start and duration (ms from
    # the step's start) and exposed ms (nothing computed beside)
    buckets: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RankTrace:
    rank: int
    path: Path
    device: str                      # 'gpu' (device kernels) or 'cpu' (the main thread's operators)
    steps: list[StepSplit]

    def mean(self, key: str) -> float:
        return sum(getattr(s, key) for s in self.steps) / len(self.steps) if self.steps else 0.0


def _launch_windows(events: list[dict], device: list[dict]) -> list[tuple[float, float]]:
    """Per kernel-launch call, from its start until the work it launched starts on the device (the earliest device
    event with its ``correlation`` id), or until the call returns where that is later or no device event is known."""
    starts: dict[Any, float] = {}
    for e in device:
        c = (e.get("args") or {}).get("correlation")
        if c is not None:
            starts[c] = min(starts.get(c, float("inf")), float(e["ts"]))
    out = []
    for e in events:
        if is_launch(e):
            a = float(e["ts"])
            b = a + float(e.get("dur", 0.0))
            k = starts.get((e.get("args") or {}).get("correlation"))
            out.append((a, max(b, k) if k is not None and k >= a else b))
    return out


def split_trace(data: dict, rank: int = 0, path: Path = Path("-")) -> RankTrace:
    """Every profiled step of one rank's trace, split as the module's docstring says."""
    meta = data.get("syncwise") or {}
    first = int(meta.get("first_step", 0))
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    # the host's step windows (Kineto repeats them on the GPU's streams as gpu_user_annotation: not steps)
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    main = {(e.get("pid"), e.get("tid")) for e in steps}
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    comm = [(e, comm_kind(e)) for e in events]
    comm = [(e, k) for e, k in comm if k is not None]
    if device and any(e.get("cat") in _DEVICE_CATS for e, _ in comm):
        comm = [(e, k) for e, k in comm if e.get("cat") in _DEVICE_CATS]  # the collective running, not its issue
    launches = _launch_windows(events, device) if device else []
    groups = process_groups(data)
    fr = recorded(data, comm)
    size, labels = {}, {}
    for e, _ in comm:  # the trace's own shapes and group where recorded, else the flight recorder's
        fr_bytes, fr_group = fr.get(id(e), (None, None))
        shaped = event_bytes(e)
        size[id(e)] = shaped if shaped is not None else fr_bytes
        labels[id(e)] = group_of(e, groups, fr_group)
    named = any(dim for dim, _ in labels.values())  # the buckets: the data-parallel groups' where groups are named
    comm_ids = {id(e) for e, _ in comm}
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))  # noqa: E731
    # the compressor's labelled work (syncwise.compress.hook), host side (not Kineto's copies on the GPU's streams)
    labelled = [e for e in events if e.get("name") == COMPRESS_LABEL and e.get("cat") != "gpu_user_annotation"]
    if device:
        compute_src = [span(e) for e in device if id(e) not in comm_ids]
    else:
        ours = [e for e in events if (e.get("pid"), e.get("tid")) in main and id(e) not in comm_ids
                and not str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "cpu_op"]
        # every operator's whole span (its own dispatch and autograd bookkeeping included: the backward's
        # ``autograd::engine::evaluate_function`` wrappers hold most of a CPU backward's time outside their
        # innermost operators), less the communication the main thread itself was in (a collective's issue, or
        # syncwise's label around a blocking one) — not a backend's annotation that gloo records on the issuing
        # thread from issue to completion (an async send, 500 ms of a pipeline's step, while the thread computes);
        # the operators the compressor ran on the main thread (an encode inside the backward) are its, not compute
        inline = union(span(e) for e, _ in comm if (e.get("pid"), e.get("tid")) in main and _is_issue(e))
        compute_src = _minus(_minus(union(span(e) for e in ours), inline),
                             union(span(e) for e in labelled if (e.get("pid"), e.get("tid")) in main))
    # the communication the step is split by: not the control collectives (a flag, a loss scalar: <= 8 bytes, not a
    # send or receive), issued asynchronously and read a step later — their time in flight is the ranks' skew, not a
    # transfer anything waits on (they are still counted per kind)
    control = {id(e) for e, k in comm if _is_control(e, k, size[id(e)])}
    comm_src = [span(e) for e, _ in comm if id(e) not in control]
    compress_src = [span(e) for e in labelled]
    out = []
    for s in steps:
        lo, hi = float(s["ts"]), float(s["ts"]) + float(s.get("dur", 0.0))
        number = first + int(str(s["name"]).split("#", 1)[1])
        compute = union(clip(compute_src, lo, hi))
        comms = union(clip(comm_src, lo, hi))
        both = intersect(compute, comms)
        # the compressor on the critical path: its work while the step neither computed nor communicated
        compress = _minus(union(clip(compress_src, lo, hi)), union(compute + comms))
        busy = length(union(compute + comms)) + length(compress)
        kinds: dict[str, dict[str, float]] = {}
        executed = {k for e, k in comm if not _is_issue(e) and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo}
        for kind in sorted({k for e, k in comm if e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo}):
            mine = [e for e, k in comm if k == kind and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo
                    and (_is_issue(e) != (kind in executed))]  # its execution where recorded, else its issue
            sizes = [size[id(e)] for e in mine]
            members = [labels[id(e)][1] for e in mine if labels[id(e)][1]]
            kinds[kind] = {"count": len(mine), "bytes": sum(sizes) if sizes and None not in sizes else None,
                           "ms": length(union(clip(((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in mine),
                                                   lo, hi))) / 1e3,
                           "group_size": max(members) if members else None}
        payload = [size[id(e)] for e, k in comm if k not in _P2P and e["ts"] < hi
                   and e["ts"] + e.get("dur", 0) > lo and (_is_issue(e) != (k in executed))]
        payload = [b for b in payload if b is None or b > _CONTROL_BYTES]
        dims: dict[str, dict[str, float]] = {}
        dim_spans: dict[str, list] = {}
        for dim in sorted({labels[id(e)][0] for e, _ in comm if labels[id(e)][0]}):
            mine_u = union(clip(((e["ts"], e["ts"] + e.get("dur", 0.0)) for e, _ in comm
                                 if labels[id(e)][0] == dim and id(e) not in control), lo, hi))
            if mine_u:
                dims[dim] = {"ms": length(mine_u) / 1e3,
                             "exposed_ms": (length(mine_u) - length(intersect(compute, mine_u))) / 1e3}
                dim_spans[dim] = mine_u
        rel = lambda xs: [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in xs]  # noqa: E731
        exposed = _minus(comms, both)
        idle = (hi - lo - busy) / 1e3
        spans = {"compute": rel(compute), "exposed": rel(exposed), "overlapped": rel(both), "compress": rel(compress),
                 **{f"dim:{d}": rel(v) for d, v in dim_spans.items()}}
        grad = sorted((e for e, k in comm if not _is_issue(e) and k not in _P2P and id(e) not in control
                       and lo <= e["ts"] < hi and (labels[id(e)][0] in ("dp", "fsdp") if named else True)
                       and (size[id(e)] is None or size[id(e)] > _CONTROL_BYTES)), key=lambda e: e["ts"])
        buckets = []
        for e in grad:
            a, b = span(e)
            own = union([(a, min(b, hi))])
            buckets.append({"bytes": size[id(e)], "start_ms": (a - lo) / 1e3, "ms": (min(b, hi) - a) / 1e3,
                            "exposed_ms": (length(own) - length(intersect(compute, own))) / 1e3})
        launch = None
        if device:  # idle ∩ launches under way
            waiting = _minus(union(clip(launches, lo, hi)), union(compute + comms + compress))
            launch = min(length(waiting) / 1e3, idle)
            spans["launch"] = rel(waiting)
        out.append(StepSplit(number, (hi - lo) / 1e3, length(compute) / 1e3, length(comms) / 1e3,
                             (length(comms) - length(both)) / 1e3, length(both) / 1e3, idle,
                             kinds, dims, spans, launch, idle - (launch or 0.0), length(compress) / 1e3,
                             len(payload), sum(payload) if None not in payload else None, buckets))
    return RankTrace(int(meta.get("rank", rank)), path, "gpu" if device else "cpu", out)


def load_traces(run_dir: "str | Path") -> dict[int, list[RankTrace]]:
    """Every rank's traces under ``RUN_DIR/traces`` (rank -> its files in step order); {} when there are none.
    A file that cannot be read is skipped (a run killed while writing one)."""
    where = RunDir(run_dir).traces
    out: dict[int, list[RankTrace]] = {}
    if not where.is_dir():
        return out
    found = sorted(((int(m.group(1)), int(m.group(2)), p) for p in where.iterdir()
                    if (m := _FILE.match(p.name))), key=lambda x: (x[0], x[1]))
    for rank, _, p in found:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out.setdefault(rank, []).append(split_trace(data, rank, p))
    return out


def _mean_buckets(per_step: list[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """The buckets of a rank's profiled steps, bucket by bucket: the mean over the steps that ran the most common
    number of them (a step can differ: DDP rebuilds its buckets after the first, a window's edge cuts one);
    ``overlap`` = 1 − exposed / duration. None where no step ran any."""
    counts = collections.Counter(len(b) for b in per_step if b)
    if not counts:
        return None
    per_step = [b for b in per_step if len(b) == counts.most_common(1)[0][0]]
    n = len(per_step)
    out = []
    for i in range(len(per_step[0])):
        ms = sum(b[i]["ms"] for b in per_step) / n
        exposed = sum(b[i]["exposed_ms"] for b in per_step) / n
        sizes = [b[i]["bytes"] for b in per_step]
        out.append({"bucket": i + 1, "bytes": sizes[0] if None not in sizes else None, "ms": ms,
                    "exposed_ms": exposed, "overlap": 1 - exposed / ms if ms > 0 else None})
    return out


# ---- the run ---------------------------------------------------------------------------------------------------
PHASES = {"compute_ms": "compute", "exposed_ms": "exposed communication", "launch_ms": "launch overhead",
          "host_ms": "host-bound"}


def summarize(run_dir: "str | Path", priced_bytes_s: Optional[float] = None) -> Optional[dict[str, Any]]:
    """What the traces say about the run, or None without traces: per rank (mean over its profiled steps), per
    collective kind (per step, the mean rank; its bus bandwidth, and that over ``priced_bytes_s``, the link the run
    was priced on, where given), per parallel dimension where the trace names the groups, overlap achieved, and the
    slowest rank by phase."""
    from ..plan.whatif import moved_bytes  # torch-free, as this module is

    traces = load_traces(run_dir)
    ranks: dict[int, dict[str, Any]] = {}
    kinds: dict[str, dict[str, list]] = {}
    dims: dict[str, dict[str, float]] = {}
    for rank, files in sorted(traces.items()):
        steps = [s for t in files for s in t.steps]
        if not steps:
            continue
        n = len(steps)
        mean = {k: sum(getattr(s, k) for s in steps) / n
                for k in ("step_ms", "compute_ms", "comm_ms", "exposed_ms", "overlap_ms", "idle_ms", "host_ms",
                          "compress_ms", "payload_calls")}
        mean["payload_bytes"] = (sum(s.payload_bytes for s in steps) / n
                                 if all(s.payload_bytes is not None for s in steps) else None)
        # launch overhead: defined on a GPU trace only (None on a CPU one: nothing is launched)
        mean["launch_ms"] = (sum(s.launch_ms for s in steps) / n
                             if all(s.launch_ms is not None for s in steps) else None)
        mean["overlap_share"] = mean["overlap_ms"] / mean["comm_ms"] if mean["comm_ms"] > 0 else None
        mean["buckets"] = _mean_buckets([s.buckets for s in steps])
        ranks[rank] = {"device": files[0].device, "steps": [s.step for s in steps], **mean,
                       "files": [str(t.path) for t in files]}
        for s in steps:
            for kind, v in s.kinds.items():
                k = kinds.setdefault(kind, {"count": [], "bytes": [], "ms": [], "group_size": []})
                for key in ("count", "bytes", "ms", "group_size"):
                    k[key].append(v.get(key))
            for dim, v in s.dims.items():
                d = dims.setdefault(dim, {"ms": 0.0, "exposed_ms": 0.0})
                d["ms"] += v["ms"]
                d["exposed_ms"] += v["exposed_ms"]
    if not ranks:
        return None
    samples = sum(len(r["steps"]) for r in ranks.values())
    world = max(len(ranks), 1)
    per_kind = {}
    for kind, v in sorted(kinds.items()):
        row = {"count_per_step": sum(v["count"]) / samples,
               "bytes_per_step": sum(v["bytes"]) / samples if None not in v["bytes"] else None,
               "ms_per_step": sum(v["ms"]) / samples}
        sizes = [g for g in v["group_size"] if g]
        n = max(sizes) if sizes else world  # the trace's own group size, else the run's ranks
        moved = moved_bytes(_COST_OPS.get(kind, kind), row["bytes_per_step"], n) if (
            row["bytes_per_step"] and n > 1) else 0.0
        bus = moved / (row["ms_per_step"] / 1e3) if moved and row["ms_per_step"] > 0 else None
        row.update({"group_size": n, "bus_bytes_s": bus,
                    "of_priced": bus / priced_bytes_s if bus and priced_bytes_s else None})
        per_kind[kind] = row
    comm = sum(r["comm_ms"] for r in ranks.values())
    slowest = {PHASES[k]: max(ranks, key=lambda r: ranks[r][k]) for k in PHASES
               if all(v[k] is not None for v in ranks.values())} if len(ranks) > 1 else {}
    launch = [r["launch_ms"] for r in ranks.values()]
    return {"ranks": ranks, "collectives": per_kind, "slowest_rank": slowest, "priced_bytes_s": priced_bytes_s,
            "dimensions": {d: {k: x / samples for k, x in v.items()} for d, v in sorted(dims.items())},
            "overlap_share": sum(r["overlap_ms"] for r in ranks.values()) / comm if comm > 0 else None,
            "exposed_share": (sum(r["exposed_ms"] for r in ranks.values())
                              / max(sum(r["step_ms"] for r in ranks.values()), 1e-9)),
            # launch overhead's share of the steps: None where a rank's trace is a CPU one (nothing launched)
            "launch_share": (sum(launch) / max(sum(r["step_ms"] for r in ranks.values()), 1e-9)
                             if None not in launch else None)}


# ---- causes named from the trace ---------------------------------------------------------------------------------
#: the parts of the step (:func:`parts`) in which each cause's time shows in a trace: what planting or removing
#: the cause changes (compared between two runs' traces by :func:`added_ms`). The bucket size moves time between
#: two parts: how much of the collectives the backward hides (exposed) and what the backward itself does for them
#: (DDP copies each gradient into its bucket and issues a collective per bucket from inside the backward; on a CPU
#: the collectives' threads share the cores with it: compute)
CAUSE_PARTS = {"straggler": ("wait",), "compression": ("compress", "exposed"),
               "buckets_too_small": ("compute", "exposed"), "buckets_too_large": ("compute", "exposed"),
               "link": ("exposed",), "pipeline_bubble": ("bubble",)}


def lateness(t: dict[str, Any], rank: Any) -> float:
    """How much later than the others ``rank`` arrives at the collectives, by the trace (ms per step): the median
    of the other ranks' exposed communication less its own (they wait for it there); negative where it is early."""
    exposed = {r: v["exposed_ms"] for r, v in t["ranks"].items()}
    others = [x for r, x in exposed.items() if r != rank]
    return statistics.median(others) - exposed[rank] if others and rank in exposed else 0.0


def parts(t: dict[str, Any]) -> dict[str, Any]:
    """A trace summary's step in the parts causes show in (ms per step):

    - ``step``, ``compute``, ``compress``, ``idle``: the mean rank's;
    - ``exposed``: the least any rank's (waiting for a late peer is that peer's cause, not the link's);
    - ``wait``: the :func:`lateness` of the rank the others wait for (the one with the least exposed communication),
      ``late_rank`` that rank (None with one rank);
    - ``bubble``: the mean rank's exposed communication — in a pipeline, the stages waiting for each other's
      activations and gradients (the sends and receives are communication)."""
    ranks = t["ranks"]
    n = max(len(ranks), 1)
    mean = lambda k: sum(v[k] for v in ranks.values()) / n  # noqa: E731
    exposed = {r: v["exposed_ms"] for r, v in ranks.items()}
    late = min(exposed, key=exposed.get) if len(exposed) > 1 else None
    return {"step": mean("step_ms"), "compute": mean("compute_ms"), "compress": mean("compress_ms"),
            "idle": mean("idle_ms"), "exposed": min(exposed.values()) if exposed else 0.0,
            "wait": max(0.0, lateness(t, late)) if late is not None else 0.0, "late_rank": late,
            "bubble": mean("exposed_ms"), "payload_calls": mean("payload_calls"),
            "payload_bytes": (sum(v["payload_bytes"] for v in ranks.values()) / n
                              if all(v["payload_bytes"] is not None for v in ranks.values()) else None)}


def added_ms(with_cause: dict[str, Any], without: dict[str, Any], cause: str) -> float:
    """What a cause adds to the step by two runs' traces, with it and without it (summaries): the change of the parts
    it shows in (:data:`CAUSE_PARTS`), ms per step. A straggler's is its lateness beyond the lateness the same rank
    already had without the cause (none where it was early: the slack a late rank first uses up costs no time)."""
    a, b = parts(with_cause), parts(without)
    if cause == "straggler":
        r = a["late_rank"]
        return a["wait"] - max(0.0, lateness(without, r)) if r is not None else 0.0
    return sum(a[p] - b[p] for p in CAUSE_PARTS[cause])


def name_causes(t: dict[str, Any], *, pp: int = 1, compressor: str = "none", grad_bytes: Optional[float] = None,
                min_share: float = 0.05, wait_ratio: float = 0.10, small_calls: int = 8,
                bucket_cap_mb: float = 25.0) -> list[dict[str, Any]]:
    """The causes the trace alone names, each with its milliseconds per step and the trace's evidence, most first
    (those under ``min_share`` of the step left out):

    - ``pipeline_bubble`` (pp > 1): the stages' exposed communication (``bubble``: waiting for each other);
    - ``straggler`` (pp 1, 2+ ranks): the others' communication is exposed longer than one rank's by ``wait``, at
      least ``wait_ratio`` of the compute — they waited for that rank inside the collectives;
    - ``compression``: the compressor's labelled work on the critical path (``compress``);
    - with the gradients sent as they are (compressor none, pp 1), the exposed communication (the least any rank's),
      named by how the gradients went: ``buckets_too_small`` where more payload collectives ran per step than
      ``small_calls`` and twice what ``bucket_cap_mb`` buckets would make, ``buckets_too_large`` where one or two
      carried ≥ 1 MiB (nothing left to overlap the backward with), else ``link``."""
    p = parts(t)
    step = max(p["step"], 1e-9)
    out: list[dict[str, Any]] = []
    if pp > 1:
        out.append({"cause": "pipeline_bubble", "ms": p["bubble"],
                    "evidence": f"the {pp} pipeline stages wait {p['bubble']:,.1f} ms of their {step:,.1f} ms step "
                                "for each other's activations and gradients (exposed sends and receives, mean rank; "
                                f"they compute {p['compute']:,.1f} ms)"})
    elif len(t["ranks"]) > 1 and p["wait"] >= wait_ratio * max(p["compute"], 1e-9):
        r = p["late_rank"]
        out.append({"cause": "straggler", "ms": p["wait"], "rank": r,
                    "evidence": f"the other ranks' communication is exposed {p['wait']:,.1f} ms longer per step than "
                                f"rank {r}'s ({t['ranks'][r]['exposed_ms']:,.1f} ms): they wait for rank {r} inside "
                                "the collectives"})
    if p["compress"] > 0:
        out.append({"cause": "compression", "ms": p["compress"],
                    "evidence": f"the {compressor} compressor works {p['compress']:,.1f} ms per step while nothing "
                                "computes or communicates (its labelled encode and decode, mean rank)"})
    if pp == 1 and compressor.split(":", 1)[0] in ("none", "") and len(t["ranks"]) > 1 and p["exposed"] > 0:
        calls, sent = p["payload_calls"], p["payload_bytes"]
        grad = grad_bytes if grad_bytes else sent
        made = max(1, math.ceil((grad or 0) / (bucket_cap_mb * 2**20)))
        what = (f"{calls:.0f} payload collective{'s' if round(calls) != 1 else ''} per step"
                + (f" ({sent / 2**20:,.2f} MiB)" if sent is not None else ""))
        if calls > max(small_calls, 2 * made):
            cause, why = "buckets_too_small", f"{what}: more than {max(small_calls, 2 * made)}, each its own call"
        elif calls <= 2 and (grad or 0) >= 2**20:
            cause, why = "buckets_too_large", (f"{what}: the gradients go in one or two buckets, nothing left to "
                                               "overlap the backward with")
        else:
            cause, why = "link", what
        out.append({"cause": cause, "ms": p["exposed"],
                    "evidence": f"{p['exposed']:,.1f} ms of communication per step nothing computed beside (the least "
                                f"exposed rank); {why}"})
    return sorted((x for x in out if x["ms"] >= min_share * step), key=lambda x: -x["ms"])


def timeline(run_dir: "str | Path") -> Optional[dict[str, Any]]:
    """One step every rank profiled (the last such: the steadiest), per rank its intervals in ms from the step's
    start (compute, exposed and overlapped communication, launch overhead on a GPU trace, per dimension where the
    trace names the groups) —
    what ``syncwise report`` draws; None without traces or without a step common to every rank."""
    traces = load_traces(run_dir)
    by_rank = {r: {s.step: s for t in files for s in t.steps} for r, files in traces.items()}
    common = set.intersection(*(set(v) for v in by_rank.values())) if by_rank else set()
    if not common:
        return None
    step = max(common)
    return {"step": step, "ranks": {r: {"step_ms": v[step].step_ms, **v[step].spans}
                                    for r, v in sorted(by_rank.items())}}


def sentences(t: dict[str, Any]) -> list[str]:
    """The trace's findings in words (the evidence doctor cites)."""
    ranks = t["ranks"]
    worst = max(ranks, key=lambda r: ranks[r]["exposed_ms"])
    w = ranks[worst]
    out = [f"rank {worst}: {w['exposed_ms']:,.1f} ms of its {w['step_ms']:,.1f} ms step is communication nothing "
           f"computed beside (exposed; {w['comm_ms']:,.1f} ms of communication in all, "
           + (f"{100 * w['overlap_share']:.0f} % overlapped with compute)" if w["overlap_share"] is not None
              else "none overlapped)")]
    if t["collectives"]:
        top = max(t["collectives"].items(), key=lambda kv: kv[1]["ms_per_step"])
        mb = (f", {top[1]['bytes_per_step'] / 1e6:,.2f} MB" if top[1]["bytes_per_step"] is not None else "")
        bus = top[1].get("bus_bytes_s")
        link = (f", {bus / 1e9:,.3f} GB/s bus bandwidth" + (f" = {100 * top[1]['of_priced']:.0f} % of the "
                f"{t['priced_bytes_s'] / 1e9:,.3f} GB/s the run was priced on" if top[1].get("of_priced") else "")
                if bus else "")
        out.append(f"the longest collective kind is {top[0]}: {top[1]['count_per_step']:.0f} per step{mb}, "
                   f"{top[1]['ms_per_step']:,.1f} ms per step{link}")
    if t.get("dimensions"):
        dim, v = max(t["dimensions"].items(), key=lambda kv: kv[1]["exposed_ms"])
        out.append(f"by parallel dimension, {dim}'s collectives are the most exposed: {v['exposed_ms']:,.1f} of their "
                   f"{v['ms']:,.1f} ms per step")
    if t.get("launch_share") is not None:
        most = max(ranks, key=lambda r: ranks[r]["launch_ms"])
        m = ranks[most]
        out.append(f"rank {most}: of its {m['idle_ms']:,.1f} ms of device idle per step, {m['launch_ms']:,.1f} ms is "
                   f"launch overhead (a kernel launch under way) and {m['host_ms']:,.1f} ms host-bound (nothing yet "
                   "asked of the device)")
    elif ranks:
        out.append("launch overhead: not defined on a CPU trace (nothing is launched); all idle is host-bound")
    if t["slowest_rank"]:
        out.append("slowest rank by phase: " + ", ".join(f"{p} rank {r}" for p, r in t["slowest_rank"].items()))
    line = bucket_sentence(ranks)
    if line:
        out.append(line)
    return out


def bucket_sentence(ranks: dict[Any, dict[str, Any]]) -> Optional[str]:
    """The most exposed gradient bucket of the least exposed rank (the others also wait for peers), in words."""
    have = {r: v for r, v in ranks.items() if v.get("buckets")}
    if not have:
        return None
    rank = min(have, key=lambda r: have[r]["exposed_ms"])
    buckets = have[rank]["buckets"]
    b = max(buckets, key=lambda x: x["exposed_ms"])
    mb = f", {b['bytes'] / 2**20:,.2f} MiB" if b["bytes"] is not None else ""
    mean = sum(x["overlap"] or 0.0 for x in buckets) / len(buckets)
    return (f"rank {rank}: the most exposed gradient bucket is {b['bucket']} of {len(buckets)}{mb}: "
            f"{b['exposed_ms']:,.1f} ms of its {b['ms']:,.1f} ms with nothing computed beside it (overlap achieved "
            f"{100 * (b['overlap'] or 0.0):.0f} %" + (f"; all {len(buckets)} buckets, mean {100 * mean:.0f} %)"
                                                      if len(buckets) > 1 else ")"))


#: the findings about communication (syncwise.doctor.analyze): what the trace's exposed communication is evidence for
COMM_CAUSES = ("link", "buckets_too_large", "buckets_too_small", "compression")


def cite(finding: Any, t: Optional[dict[str, Any]]) -> None:
    """Add the trace's evidence to a communication finding (its ``evidence`` sentence and ``details['trace']``):
    the exposed milliseconds the profiled steps show, by interval union, and the collective that took longest."""
    if not t or finding.cause not in COMM_CAUSES:
        return
    ranks = t["ranks"]
    worst = max(ranks, key=lambda r: ranks[r]["exposed_ms"])
    w = ranks[worst]
    top = max(t["collectives"].items(), key=lambda kv: kv[1]["ms_per_step"]) if t["collectives"] else None
    steps = sorted({s for r in ranks.values() for s in r["steps"]})
    bucket = bucket_sentence(ranks) if finding.cause.startswith("buckets") else None
    finding.evidence += (f"; the profiled step(s) {steps[0]}–{steps[-1]} agree: on rank {worst} "
                         f"{w['exposed_ms']:,.1f} ms of its {w['step_ms']:,.1f} ms step is communication nothing "
                         "computed beside" + (f", the longest collective {top[0]} ({top[1]['ms_per_step']:,.1f} ms "
                                             "per step)" if top else "") + (f"; {bucket}" if bucket else ""))
    finding.details["trace"] = {"rank": worst, "exposed_ms": w["exposed_ms"], "step_ms": w["step_ms"],
                                "launch_ms": w["launch_ms"], "host_ms": w["host_ms"],
                                "steps": steps, "collective": top[0] if top else None}


def print_traces(t: Optional[dict[str, Any]], console: Any) -> None:
    """The trace's section of ``syncwise doctor``'s output (nothing without traces)."""
    if not t:
        return
    from rich.table import Table

    steps = sorted({s for r in t["ranks"].values() for s in r["steps"]})
    table = Table(title=f"inside the profiled step(s) {', '.join(map(str, steps[:8]))}"
                  + (" ..." if len(steps) > 8 else "") + " (torch profiler traces, ms, mean per step)",
                  show_edge=False)
    # compute + exposed + compression + launch + host-bound = step (compression: a column where the run compressed)
    keys = ("step_ms", "compute_ms", "exposed_ms", *(("compress_ms",) if any(v.get("compress_ms") for v in
                                                                         t["ranks"].values()) else ()),
            "launch_ms", "host_ms", "comm_ms")
    words = {"step_ms": "step", "compute_ms": "compute", "exposed_ms": "exposed comm", "compress_ms": "compression",
             "launch_ms": "launch", "host_ms": "host-bound", "comm_ms": "comm (union)"}
    for col in ("rank", *(words[k] for k in keys), "overlapped"):
        table.add_column(col, justify="right")
    for r, v in sorted(t["ranks"].items()):
        table.add_row(str(r), *(f"{v[k]:,.1f}" if v[k] is not None else "n/a" for k in keys),
                      f"{100 * v['overlap_share']:.0f} %" if v["overlap_share"] is not None else "-")
    console.print(table)
    if t["collectives"]:
        kinds = Table(title="collectives in the trace (per step, the mean rank)", show_edge=False)
        for col in ("collective", "count", "MB", "ms (union)", "bus GB/s", "of priced link"):
            kinds.add_column(col, justify="left" if col == "collective" else "right")
        for kind, v in t["collectives"].items():
            kinds.add_row(kind, f"{v['count_per_step']:.1f}", f"{v['bytes_per_step'] / 1e6:,.3f}"
                          if v["bytes_per_step"] is not None else "-", f"{v['ms_per_step']:,.1f}",
                          f"{v['bus_bytes_s'] / 1e9:,.3f}" if v.get("bus_bytes_s") else "-",
                          f"{100 * v['of_priced']:.0f} %" if v.get("of_priced") else "-")
        console.print(kinds)
    if t.get("dimensions"):
        dims = Table(title="communication per parallel dimension (per step, the mean rank; groups named by the trace "
                           "or the flight recorder)", show_edge=False)
        for col in ("dimension", "ms (union)", "exposed ms"):
            dims.add_column(col, justify="left" if col == "dimension" else "right")
        for dim, v in t["dimensions"].items():
            dims.add_row(dim, f"{v['ms']:,.1f}", f"{v['exposed_ms']:,.1f}")
        console.print(dims)
    for line in sentences(t):
        console.print(f"trace: {line}.")
    for c in t.get("causes") or []:
        console.print(f"the trace names {c['cause']}: {c['ms']:,.1f} ms per step — {c['evidence']}.")
