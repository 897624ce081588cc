"""The one instrumented layer every syncwise collective goes through.

Thin wrappers over ``torch.distributed``: same semantics, plus a record in the ``stats`` given (a
:class:`~.stats.CommStats`, usually one kind of a run's :class:`~.stats.CommLedger`; None: counted nowhere) of the
op, the payload bytes this rank contributes (the input tensor's size) split per hop by the collective's pattern
over its group (:func:`split_bytes`: a ring's N_g / W across nodes, an all-to-all's chunks for other nodes, a
broadcast's group whole) and the duration. Asynchronous calls return the usual work handle; their duration is
recorded when their future completes.

Durations (issue 24): NCCL collectives return at *enqueue*, so a host clock measures the launch. For CUDA
tensors on an NCCL communicator the duration is a pair of CUDA events (:mod:`.timing`): the start on the
current stream before the call, the end on a timing side stream made to wait for the collective
(``work.wait()`` there: a stream wait, no host block), read when it has completed; the collective stays in the
in-flight set the watchdog reads until that end event has completed.

Strict devices (``SYNCWISE_STRICT_DEVICES=1``, on for the whole test suite, see tests/conftest.py): every
collective is checked against the backend its group would have on a GPU run (:func:`declare_backend`; the
default is :data:`syncwise.devices.NCCL_PROCESS_GROUP`): a tensor on a device type that backend has no
communicator for (a CPU tensor on an NCCL-only group: issue 24's "No backend type associated with device type
cpu"), or a CUDA tensor on another GPU than the group's bound one, raises :class:`StrictDeviceError` on the
CPU, before any GPU sees it.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..profiling import WAIT_LABEL
from .stats import CommStats
from .timing import Interval

ReduceOpName = str
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
# torch renamed the *_into_tensor collectives; keep working on torch>=2.5.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(op: "ReduceOpName | dist.ReduceOp") -> dist.ReduceOp:
    """Map 'sum' | 'avg' | 'max' | 'min' | 'product' (or a ReduceOp) to a ReduceOp."""
    if isinstance(op, str):
        try:
            return _REDUCE_OPS[op.lower()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; accepted: {', '.join(_REDUCE_OPS)}") from None
    return op


# ---- strict devices: the check that would have caught issue 24's first row on a CPU ----------------------
STRICT_ENV = "SYNCWISE_STRICT_DEVICES"


class StrictDeviceError(RuntimeError):
    """A collective whose tensor a GPU run's communicator could not take (see the module docstring)."""


