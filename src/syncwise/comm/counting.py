"""Count the bytes of collectives issued by code that does not go through ``syncwise.comm.ops``.

FSDP2 (its all-gathers and reduce-scatters) and DTensor (tensor parallel's redistributions) call
torch.distributed themselves. ``CollectiveCounter`` is a ``TorchDispatchMode`` that sees those calls
at the operator level — c10d's in-place ops (``c10d.allgather_``, ``_reduce_scatter_base_`` …) and the
functional collectives (``_c10d_functional.all_gather_into_tensor`` …), forward and backward — and adds
this rank's input payload (the same definition as ``CommStats``) to the process group that carried it.

It intercepts every operator while active (~20 % of a small model's step on CPU, measured), so callers
turn it on for a few steps and reuse the count: a fixed layout sends the same bytes every step — except where it
is the only clock of a dimension's collectives (DTensor's, tensor parallel): then it runs every step and also
times them into a :class:`DimensionTimes`.

:class:`DimensionTimes` is the per-dimension clock of a layout's collectives (one instance per layout, owned by
``Parallelized``): for each dimension the seconds its collectives took (issue to completion) and the seconds the
step was blocked on them (exposed). Host clock on the CPU; CUDA events on a GPU (:class:`~.timing.Interval`),
read only when the step's row is settled, where the exposed share cannot be told from events on one stream and is
left unmeasured (None).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .timing import Interval

# op name (without overload) -> index of the argument that holds this rank's payload
_C10D_PAYLOAD = {"allreduce_": 0, "allreduce_coalesced_": 0, "allgather_": 1, "_allgather_base_": 1,
                 "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1, "reduce_scatter_": 1,
                 "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1,
                 "alltoall_base_": 1, "broadcast_": 0, "reduce_": 0, "gather_": 1, "scatter_": 1, "send": 0}
_FUNCTIONAL_PAYLOAD = {"all_reduce": 0, "all_reduce_coalesced": 0, "all_gather_into_tensor": 0,
                       "all_gather_into_tensor_coalesced": 0, "reduce_scatter_tensor": 0,
                       "reduce_scatter_tensor_coalesced": 0, "all_to_all_single": 0, "broadcast": 0}
# The autograd wrappers (_c10d_functional_autograd) run the functional ops beneath them: counting both would
# count twice.
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_name(args: tuple, kwargs: dict) -> Optional[str]:
    import torch.distributed as dist

    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject):  # c10d ops carry the ProcessGroup boxed
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:
                continue
    strings = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str)]
    return strings[-1] if strings else None  # functional ops: the group name is their last string argument


class DimensionTimes:
    """Seconds per parallel dimension in one step: ``time`` (issue to completion of its collectives) and
    ``exposed`` (the part the step waited for). ``add(dim, interval, exposed=...)`` per collective; ``take()``
    hands back a reader of the step's totals and starts the next step (the reader waits for CUDA events only
    when it is called, when the step's row is settled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: list = []  # (dim, Interval, exposed seconds or None)
        self.bytes: dict[str, int] = defaultdict(int)  # what the timed callers counted this step (FSDP2's comms)
        #: the part of those bytes whose hop is known, per dimension: {dim: {'intra': .., 'cross': ..}}
        self.hops: dict[str, dict[str, int]] = {}
        self._taken_hops: dict[str, dict[str, int]] = {}

    def count(self, dim: str, nbytes: int, hops: Optional[dict] = None) -> None:
        """Count ``nbytes`` of ``dim``; ``hops``: the same bytes split ``{'intra': .., 'cross': ..}``
        (``comm.ops.split_bytes``), None where the topology is not known."""
        with self._lock:
            self.bytes[dim] += int(nbytes)
            for h, n in (hops or {}).items():
                mine = self.hops.setdefault(dim, {})
                mine[h] = mine.get(h, 0) + int(n)

    def take_bytes(self) -> dict[str, int]:
        """The bytes counted since the last call, per dimension; resets (their split per hop is kept for
        :meth:`taken_hops`)."""
        with self._lock:
            out, self.bytes = dict(self.bytes), defaultdict(int)
            self._taken_hops, self.hops = self.hops, {}
        return out

    def taken_hops(self) -> dict[str, dict[str, int]]:
        """The split per hop of the bytes the last :meth:`take_bytes` handed back, per dimension
        (``{dim: {'intra': .., 'cross': ..}}``; bytes with no known hop are in neither)."""
        with self._lock:
            return {d: dict(h) for d, h in self._taken_hops.items()}

    def add(self, dim: str, interval: Interval, exposed: Optional[float] = None) -> None:
        with self._lock:
            self._step.append((dim, interval, exposed))

    def take(self) -> "Any":
        """A reader of the step so far (``reader() -> {dim: (seconds, exposed seconds or None)}``); resets."""
        with self._lock:
            items, self._step = self._step, []

        def reader() -> dict[str, tuple[float, Optional[float]]]:
            out: dict[str, list] = {}
            for dim, iv, exposed in items:
                t = out.setdefault(dim, [0.0, 0.0])
                t[0] += iv.seconds()
                t[1] = None if exposed is None or t[1] is None else t[1] + exposed
            return {d: (t[0], t[1]) for d, t in out.items()}
        return reader


