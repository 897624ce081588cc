"""FSDP2 and HSDP from outside the model: ``fully_shard`` per unit (transformer block), then the root.

``apply_fsdp(model, mesh, dp_dims)`` shards parameters, gradients and optimizer state over the mesh's
data-parallel dimensions: ``("dp_shard",)`` is FSDP (ZeRO-3), ``("dp_replicate", "dp_shard")`` is HSDP
(sharded inside a replica group, replicated across groups: ``fully_shard`` given a 2-D mesh does HSDP).
Parameters become DTensors sharded on dim 0; the optimizer built *after* ``apply_fsdp`` sees only the
local shards, and DCP checkpoints (``syncwise.checkpoint.ModelOptimizerState``) stay reshardable.

Units (each one ``fully_shard`` call = one all-gather before its forward and one reduce-scatter after
its backward), in the order they are wrapped:

- ``model.fsdp_units`` when the model names them: submodule names (``"encoder.0"``) or modules;
- otherwise every direct child holding parameters, where a ``ModuleList``/``ModuleDict`` child
  (DeepSeekLM's ``layers``) contributes each of its items (one unit per transformer block);
  children whose parameters are all 1-D (norms) and children sharing a parameter with another unit
  (tied embeddings) stay with the root;
- finally the root, which takes every parameter not yet in a unit.

Mixed precision is FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` for the all-gathered compute
copy, ``reduce_dtype`` for the gradient reduce-scatter (and HSDP's all-reduce). A bf16/fp16
``reduce_dtype`` is FSDP's form of compressed gradient communication (``fsdp_reduce_dtype`` maps
``--compress`` onto it). On gloo the reduce-scatter is emulated by PyTorch (an all-reduce and a slice):
correct, but not a timing reference.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..errors import ConfigError

_REDUCE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_reduce_dtype(compress_spec: str) -> Optional[torch.dtype]:
    """The FSDP2 ``reduce_dtype`` that stands for ``--compress`` under FSDP: None (fp32) for 'none',
    ``torch.bfloat16`` for 'bf16', ``torch.float16`` for 'fp16'.

    Any other compressor raises ``ConfigError('compress', ...)``: FSDP2 reduce-scatters gradients in its
    own collectives, so there is no DDP bucket for syncwise's compression hook to rewrite; sparsifying,
    quantising or low-rank compressors (and their error feedback) have nowhere to run.
    """
    from ..compress.registry import parse_compress_spec

    name = parse_compress_spec(compress_spec).name  # validates the spec (name and options) as everywhere
    if name not in _REDUCE_DTYPES:
        raise ConfigError(
            "compress", compress_spec,
            "none, bf16 or fp16 under FSDP (dp_shard > 1): FSDP2 reduce-scatters gradients itself, so "
            "compression there is its reduce dtype (MixedPrecisionPolicy.reduce_dtype); "
            f"{name} needs DDP's gradient buckets (use dp_shard = 1, i.e. DDP, to run it)")
    return _REDUCE_DTYPES[name]


# ---------------------------------------------------------------------------------------- units
def _named_unit(model: nn.Module, unit: Union[str, nn.Module]) -> nn.Module:
    if isinstance(unit, nn.Module):
        return unit
    try:
        return model.get_submodule(unit)
    except AttributeError:
        raise ConfigError("fsdp_units", unit, f"the name of a submodule of {type(model).__name__} "
                          "(as in model.named_modules())") from None


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``apply_fsdp`` wraps before the root, in order (see the module docstring)."""
    named = getattr(model, "fsdp_units", None)
    if named is not None:
        if callable(named):
            named = named()
        return [_named_unit(model, u) for u in named]
    candidates: list[nn.Module] = []
    for child in model.children():
        items = list(child.values() if isinstance(child, nn.ModuleDict) else child) \
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        for m in items:
            params = list(m.parameters())
            if params and any(p.dim() > 1 for p in params):
                candidates.append(m)
    # a parameter can belong to one unit only: units that share one (tied weights) stay with the root
    owners: dict[int, int] = {}
    for m in candidates:
        for p in set(m.parameters()):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in candidates if all(owners[id(p)] == 1 for p in m.parameters())]


