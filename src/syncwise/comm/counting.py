"""Count the bytes of collectives issued by code that does not go through ``syncwise.comm.ops``.

FSDP2 (its all-gathers and reduce-scatters) and DTensor (tensor parallel's redistributions) call
torch.distributed themselves. ``CollectiveCounter`` is a ``TorchDispatchMode`` that sees those calls
at the operator level — c10d's in-place ops (``c10d.allgather_``, ``_reduce_scatter_base_`` …) and the
functional collectives (``_c10d_functional.all_gather_into_tensor`` …), forward and backward — and adds
this rank's input payload (the same definition as ``CommStats``) to the process group that carried it.

It intercepts every operator while active (~20 % of a small model's step on CPU, measured), so callers
turn it on for a few steps and reuse the count: a fixed layout sends the same bytes every step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class CollectiveCounter(TorchDispatchMode):
    """``with counter:`` — bytes this rank sent per process-group name (``counter.bytes``), calls likewise.

    ``groups`` maps group names to labels (e.g. a DeviceMesh's groups to 'dp' / 'tp'); collectives on other
    groups are not counted (syncwise's own ops count themselves in ``CommStats``)."""

    def __init__(self, groups: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.groups = groups
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        index = _C10D_PAYLOAD.get(name) if ns == "c10d" else \
            _FUNCTIONAL_PAYLOAD.get(name) if ns in _FUNCTIONAL_NAMESPACES else None
        if index is not None:
            group = _group_name(args, kwargs)
            label = group if self.groups is None else self.groups.get(group)
            if label is not None:
                self.bytes[label] += _nbytes(args[index])
                self.calls[label] += 1
        return func(*args, **kwargs)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def mesh_groups(mesh: Any, labels: dict[str, str]) -> dict[str, str]:
    """Group name → label for a DeviceMesh's dimensions, e.g. ``{"dp_shard": "dp", "tp": "tp"}``."""
    out = {}
    for dim, label in labels.items():
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            out[mesh[dim].get_group().group_name] = label
    return out