def strict() -> bool:
    """True when ``SYNCWISE_STRICT_DEVICES`` is set to a true value (1/true/yes/on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


_default_backend: Optional[str] = None  # declared for the default group (None: devices.NCCL_PROCESS_GROUP)
_group_backends: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


def declare_backend(backend: Optional[str], group=None) -> None:
    """Record the backend string ``group`` (None: the default group, and every group inheriting it) has — or,
    on a CPU run, would have on a GPU run. The worker and ``join_torchrun`` declare what they pass to
    ``init_process_group`` on a GPU; :func:`new_group` declares an explicit backend."""
    global _default_backend
    if group is None or group is dist.group.WORLD:
        _default_backend = backend
    elif backend is not None:
        _group_backends[group] = backend


def declared_backend(group=None) -> str:
    """The backend string the strict check holds ``group`` to."""
    if group is not None and group is not dist.group.WORLD:
        try:
            found = _group_backends.get(group)
        except TypeError:
            found = None
        if found is not None:
            return found
    if _default_backend is not None:
        return _default_backend
    from ..devices import NCCL_PROCESS_GROUP

    return NCCL_PROCESS_GROUP


@functools.lru_cache(maxsize=64)
def _device_types(backend: str) -> frozenset:
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    return frozenset(BackendConfig(Backend(backend)).get_device_backend_map())


def check_devices(op: str, tensors: "list[torch.Tensor]", group=None) -> None:
    """Raise :class:`StrictDeviceError` if a GPU run's communicator for ``group`` could not take ``tensors``
    (see the module docstring). Called by every collective here when :func:`strict` is on."""
    backend = declared_backend(group)
    types = _device_types(backend)
    bound = None
    try:
        pg = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        bound = getattr(pg, "bound_device_id", None)
    except (RuntimeError, ValueError):
        pass
    for t in tensors:
        dev = t.device
        if dev.type not in types:
            raise StrictDeviceError(
                f"{op} of a {dev.type} tensor ({tuple(t.shape)}, {t.dtype}) on process group "
                f"'{group_name(group)}', whose backend on a GPU run is '{backend}': it has no communicator for "
                f"{dev.type} tensors ('No backend type associated with device type {dev.type}'). Put the tensor "
                f"on the group's device, or give the group a {dev.type} backend (syncwise.devices."
                f"NCCL_PROCESS_GROUP). [{STRICT_ENV}=1]")
        if dev.type == "cuda" and bound is not None and bound.type == "cuda" and dev.index != bound.index:
            raise StrictDeviceError(
                f"{op} of a tensor on {dev} on process group '{group_name(group)}', bound to {bound}: every rank "
                f"must use its own GPU (torch.cuda.set_device(local_rank) before creating tensors). "
                f"[{STRICT_ENV}=1]")


#: Under strict devices, every collective issued here, per (group name, op, half): the communicator its group's
#: GPU-run backend gives a step's data tensors (CUDA; 'nccl' on a devices.NCCL_PROCESS_GROUP group) or, on a group
#: without a CUDA communicator (preemption's, the checkpoint's), 'gloo'. A test takes the difference between two
#: runs of different lengths to get a steady step's collectives (tests/test_strict_control.py): on a GPU run every
#: one on a 'gloo' half, and every host tensor on another group than the gradient sync's, is control traffic
#: through gloo (docs/gpu.md "Control traffic").
STRICT_COUNTS: "collections.Counter[tuple[str, str, str]]" = collections.Counter()
_counts_lock = threading.Lock()


@functools.lru_cache(maxsize=64)
def _data_half(backend: str) -> str:
    """The communicator a group of ``backend`` gives CUDA tensors ('nccl' / 'gloo'); a CPU-only one: its CPU one."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    route = BackendConfig(Backend(backend)).get_device_backend_map()
    return str(route["cuda"] if "cuda" in route else route.get("cpu", "gloo"))


def _count(op: str, group) -> None:
    desc = "default" if group is None or group is dist.group.WORLD else (getattr(group, "group_desc", None)
                                                                          or "unnamed")
    with _counts_lock:
        STRICT_COUNTS[(desc, op, _data_half(declared_backend(group)))] += 1


# ---- timeouts and the collectives in flight (what a hang report names) -----------------------------
_timeout: Optional[timedelta] = None
_in_flight: dict[int, "InFlight"] = {}
_tokens = itertools.count()
_last_failed: "Optional[InFlight]" = None


@dataclass(frozen=True)
class InFlight:
    """A collective issued through this module and not completed yet."""

    op: str
    group: object  # the process group (None: the default one); named only when a report needs it
    started: Optional[float]  # time.monotonic(); None for torch's own collective found in a traceback
    interval: Optional[Interval] = None  # CUDA events of an NCCL collective: in flight until its end completed
    #: an async collective's tensors, owned by this record until the collective completed (issue 39 N1): NCCL's
    #: ``work.wait()`` on the timing stream releases the work's own stash, and a caller that drops its input before
    #: waiting (SparseLoCo's payload) would hand the block back to the allocator while NCCL still reads it
    tensors: tuple = field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        if self.group is UNKNOWN_GROUP:
            return self.op
        return f"{self.op} on process group '{group_name(self.group)}'"


UNKNOWN_GROUP = object()  # InFlight.group of torch's collective waited on without its call in the traceback


def set_collective_timeout(seconds: Optional[float]) -> None:
    """The job's collective timeout (``--dist.timeout_s``): groups made by :func:`new_group` get it too."""
    global _timeout
    _timeout = timedelta(seconds=seconds) if seconds else None


