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

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..layout import DEGREES, DIMS, Layout  # noqa: F401  (the layout's rules: syncwise.layout)


@dataclass(frozen=True)
class ParallelSpec:
    """How many ways each dimension splits the job; ``dp_replicate=0`` means "every rank left over"."""

    dp_replicate: int = 0
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # how the pipeline runs (torch.distributed.pipelining; parallel/pipeline.py) and how experts exchange tokens
    pp_schedule: str = "1f1b"
    microbatches: int = 0       # 0: 2 × pp × stages_per_rank
    stages_per_rank: int = 1
    ep_dispatch: str = "fp32"   # fp8 is DeepSeek-V3's choice (with a bf16 combine)

    def __post_init__(self) -> None:
        self.layout()  # the degrees' own bounds (syncwise.layout.Layout)

    def layout(self, compress: Any = "none", sync: Any = None) -> Layout:
        """This spec as the torch-free owner of the layout's rules (syncwise.layout.Layout)."""
        return Layout.of(compress=compress, sync=sync, **{f.name: getattr(self, f.name)
                                                         for f in dataclasses.fields(self)})

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelSpec":
        """The torch side's carrier of a Layout's degrees and pipeline / expert settings (the one mapper)."""
        return cls(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(cls)})

    # ---------------------------------------------------------------------------------------- the layout
    def resolve(self, world_size: int) -> "ParallelSpec":
        """The layout with ``dp_replicate`` filled in (``syncwise.layout.Layout.resolve``: the product
        pp × dp_replicate × dp_shard × tp is the world size, ``ep`` divides the data-parallel ranks)."""
        return ParallelSpec.from_layout(self.layout().resolve(world_size))

    @property
    def microbatches_per_step(self) -> int:
        """The pipeline's microbatches per step: ``microbatches``, or by default 2 × pp × stages_per_rank."""
        return self.microbatches or 2 * self.pp * self.stages_per_rank

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas × shards): how many different batches one step sees."""
        return max(self.dp_replicate, 1) * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def replicas_only(self) -> bool:
        """Every rank holds the whole model (DDP, or one process): no FSDP2 sharding, no tensor, pipeline or
        expert parallel. Only then do the reduced-sync strategies and the dynamic batcher apply."""
        return self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.ep == 1

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 holds the data-parallel ranks: sharded, or replicas of a tensor-parallel model."""
        return self.dp_shard > 1 or self.tp > 1

    @property
    def describe(self) -> str:
        """e.g. 'dp_replicate 2 × tp 2' (size-1 dimensions left out; 'single process' for 1)."""
        parts = [f"{n} {getattr(self, n)}" for n in DIMS + ("ep",) if getattr(self, n) > 1]
        return " × ".join(parts) or "single process"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (the mesh's rank order)."""
        t = rank % self.tp
        s = (rank // self.tp) % self.dp_shard
        r = (rank // (self.tp * self.dp_shard)) % max(self.dp_replicate, 1)
        p = rank // (self.tp * self.dp_shard * max(self.dp_replicate, 1))
        return {"pp": p, "dp_replicate": r, "dp_shard": s, "tp": t}

    def dp_rank(self, rank: int) -> int:
        """This rank's index among the data-parallel ranks (which batch shard it reads)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ---------------------------------------------------------------------------------------- the model
    def check_model(self, model_config: Any) -> None:
        """``tp`` must divide every dimension tensor parallel splits (parallel/tensor_parallel.py's plan):
        attention heads (MHA q/k/v/o and MLA's per-head up-projections; MLA's latent ranks and the shared
        RoPE key stay replicated, so they need not divide), the vocabulary (embedding and head), the
        dense SwiGLU width where a dense block exists, the fused shared-expert width of MoE blocks (the
        routed experts are replicated under tp), and — for sequence parallel — ``seq_len``. ``ep`` must divide
        the routed experts; the pipeline's stages, schedule and microbatches must suit the layers
        (``pipeline.check_pipeline``); the dispatch precision must exist (``expert_parallel.check_dispatch``)."""
        if model_config is None:
            return
        c = model_config
        if self.pp > 1:
            from .pipeline import check_pipeline
            check_pipeline(c.n_layers, self.pp, self.pp_schedule, self.microbatches_per_step, self.stages_per_rank)
        if self.ep > 1:
            from .expert_parallel import check_dispatch
            check_dispatch(self.ep_dispatch)
        self.layout().check_model(c)  # tp and ep against the model's shape (torch-free)


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
