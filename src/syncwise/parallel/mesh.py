"""The parallel layout (``[parallel]``: pp × dp_replicate × dp_shard × tp, with ep borrowed from data parallel)
and its DeviceMesh.

One ``init_device_mesh`` with named dimensions, ``tp`` innermost so tensor-parallel peers are neighbouring
ranks (inside a node), then ``dp_shard`` (FSDP2), then ``dp_replicate`` (DDP, or HSDP's replicas when
``dp_shard > 1``), then ``pp`` outermost (pipeline stages exchange only activations, the least traffic):
rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t. The planner and the config speak the same names.

Expert parallel does not add ranks: it borrows them from data parallel (as DeepSeek and torchtitan do). The
``dp = dp_replicate × dp_shard`` data-parallel ranks of one stage are split into groups of ``ep`` neighbours,
each holding ``1/ep`` of every MoE layer's routed experts; dense parameters stay data-parallel over all ``dp``
ranks, experts over the ``dp / ep`` ranks that hold the same slice (``ep_replicate``).
"""
from __future__ import annotations

from typing import Any, Optional

from ..layout import DIMS, Layout

#: the torch side's name for the layout: the layout itself (``syncwise.layout.Layout`` — degrees, pipeline and
#: expert settings, the parsed compressor and sync specs, every rule and every derived value: ``dp``,
#: ``microbatches_per_step``, ``replicas_only``, ``fsdp``, ``coordinates``, ``dp_rank``, ``describe``)
ParallelSpec = Layout


def check_torch_support(layout: Layout, model_config: Any = None, backend: Optional[str] = None) -> None:
    """What the layout needs from the installed torch, on top of the owner's torch-free rules
    (``Layout.check_model``): the pipeline schedule's class (and a backend it runs on) when pp > 1, float8 for an
    fp8 expert dispatch. Then the owner's model-shape rules (the order the command line and the Python API share:
    pipeline, dispatch, then the shape)."""
    if layout.pp > 1:
        from .pipeline import _schedule_spec
        _schedule_spec(layout.pp_schedule, layout.pp, backend)
    if layout.ep > 1:
        from .expert_parallel import check_dispatch
        check_dispatch(layout.ep_dispatch)
    layout.check_model(model_config)


def build_mesh(spec: ParallelSpec, device_type: str) -> Optional[Any]:
    """The job's DeviceMesh over ([pp,] dp_replicate, dp_shard, tp) — None in a single process. ``pp`` is a
    dimension only when it is above 1 (each dimension costs a process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    spec = spec.resolve(dist.get_world_size())
    names = DIMS if spec.pp > 1 else DIMS[1:]
    return adopt_mesh(init_device_mesh(device_type, tuple(getattr(spec, n) for n in names), mesh_dim_names=names))


def build_expert_mesh(spec: ParallelSpec, device_type: str) -> Any:
    """The routed experts' mesh: ([pp,] ep_replicate, ep, tp), the same ranks in the same order as
    :func:`build_mesh`'s with the data-parallel ranks split into ``dp / ep`` groups of ``ep`` neighbours.
    ``ep`` carries the all-to-alls; ``ep_replicate`` joins the ranks holding the same experts (their gradients
    are summed there). Data parallel must be replicas (dp_shard = 1) for now."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist
    spec = spec.resolve(dist.get_world_size())
    names = ("pp", "ep_replicate", "ep", "tp") if spec.pp > 1 else ("ep_replicate", "ep", "tp")
    sizes = {"pp": spec.pp, "ep_replicate": spec.dp // spec.ep, "ep": spec.ep, "tp": spec.tp}
    return adopt_mesh(init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names))


def adopt_mesh(mesh: Any) -> Any:
    """``mesh`` with the job's collective timeout (``--dist.timeout_s``) on every dimension's process group
    (``syncwise.comm.ops.adopt_group``: torch makes them with its 30 min default), so a rank that stops inside
    FSDP2's, DTensor's or the pipeline's own collectives is reported within the timeout like one inside
    syncwise's. Returns ``mesh``; call it on a flattened mesh (``_flatten``) too."""
    from ..comm import ops

    for name in mesh.mesh_dim_names or ():
        ops.adopt_group(mesh[name].get_group())
    return mesh
