"""The parallel layout (``[parallel]``: dp_replicate × dp_shard × tp) and its DeviceMesh.

One ``init_device_mesh`` with named dimensions, ``tp`` innermost so tensor-parallel peers are neighbouring
ranks (inside a node), then ``dp_shard`` (FSDP2), then ``dp_replicate`` (DDP, or HSDP's replicas when
``dp_shard > 1``): rank = (r * dp_shard + s) * tp + t. The planner and the config speak the same names.
``pp`` and ``ep`` (next issue) take their place in this order: pp outermost, ep borrowed from data parallel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelSpec:
    """How many ways each dimension splits the job; ``dp_replicate=0`` means "every rank left over"."""

    dp_replicate: int = 0
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            v = getattr(self, name)
            lowest = 0 if name == "dp_replicate" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
                raise ConfigError(f"parallel.{name}", v, f"an integer ≥ {lowest}"
                                  + (" (0: the ranks dp_shard × tp leave)" if name == "dp_replicate" else ""))

    # ---------------------------------------------------------------------------------------- the layout
    def resolve(self, world_size: int) -> "ParallelSpec":
        """The layout with ``dp_replicate`` filled in; the product must be the world size."""
        inner = self.dp_shard * self.tp
        replicate = self.dp_replicate or (world_size // inner if world_size % inner == 0 else 0)
        if replicate * inner != world_size:
            field = "parallel.dp_replicate" if self.dp_replicate else "parallel.dp_shard" if self.dp_shard > 1 \
                else "parallel.tp"
            raise ConfigError(field, getattr(self, field.split(".")[1]),
                              f"a layout whose product dp_replicate × dp_shard × tp equals the world size "
                              f"({world_size}); got {self.dp_replicate or '(rest)'} × {self.dp_shard} × {self.tp}")
        return ParallelSpec(replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas × shards): how many different batches one step sees."""
        return max(self.dp_replicate, 1) * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def replicas_only(self) -> bool:
        """Every rank holds the whole model (DDP, or one process): no FSDP2 sharding, no tensor parallel. Only
        then do syncwise's compressors, the reduced-sync strategies and the dynamic batcher apply."""
        return self.dp_shard == 1 and self.tp == 1

    @property
    def describe(self) -> str:
        """e.g. 'dp_replicate 2 × tp 2' (size-1 dimensions left out; 'single process' for 1)."""
        parts = [f"{n} {getattr(self, n)}" for n in DIMS if getattr(self, n) > 1]
        return " × ".join(parts) or "single process"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (the mesh's rank order)."""
        t = rank % self.tp
        s = (rank // self.tp) % self.dp_shard
        r = rank // (self.tp * self.dp_shard)
        return {"dp_replicate": r, "dp_shard": s, "tp": t}

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
        routed experts are replicated under tp), and — for sequence parallel — ``seq_len``."""
        if self.tp == 1 or model_config is None:
            return
        c = model_config
        sizes = {"model.n_heads": c.n_heads, "model.vocab_size": c.vocab_size, "model.seq_len": c.seq_len}
        moe_blocks = [c.layer_is_moe(i) for i in range(c.n_layers)] if hasattr(c, "layer_is_moe") else []
        if not all(moe_blocks):
            sizes["model.ffn_hidden"] = c.ffn_hidden
        if any(moe_blocks) and getattr(c, "n_shared_experts", 0):
            sizes["model.moe_hidden × model.n_shared_experts"] = c.moe_hidden * c.n_shared_experts
        for name, size in sizes.items():
            if size % self.tp:
                raise ConfigError("parallel.tp", self.tp, f"a divisor of {name} ({size}): tensor parallel splits "
                                  f"it evenly across the tp ranks; divisors: {_divisors(size)}")


def _divisors(n: int) -> str:
    small = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    return ", ".join(map(str, small)) + (" …" if n > 64 else "")


def build_mesh(spec: ParallelSpec, device_type: str) -> Optional[Any]:
    """The job's DeviceMesh over (dp_replicate, dp_shard, tp) — None in a single process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    spec = spec.resolve(dist.get_world_size())
    return init_device_mesh(device_type, tuple(getattr(spec, n) for n in DIMS), mesh_dim_names=DIMS)