#: seconds NCCL's own timeout is set above syncwise's (issue 39 N7): NCCL's watchdog aborts the communicator at its
#: timeout and tears the process down, so at the same value syncwise's report (the watchdog's, at timeout + its grace
#: of 2 s, checked every 1 s) never printed. gloo raises in the waiting thread, which the trainer reports: no margin.
NCCL_TIMEOUT_MARGIN_S = 30.0


def backend_timeout(seconds: Optional[float], backend: Optional[str]) -> Optional[timedelta]:
    """The timeout a process group of ``backend`` gets for syncwise's collective timeout ``seconds``: the same on
    gloo, :data:`NCCL_TIMEOUT_MARGIN_S` more where the group has an NCCL communicator (so syncwise reports first)."""
    if not seconds:
        return None
    margin = NCCL_TIMEOUT_MARGIN_S if backend is not None and "nccl" in str(backend) else 0.0
    return timedelta(seconds=seconds + margin)


def _group_timeout(backend: Optional[str] = None) -> Optional[timedelta]:
    """The job's timeout for a group of ``backend`` (None: the default group's)."""
    if _timeout is None:
        return None
    if backend is None:
        try:
            backend = str(dist.get_backend())
        except (RuntimeError, ValueError):
            backend = None
    return backend_timeout(_timeout.total_seconds(), backend)


def collective_timeout_s() -> Optional[float]:
    return _timeout.total_seconds() if _timeout is not None else None


def new_group(ranks: Optional[list[int]] = None, backend: Optional[str] = None, desc: str = "syncwise", *,
              like=None):
    """``dist.new_group`` with the job's timeout (torch's own default is 30 min, so a side communicator —
    compression, checkpoint saving — would outlast ``--dist.timeout_s`` by far) and a name for reports.

    ``backend``: an explicit backend ('gloo': a host-only side group), which the strict check holds the group to on
    every run. ``like``: a group (None with no ``backend``: the default one) whose backend the new group takes —
    its backend on this run, and for the strict check the one it has on a GPU run (a CPU run's 'gloo' default group
    is declared devices.NCCL_PROCESS_GROUP): a group made as a copy of the training's is held to the GPU run's rule,
    not to this run's gloo, which takes every tensor (issue 39 N8)."""
    if like is not None:
        if backend is not None:
            raise ValueError("new_group: give backend or like, not both")
        backend = str(dist.get_backend(like))
    try:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=_group_timeout(backend), group_desc=desc)
    except TypeError:  # torch without group_desc
        group = dist.new_group(ranks=ranks, backend=backend, timeout=_group_timeout(backend))
    if backend is not None and group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        # an explicit backend: the strict check holds the group to it; a copy: to what the original is held to
        declare_backend(declared_backend(like) if like is not None else backend, group)
    return group


def adopt_group(group) -> None:
    """Give a process group torch created — a DeviceMesh dimension: ``init_device_mesh`` and ``_flatten`` make their
    subgroups with torch's default timeout, 30 min on gloo — the job's collective timeout, as :func:`new_group` gives
    syncwise's own. Without it a rank stopped inside FSDP2's collectives on such a group (HSDP's all-reduce across
    replicas) was never reported: the waiting ranks sat there for 30 min (issue 23). No-op without a job timeout."""
    if _timeout is None or group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        backend = None
    dist.distributed_c10d._set_pg_timeout(_group_timeout(backend), group)