_SKIP = threading.local()


class uncounted:
    """``with uncounted():`` — collectives issued inside are counted by their caller (FSDP2's timed all-gather
    and reduce-scatter), not by an active :class:`CollectiveCounter`."""

    def __enter__(self) -> None:
        _SKIP.depth = getattr(_SKIP, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _SKIP.depth -= 1


class CollectiveCounter(TorchDispatchMode):
    """``with counter:`` — bytes this rank sent per process-group name (``counter.bytes``), calls likewise.

    ``groups`` maps group names to labels (e.g. a DeviceMesh's groups to 'dp' / 'tp'); collectives on other
    groups are not counted (syncwise's own ops count themselves in ``CommStats``). With ``times`` (a
    :class:`DimensionTimes`), the functional collectives of the labels in ``timed`` (DTensor's) are timed from their
    issue to the end of their ``wait_tensor``; exposed is the host time spent inside the collective's call and its
    wait (on the CPU the step is blocked exactly then; on a GPU the events span issue to wait on the compute stream
    and exposed is left unmeasured)."""

    def __init__(self, groups: Optional[dict[str, str]] = None, times: Optional[DimensionTimes] = None,
                 timed: tuple = ()) -> None:
        super().__init__()
        self.groups = groups
        self.times, self.timed = times, tuple(timed)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        #: the same bytes per hop where the topology is known ('intra', 'cross'; ``comm.ops.split_bytes`` of the
        #: collective's group: a ring's N_g / W across, an all-to-all's chunks for other nodes)
        self.hops: dict[str, dict[str, int]] = {}  # per label: {'intra': .., 'cross': ..}
        self._issued: dict[int, tuple] = {}  # id(output) -> (label, Interval, host seconds blocked so far)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        if self._issued:
            if ns in _FUNCTIONAL_NAMESPACES and name == "wait_tensor":
                return self._wait(func, args, kwargs)
            self._wait_inputs(args, kwargs)
        index = _C10D_PAYLOAD.get(name) if ns == "c10d" else \
            _FUNCTIONAL_PAYLOAD.get(name) if ns in _FUNCTIONAL_NAMESPACES else None
        if index is None or getattr(_SKIP, "depth", 0):
            return func(*args, **kwargs)
        group = _group_name(args, kwargs)
        label = group if self.groups is None else self.groups.get(group)
        if label is None:
            return func(*args, **kwargs)
        nbytes = _nbytes(args[index])
        self.bytes[label] += nbytes
        self.calls[label] += 1
        for h, n in (_split(group, name, nbytes) or {}).items():
            mine = self.hops.setdefault(label, {})
            mine[h] = mine.get(h, 0) + n
        if self.times is None or label not in self.timed or ns == "c10d":
            return func(*args, **kwargs)
        payload = args[index]
        iv = Interval(payload if isinstance(payload, torch.Tensor) else None).start()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        blocked = time.perf_counter() - t0
        outs = out if isinstance(out, (list, tuple)) else [out]
        for o in outs:  # a coalesced op returns one tensor per input: each is waited for; the last wait ends it
            self._issued[id(o)] = (label, iv, blocked, len(outs))
        return out

    def _wait_inputs(self, args: tuple, kwargs: dict) -> None:
        """An operator about to use a collective's result (an ``AsyncCollectiveTensor``, which would wait inside
        the operator, out of this mode's sight): wait for it here, timed."""
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.utils._pytree import tree_leaves

        for a in tree_leaves((args, kwargs)):
            if isinstance(a, AsyncCollectiveTensor) and id(a.elem) in self._issued:
                self._wait(lambda t: a.wait(), (a.elem,), {})

    def _wait(self, func, args, kwargs):
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        blocked = time.perf_counter() - t0
        entry = self._issued.pop(id(args[0]), None) if args else None
        if entry is None:
            return out
        label, iv, before, n = entry
        if n > 1:  # the other outputs of a coalesced op: their waits add to the same interval
            for k, v in list(self._issued.items()):
                if v[1] is iv:
                    self._issued[k] = (label, iv, before + blocked, n - 1)
            return out
        iv.stop()
        self.times.add(label, iv, None if iv.cuda else before + blocked)
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.hops.clear()
        self._issued.clear()


def _split(group_name: Optional[str], op: str, nbytes: int) -> Optional[dict]:
    """``nbytes`` of collective ``op`` over the group named ``group_name``, per hop (None: not known)."""
    from torch.distributed import distributed_c10d as c10d

    from . import ops

    if group_name is None:
        return None
    try:
        pg = c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None
    return ops.split_bytes(nbytes, pg, "all_to_all" if op.startswith(("alltoall", "all_to_all")) else "ring")


def mesh_groups(mesh: Any, labels: dict[str, str]) -> dict[str, str]:
    """Group name → label for a DeviceMesh's dimensions, e.g. ``{"dp_shard": "dp", "tp": "tp"}``."""
    out = {}
    for dim, label in labels.items():
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            out[mesh[dim].get_group().group_name] = label
    return out