def _dp_mesh(mesh: Any, dp_dims: Sequence[str]) -> Any:
    if mesh is None:
        return None  # fully_shard's default: the whole world, one dimension
    if isinstance(dp_dims, str):
        dp_dims = (dp_dims,)
    names = tuple(mesh.mesh_dim_names or ())
    for d in dp_dims:
        if d not in names:
            raise ConfigError("dp_dims", tuple(dp_dims), f"names of the mesh's dimensions {names}")
    if not 1 <= len(dp_dims) <= 2:
        raise ConfigError("dp_dims", tuple(dp_dims), "('dp_shard',) for FSDP or ('dp_replicate', 'dp_shard') for HSDP")
    dims = tuple(dp_dims)
    if len(dims) == 2 and mesh[dims[0]].size() == 1:  # one replica: HSDP 1 × N is FSDP N
        dims = dims[1:]
    if len(dims) == 1 and len(names) == 1:
        return mesh
    return mesh[dims] if len(dims) > 1 else mesh[dims[0]]


def apply_fsdp(model: nn.Module, mesh: Any, dp_dims: Sequence[str] = ("dp_shard",),
               param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = torch.float32,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``dp_dims=("dp_shard",)``) or HSDP
    (``("dp_replicate", "dp_shard")``) over ``mesh`` (``syncwise.parallel.mesh.build_mesh``; None: the
    whole world); returns the model (now also an ``FSDPModule``).

    Call it after tensor parallel and activation checkpointing, and before building the optimizer.
    ``reshard_after_forward=True`` frees each unit's gathered parameters after its forward (ZeRO-3,
    least memory, one more all-gather in backward); False keeps them to the backward (ZeRO-2-like).
    The root is never resharded after forward: backward needs it first. ``reduce_dtype=None`` reduces
    in the gradients' own dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = _dp_mesh(mesh, dp_dims)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in fsdp_units(model):
        if unit is model:
            continue
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


# ---------------------------------------------------------------------------------------- accumulation
def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 root (``apply_fsdp``/``fully_shard`` was applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def set_gradient_sync(model: nn.Module, enabled: bool, reshard_after_backward: Optional[bool] = None) -> None:
    """Turn gradient reduction on or off for the next backward passes (FSDP2's ``no_sync``).

    For gradient accumulation: ``set_gradient_sync(model, False)`` before the micro-batches that only
    accumulate (each rank keeps its unsharded local gradient sum, no communication), and
    ``set_gradient_sync(model, True)`` before the last one, whose backward reduce-scatters the sum
    (and all-reduces it across replicas under HSDP). Applies to every unit (recursive).

    ``reshard_after_backward`` (default: leave as is, i.e. True) is a memory/communication trade, not
    needed for correctness: False keeps the gathered parameters between accumulation micro-batches
    (no all-gather in the next forward, a full copy of the parameters held); set it back to True for
    the last micro-batch so parameters are sharded again when the optimizer steps.
    """
    if not is_fsdp(model):
        raise ConfigError("model", type(model).__name__, "an FSDP2 module (apply_fsdp or fully_shard applied)")
    model.set_requires_gradient_sync(bool(enabled))
    if reshard_after_backward is not None:
        model.set_reshard_after_backward(bool(reshard_after_backward))


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module, last: bool = False) -> Iterator[None]:
    """``with no_gradient_sync(model, last=is_last_micro_batch):`` accumulate without communication
    unless ``last``; gradient sync is on again afterwards."""
    set_gradient_sync(model, last)
    try:
        yield
    finally:
        set_gradient_sync(model, True)


def full_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """The total norm ``clip_grad_norm_`` returns, as a plain tensor: with FSDP2's DTensor gradients it
    is a (replicated) DTensor; ``full_tensor()`` turns it into the global norm on every rank."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