def group_device(group=None) -> torch.device:
    """Where a control tensor for ``group`` lives: this rank's GPU when the group's CUDA communicator is NCCL,
    else the CPU (gloo; an NCCL job's groups also have a gloo half, devices.NCCL_PROCESS_GROUP)."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_name(group=None) -> str:
    """'default [0, 1]', 'compress [0, 1]' ...: the group a report names."""
    try:
        desc = "default" if group is None else (getattr(group, "group_desc", None) or "unnamed")
        return f"{desc} {dist.get_process_group_ranks(group or dist.group.WORLD)}"
    except (RuntimeError, ValueError, AttributeError):
        return "default" if group is None else "unnamed"


# ---- hops: which link a group's collectives cross ------------------------------------------------------------
_procs_per_node: Optional[int] = None  # declared by CommContext (its Topology); else torchrun's LOCAL_WORLD_SIZE
_hops: "weakref.WeakKeyDictionary[object, Optional[str]]" = weakref.WeakKeyDictionary()


def declare_topology(procs_per_node: Optional[int]) -> None:
    """The ranks per node of this job (node-major numbering, as ``comm.Topology``); None: read LOCAL_WORLD_SIZE."""
    global _procs_per_node
    _procs_per_node = procs_per_node
    _hops.clear()
    _shares.clear()


def procs_per_node() -> Optional[int]:
    """Ranks per node: the declared topology's, else torchrun's LOCAL_WORLD_SIZE (when it divides WORLD_SIZE);
    None when neither is known."""
    if _procs_per_node is not None:
        return _procs_per_node
    try:
        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ.get("WORLD_SIZE", "0"))
    except (KeyError, ValueError):
        return None
    return local if local >= 1 and world >= local and world % local == 0 else None


def _placed_ranks(pg) -> "Optional[tuple[list[int], int]]":
    """(the global ranks of ``pg``, ranks per node), or None when the topology or the group's ranks are not known:
    what :func:`hop_of` and :func:`cross_share` classify."""
    per = procs_per_node()
    if per is None:
        return None
    try:
        return dist.get_process_group_ranks(pg), per
    except (RuntimeError, ValueError, AttributeError):
        return None


def hop_of(group=None) -> Optional[str]:
    """'intra' when every rank of ``group`` (None: the default group) is on one node, 'cross' when it spans nodes,
    None when the topology is not known (no CommContext topology, no LOCAL_WORLD_SIZE) or no group exists.
    Cached per group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        if pg in _hops:
            return _hops[pg]
    except TypeError:  # not weak-referenceable: classify every time
        pass
    placed = _placed_ranks(pg)
    if placed is None:
        return None
    ranks, per = placed
    hop = "intra" if len({r // per for r in ranks}) <= 1 else "cross"
    try:
        _hops[pg] = hop
    except TypeError:
        pass
    return hop


#: the traffic patterns :func:`cross_share` knows: a ring (all-gather, reduce-scatter, all-reduce) and an all-to-all
PATTERNS = ("ring", "all_to_all")
_shares: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def cross_share(group=None, pattern: str = "ring") -> Optional[float]:
    """The fraction of this rank's bytes in a ``pattern`` collective over ``group`` that crosses between nodes (the
    rest stays inside a node); None when the topology is not known (as :func:`hop_of`). A group inside one node: 0.

    - ``ring`` (all-gather, reduce-scatter, all-reduce): the ring through the group's ranks in rank order (node-major
      numbering, as ``comm.Topology``: each node's ranks are neighbours) has W links, one per rank, and each link
      carries the same bytes in every step of a ring collective. It leaves a node once per node it visits, so N_g of
      its W links cross (N_g: the nodes the group spans; the fewest any ring through N_g nodes can have, which is
      the ring NCCL builds): the share is N_g / W — the group's mean, the same for every rank (a ring's boundary rank
      sends all of its bytes across, the others none; per node, what the NIC carries is one rank's bytes). One rank
      per node: 1 (every byte crosses, as :func:`hop_of`'s 'cross').
    - ``all_to_all``: this rank sends one equal chunk to every rank of the group (its own included): the chunks for
      ranks on other nodes cross, (W − ranks of the group on this rank's node) / W of its bytes.

    Cached per group and pattern (cleared by :func:`declare_topology`)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r}: one of {PATTERNS}")
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        cached = _shares.get(pg)
    except TypeError:
        cached = None
    if cached is not None and pattern in cached and cached.get("_per") == procs_per_node():
        return cached[pattern]
    placed = _placed_ranks(pg)
    if placed is None:
        return None
    ranks, per = placed
    share = ring_cross_share(ranks, per) if pattern == "ring" else \
        all_to_all_cross_share(ranks, per, dist.get_rank())
    try:
        _shares.setdefault(pg, {"_per": per})[pattern] = share
    except TypeError:
        pass
    return share


def ring_cross_share(ranks: "list[int]", per_node: int) -> float:
    """:func:`cross_share`'s ring formula on global ``ranks`` (in group order) with ``per_node`` ranks per node: the
    links r_i → r_{i+1 mod W} that join two nodes, over W."""
    w = len(ranks)
    if w <= 1:
        return 0.0
    nodes = [r // per_node for r in ranks]
    return sum(nodes[i] != nodes[(i + 1) % w] for i in range(w)) / w


def all_to_all_cross_share(ranks: "list[int]", per_node: int, me: int) -> float:
    """:func:`cross_share`'s all-to-all formula: the group's ranks on another node than global rank ``me``, over W."""
    if not ranks:
        return 0.0
    mine = me // per_node
    return sum(r // per_node != mine for r in ranks) / len(ranks)


def split_bytes(nbytes: int, group=None, pattern: str = "ring") -> Optional[dict]:
    """``{'intra': .., 'cross': ..}`` for ``nbytes`` of a ``pattern`` collective over ``group`` (they add up to
    ``nbytes``); None when the topology is not known."""
    share = cross_share(group, pattern)
    if share is None:
        return None
    cross = int(round(nbytes * share))
    return {"intra": int(nbytes) - cross, "cross": cross}


def uneven_all_to_all_split(sent: "list[int]", group=None) -> Optional[dict]:
    """``{'intra': .., 'cross': ..}`` of an all-to-all that sends ``sent[j]`` bytes to the group's rank j (uneven
    splits: the expert dispatch's): the bytes for ranks on another node than this rank's cross. None when the
    topology is not known."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    placed = _placed_ranks(group if group is not None else dist.group.WORLD)
    if placed is None:
        return None
    ranks, per = placed
    if len(sent) != len(ranks):
        return None
    mine = dist.get_rank() // per
    cross = sum(int(n) for r, n in zip(ranks, sent) if r // per != mine)
    return {"intra": sum(int(n) for n in sent) - cross, "cross": cross}


def _row_bytes(input: torch.Tensor, input_split_sizes: Optional[list[int]]) -> "Optional[list[int]]":
    """The bytes an ``all_to_all_single`` with ``input_split_sizes`` (rows of dim 0 per rank) sends to each rank;
    None for even splits (:func:`cross_share`'s all-to-all formula)."""
    if not input_split_sizes:
        return None
    row = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
    return [int(n) * row for n in input_split_sizes]


def _prune_in_flight() -> None:
    """Drop CUDA-timed collectives whose end event has completed."""
    for token, f in list(_in_flight.items()):
        if f.interval is not None and f.interval.done():
            _release(token)


def oldest_in_flight() -> Optional[InFlight]:
    """The longest-running collective not completed yet (None if none)."""
    _prune_in_flight()
    items = list(_in_flight.values())
    return min(items, key=lambda f: f.started) if items else None


def _chain(exc: BaseException) -> list:
    """``exc`` and the exceptions it was raised from, outermost first (a wrapper such as the pipeline stage's
    "failed to run forward" carries the collective's timeout as its cause)."""
    out: list = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a collective's timeout."""
    return any("timed out" in str(x).lower() or "timeout" in str(x).lower() for x in _chain(exc))


#: what gloo and NCCL say when a peer of the group died mid-collective (its socket closed, its communicator aborted)
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited",
              "communicator was aborted", "ncclremoteerror")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, says a peer left the group during a collective."""
    return any(any(m in str(x).lower() for m in _PEER_LOST) for x in _chain(exc))


def last_failed(exc: Optional[BaseException] = None) -> Optional[InFlight]:
    """The collective that raised ``exc`` (e.g. timed out), else the last one issued here that raised.

    A collective torch issues itself (FSDP2's all-gather, reduce-scatter and HSDP all-reduce, DTensor's, the
    pipeline schedule's) never passes through this module; when ``exc``'s traceback ends in one, it is named from
    the traceback: the ``torch.distributed`` call and the ``group`` it was given (issue 23: HSDP's stopped rank was
    reported as "DDP's gradient all-reduce on process group 'default'")."""
    found = _torch_collective(_chain(exc)[-1]) if exc is not None else None  # where it was raised first
    return found if found is not None else _last_failed


_TORCH_OWNERS = (("/fsdp/", "FSDP2's "), ("/tensor/", "DTensor's "), ("/pipelining/", "the pipeline schedule's "),
                 ("/nn/parallel/", "DDP's "))
_TORCH_OPS = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
              "all_to_all_single": "all_to_all", "batch_isend_irecv": "send/recv"}


def _torch_collective(exc: BaseException) -> Optional[InFlight]:
    """The innermost ``torch.distributed.distributed_c10d`` collective in ``exc``'s traceback, unless it was issued
    through this module (then :data:`_last_failed` already names it); who called it (FSDP2, DTensor, ...) in front."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if any(f.f_code.co_filename == __file__ for f in frames):
        return None
    c10d = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith("distributed_c10d.py")
            and not f.f_code.co_name.startswith("_")]
    end = c10d[-1] if c10d else len(frames)
    owner = next((label for f in reversed(frames[:end]) for part, label in _TORCH_OWNERS
                  if part in f.f_code.co_filename.replace("\\", "/") and "/torch/" in f.f_code.co_filename), "")
    if not c10d:  # a wait() on an async collective (a C++ call): who waited, without the group
        return InFlight(f"one of {owner}collectives (waited for in {frames[-1].f_code.co_name})", UNKNOWN_GROUP,
                        None) if owner else None
    name = frames[end].f_code.co_name
    return InFlight(owner + _TORCH_OPS.get(name, name), frames[end].f_locals.get("group"), None)


_timing_streams: dict = {}
_timing_lock = threading.Lock()


def timing_stream_key(device: torch.device, group=None) -> tuple:
    """Which timing stream times a collective: one per (device, group) (issue 39 N11). A stream waits for its
    collectives in issue order, so with one per device a long async collective (DiLoCo's outer average) held back
    the end events of every later one on other groups and inflated their times."""
    return (device, "default" if group is None or group is dist.group.WORLD else id(group))


def _timing_stream(device: torch.device, group=None) -> "torch.cuda.Stream":
    key = timing_stream_key(device, group)
    with _timing_lock:
        stream = _timing_streams.get(key)
        if stream is None:
            stream = _timing_streams[key] = torch.cuda.Stream(device=device)
        return stream


def _nccl_timed(tensor: Optional[torch.Tensor], group) -> bool:
    """True for a CUDA tensor on a group whose CUDA communicator is NCCL: time it by events."""
    if tensor is None or tensor.device.type != "cuda":
        return False
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False


class _Uncounted:
    """Where a collective given no ``stats`` records: nowhere (a sink that keeps nothing, shared by all)."""

    __slots__ = ()

    def record(self, op: str, nbytes: int, seconds: float = 0.0, hop: Optional[str] = None) -> None:
        pass

    def add_time(self, op: str, seconds: float) -> None:
        pass

    def add_interval(self, op: str, interval: object) -> None:
        pass


_NOWHERE = _Uncounted()


def labelled(label: str) -> "contextlib.AbstractContextManager":
    """``label`` around what follows while a profiler records (doctor reads syncwise's labels from the trace), else
    nothing: one flag read, so the trainer's tax is unchanged with profiling off."""
    if torch.autograd.profiler._is_profiler_enabled:  # process-wide (the C check is the calling thread's)
        return torch.autograd.profiler.record_function(label)
    return contextlib.nullcontext()


def _issue(name: str, nbytes: int, fn, async_op: bool, stats: Optional[CommStats], group=None,
           tensors: "tuple[torch.Tensor, ...]" = (), pattern: Optional[str] = "ring", splits=None):
    """Run one collective, recorded in ``stats`` with its bytes per hop: split by ``pattern`` over ``group``
    (:func:`split_bytes`: a ring's N_g / W across, an all-to-all's chunks for other nodes — ``splits``: the bytes
    it sends to each rank of the group, when uneven), or whole by :func:`hop_of` (``pattern`` None: a broadcast)."""
    if stats is None:
        stats = _NOWHERE
    if tensors and strict():
        check_devices(name, list(tensors), group)
        _count(name, group)
    hop = None
    if stats is not _NOWHERE:
        if pattern is None:
            hop = hop_of(group)
        elif splits is not None:
            hop = uneven_all_to_all_split(splits, group)
        else:
            hop = split_bytes(nbytes, group, pattern)
    if tensors and _nccl_timed(tensors[0], group):
        return _issue_nccl(name, nbytes, fn, async_op, stats, group, tensors, hop)
    start = time.perf_counter()
    with contextlib.nullcontext() if async_op else labelled(WAIT_LABEL + name):  # the host waits in it
        token, record, work = _launch(name, group, fn, tensors=tensors if async_op else ())
    if not async_op:
        _in_flight.pop(token, None)
        stats.record(name, nbytes, time.perf_counter() - start, hop)
        return None
    stats.record(name, nbytes, hop=hop)

    def _done(fut):
        global _last_failed
        _release(token)
        stats.add_time(name, time.perf_counter() - start)
        try:
            return fut.value()
        except BaseException:
            _last_failed = record
            raise

    try:
        work.get_future().then(_done)
    except RuntimeError:  # e.g. gloo's reduce_scatter has no future: time it at wait() instead
        return _TimedWork(work, name, start, stats, token)
    return work


class StrictLifetimeError(RuntimeError):
    """An async collective completed after its tensors were released (strict devices: ``SYNCWISE_STRICT_DEVICES``)."""


def _release(token: int) -> None:
    """The collective of ``token`` completed: its record leaves the in-flight set and lets its tensors go. Strict:
    check the record still owned every tensor up to here (the one lifetime rule, issue 39 N1)."""
    record = _in_flight.pop(token, None)
    if record is not None and strict() and any(t is None or not torch.is_tensor(t) for t in record.tensors):
        raise StrictLifetimeError(f"{record.describe()} completed after its tensors were released [{STRICT_ENV}=1]")


def _launch(name: str, group, fn, interval: Optional[Interval] = None, tensors: tuple = ()):
    """Call ``fn`` (the collective) with its record in the in-flight set; a collective that raises is remembered
    as the last failed one and leaves the set. ``tensors``: an async collective's, owned by the record until it
    completed. Returns (token, record, work)."""
    global _last_failed
    token = next(_tokens)
    record = _in_flight[token] = InFlight(name, group, time.monotonic(), interval, tuple(tensors))
    try:
        work = fn()
    except BaseException:
        _last_failed = record
        _in_flight.pop(token, None)
        raise
    return token, record, work


def _issue_nccl(name: str, nbytes: int, fn, async_op: bool, stats: CommStats, group, tensors: tuple,
                hop: "Optional[str | dict]" = None):
    """A CUDA collective on NCCL: events around it (see the module docstring); never blocks the host. An async one's
    tensors stay owned by its in-flight record until its end event completed (pruned then)."""
    device = tensors[0].device
    _prune_in_flight()  # releases the tensors of the collectives that have completed since
    interval = Interval(device).start()  # current stream: NCCL's stream waits for it before starting
    _, _, work = _launch(name, group, fn, interval, tensors if async_op else ())
    if not async_op:
        interval.stop()  # the sync call made the current stream wait for the collective
    else:
        side = _timing_stream(device, group)
        with torch.cuda.stream(side):
            work.wait()  # a stream wait (no host block): the side stream reaches the end with the collective
            interval.stop(side)
    stats.record(name, nbytes, hop=hop)
    stats.add_interval(name, interval)
    return work


class _TimedWork:
    """A work handle without a future: records the duration when waited on."""

    def __init__(self, work, name: str, start: float, stats: CommStats, token: int):
        self._work, self._name, self._start, self._stats, self._token = work, name, start, stats, token

    def wait(self, *args, **kwargs):
        try:
            out = self._work.wait(*args, **kwargs)
        finally:
            _release(self._token)
        self._stats.add_time(self._name, time.perf_counter() - self._start)
        return out

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def all_reduce(tensor: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum", group=None,
               async_op: bool = False, stats: Optional[CommStats] = None):
    """In-place all-reduce of ``tensor``."""
    rop = reduce_op(op)
    return _issue("all_reduce", tensor.numel() * tensor.element_size(),
                  lambda: dist.all_reduce(tensor, op=rop, group=group, async_op=async_op), async_op, stats, group,
                  (tensor,))


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
               stats: Optional[CommStats] = None):
    """Gather equal-size ``input`` from every rank into the flat ``output`` (rank-major)."""
    return _issue("all_gather", input.numel() * input.element_size(),
                  lambda: _all_gather_flat(output, input, group=group, async_op=async_op), async_op, stats, group,
                  (input, output))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: "ReduceOpName | dist.ReduceOp" = "sum",
                   group=None, async_op: bool = False, stats: Optional[CommStats] = None):
    """Reduce the flat ``input`` across ranks; each rank keeps its contiguous shard in ``output``."""
    rop = reduce_op(op)
    return _issue("reduce_scatter", input.numel() * input.element_size(),
                  lambda: _reduce_scatter_flat(output, input, op=rop, group=group, async_op=async_op),
                  async_op, stats, group, (input, output))


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
               input_split_sizes: Optional[list[int]] = None, group=None, async_op: bool = False,
               stats: Optional[CommStats] = None):
    """``all_to_all_single`` with optional uneven splits."""
    return _issue("all_to_all", input.numel() * input.element_size(),
                  lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=async_op), async_op, stats, group,
                  (input, output), "all_to_all", _row_bytes(input, input_split_sizes))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, stats: Optional[CommStats] = None):
    """Broadcast ``tensor`` from global rank ``src``."""
    return _issue("broadcast", tensor.numel() * tensor.element_size(),
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op, stats, group,
                  (tensor,), None)


def all_gather_object(obj: object, group=None) -> list:
    """Gather a picklable object from every rank (not counted: control traffic only)."""
    out: list = [None] * dist.get_world_size(group)
    if strict():
        _count("all_gather_object", group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from(tensor: torch.Tensor, group_src: int, group=None, stats: Optional[CommStats] = None) -> None:
    """Broadcast ``tensor`` from rank ``group_src`` of ``group`` (a group-local rank)."""
    _issue("broadcast", tensor.numel() * tensor.element_size(),
           lambda: dist.broadcast(tensor, group=group, group_src=group_src), False, stats, group, (tensor,), None)


def barrier(group=None) -> None:
    """``dist.barrier`` (recorded as in flight, so a hang report names it; no payload, not counted)."""
    global _last_failed
    token = next(_tokens)
    record = _in_flight[token] = InFlight("barrier", group, time.monotonic())
    if strict():
        _count("barrier", group)
    try:
        dist.barrier(group=group)
    except BaseException:
        _last_failed = record
        raise
    finally:
        _in_flight.pop(token, None)


def batch_isend_irecv(p2p_ops: "list[dist.P2POp]", group=None, stats: Optional[CommStats] = None) -> list:
    """``dist.batch_isend_irecv``: every send and receive of ``p2p_ops`` in one group call (one NCCL group
    launch, so a send/recv pair between two ranks cannot deadlock on launch order). Returns the works; the
    bytes sent are counted as 'send'."""
    tensors = tuple(op.tensor for op in p2p_ops)
    if strict():
        check_devices("batch_isend_irecv", list(tensors), group if group is not None else p2p_ops[0].group)
        _count("batch_isend_irecv", group if group is not None else p2p_ops[0].group)
    if stats is not None:
        per = procs_per_node()
        me = dist.get_rank() // per if per else None
        sent: dict = {}
        for op in p2p_ops:
            if op.op in (dist.isend,):
                hop = None if me is None else "intra" if op.peer // per == me else "cross"
                sent[hop] = sent.get(hop, 0) + op.tensor.numel() * op.tensor.element_size()
        for hop, n in sent.items():
            if n:
                stats.record("send", n, hop=hop)
    return dist.batch_isend_irecv(p2p_ops)
