"""``parallelize(model, spec, device)``: every kind of parallelism, applied outside the model, in one order.

The order (torchtitan's ``parallelize_llama``, for the same reasons):

1. activation checkpointing — wraps block forwards; must see the plain blocks, before any wrapper;
2. the pipeline split (``pp``) — this rank keeps its stages' layers (``AsyncPipeline``); everything below works on
   those parts, so the other layers are never sharded or copied;
3. tensor / sequence parallel (``tp``) on each part — swaps parameters for DTensors sharded on the ``tp`` mesh
   dimension; everything after it sees (and shards further) those DTensors;
4. expert parallel (``ep``) — each MoE layer's routed experts split over ``ep`` data-parallel neighbours;
5. data parallel over the ``dp_*`` dimensions: FSDP2 (``dp_shard > 1`` or ``tp > 1``; HSDP when ``dp_replicate >
   1`` too; each pipeline stage its own root), DDP with syncwise's gradient-sync hook (compressed, timed, counted)
   when the layout is replicas, or a pipeline stage's replicas averaged after the schedule;
6. a reduced-sync strategy (local SGD / DiLoCo / Pipe-SGD) — needs the replicas identical, i.e. after DDP's
   initial broadcast;
7. ``torch.compile`` last, over the wrapped module.

The trainer talks only to the returned :class:`Parallelized`, one class per data-parallel kind (single process, DDP
replicas, FSDP2 / HSDP, a pipeline stage: ``syncwise.parallel.kinds``), chosen once from the layout: ``module`` to run, ``micro_batch(syncing)``
around each micro-batch's forward/backward (DDP's ``no_sync`` and FSDP2's ``set_requires_gradient_sync``
behind one name, with the exposed-communication timer), ``take_exposed()`` / ``counted_bytes()`` per parallel
dimension, ``state_components()`` for checkpoints, ``clip_grad_norm`` that works on sharded gradients, and
``ledger``: the run's :class:`~syncwise.comm.CommLedger`, made here (or given) and handed to every wrapper, hook,
compressor and strategy built here, so each counts its collectives into this run's counters and no one else's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.stats import CommLedger
from ..errors import ConfigError
from ..layout import NO_COMPRESS, Compress, Layout, parse_compress, parse_sync
from ..specs import spec_name
from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import compressor_of
from .kinds import DataParallelInputs, Parallelized, PipelineStage, kind_of
from .mesh import build_mesh, check_torch_support
from ..layout import BUCKET_CAP_MB, MIN_NUMEL

def parallelize(model: nn.Module, spec: "Layout | dict | None" = None, device: Optional[torch.device] = None,
                *, compressor: Any = None, bucket_cap_mb: float = BUCKET_CAP_MB, min_numel: int = MIN_NUMEL,
                sync: Any = None,
                activation_checkpointing: bool = False, compile: bool = False,
                tp_plan: Optional[dict] = None, loss_fn: Any = None, split_fn: Any = None,
                param_dtype: Optional[torch.dtype] = None, ledger: Optional[CommLedger] = None) -> Parallelized:
    """Apply ``spec`` (a ``syncwise.layout.Layout`` — ``ParallelSpec`` is its name here —, a dict of its fields, or
    None: every rank a DDP replica) to ``model``.

    ``compressor``: syncwise's gradient compression (None = DDP's built-in all-reduce). With dp_shard > 1 or tp > 1
    (FSDP2) a cast (``bf16``/``fp16``) is FSDP2's reduce dtype, and any other compressor compresses the all-reduce
    across the dp_replicate groups (FSDP2's all-reduce hook; needs dp_replicate ≥ 2). ``sync``: a reduced-sync
    strategy (DDP replicas, or HSDP's replica groups: FSDP2 over dp_shard, the outer step per shard over dp_replicate).
    ``loss_fn``: the last pipeline stage's loss (pp > 1; default ``lm_loss``); ``split_fn(model, stage, n_stages)``:
    a user model's pipeline split (syncwise's model and ``nn.Sequential`` need none).
    ``tp_plan``: a user model's tensor-parallel plan (``parallelize_module``'s dict); syncwise's own model has one.
    ``param_dtype``: FSDP2's parameter dtype (``torch.bfloat16`` under bf16 autocast; None: fp32).
    ``ledger``: the run's communication counters (``Parallelized.ledger``; default: a new one). The compressor counts
    into its ``dp`` from here on.
    """
    spec = spec if isinstance(spec, Layout) else Layout(**(spec or {}))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if compressor is None and not spec.compress.is_none:  # the layout names the compressor: built from its spec
        compressor = compressor_of(spec.compress)
    sync = parse_sync(sync) if sync is not None else spec.sync
    spec = check_layout(spec, compressor, sync, world, getattr(model, "config", None))
    ledger = ledger if ledger is not None else CommLedger()
    _count_compressor_in(compressor, ledger)
    device = device or next(model.parameters()).device
    # Replicas alone need no mesh: DDP runs on the default group, as before the seam (a mesh would add a gloo group
    # per dimension to every plain DDP job, each one more set of threads to tear down at exit).
    mesh = None if spec.replicas_only else build_mesh(spec, device.type)

    # 1. activation checkpointing
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    par = kind_of(spec)(model=model, module=model, spec=spec, mesh=mesh, ledger=ledger)  # the kind, chosen once
    # 2. pipeline: this rank's stages; the other layers are dropped before anything below shards or copies them
    if isinstance(par, PipelineStage):
        par.split(model, device, loss_fn, split_fn)
    # 3. tensor / sequence parallel, on each part (a stage's plan covers the layers it has)
    if spec.tp > 1:
        from .tensor_parallel import apply_tensor_parallel
        for part in par.parts:
            apply_tensor_parallel(part, mesh["tp"], plan=tp_plan)
    # 4. expert parallel: each MoE layer's routed experts split over ep data-parallel neighbours (all-to-all)
    if spec.ep > 1:
        from .expert_parallel import apply_expert_parallel
        from .mesh import build_expert_mesh
        expert_mesh = build_expert_mesh(spec, device.type)  # (collective: every rank builds it)
        if any(True for _ in getattr(par.model, "moe_layers", lambda: ())()):  # a stage may hold dense layers only
            apply_expert_parallel(par.model, expert_mesh["ep"], dispatch=spec.ep_dispatch, stats=ledger.ep)
        par.expert_replicas = expert_mesh["ep_replicate"].get_group() if spec.dp > spec.ep else None
    # 5. data parallel (FSDP2 / HSDP, DDP, a pipeline stage's replicas), and 6. the reduced-sync strategy over the
    # replicas it keeps apart: as the kind applies them
    par.apply_data_parallel(DataParallelInputs(model=model, compressor=compressor, sync=sync,
                                               bucket_cap_mb=bucket_cap_mb, min_numel=min_numel, device=device,
                                               world=world, param_dtype=param_dtype))
    if spec.fsdp and mesh is not None and not compile:  # (a dispatch mode would recompile a compiled module)
        par.count_dispatch()
    # 7. compile
    if compile:
        par.module = torch.compile(par.module)
    return par


def _count_compressor_in(compressor: Any, ledger: CommLedger) -> None:
    """A syncwise compressor counts its collectives into the run's ``ledger.dp`` (torch's hooks have no counter)."""
    from ..compress.base import Compressor

    if isinstance(compressor, Compressor):
        compressor.stats = ledger.dp


def check_layout(spec: Layout, compressor: Any, sync: Any, world: int, model_config: Any = None) -> Layout:
    """What ``parallelize`` checks before it builds anything, resolved for ``world`` ranks: every rule between the
    degrees, the compressor and the sync strategy (``syncwise.layout.Layout.check``, as the command line and the
    planner ask it; the compressor by the parsed spec it was built from, or its name when it was built without
    one), then the model's shape and what it needs from this torch (``mesh.check_torch_support``). The result is
    the layout with the compressor's spec and the sync spec in it (``Parallelized.spec``)."""
    out = dataclasses.replace(spec, compress=_compress_of(compressor), sync=parse_sync(sync)).check(world)
    check_torch_support(out, model_config)
    return out


def _compress_of(compressor: Any) -> Compress:
    """The parsed spec of the compressor instance parallelize was given: the one it was built from
    (``data_parallel.compressor_of`` keeps it as ``parsed``), or — for a user's own Compressor class or one built
    from text — its spec text or name."""
    if compressor is None:
        return NO_COMPRESS
    parsed = getattr(compressor, "parsed", None)
    if isinstance(parsed, Compress):
        return parsed
    text = getattr(compressor, "spec", None) or getattr(compressor, "name", None) or "none"
    try:
        return parse_compress(text, "compress.method")
    except ConfigError:  # a Compressor subclass syncwise does not list: only its name matters to the rules
        return Compress(spec_name(str(text)), {}, str(text))


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module,
                     keep_only_present: bool = False) -> None:
    """Point ``optimizer``'s parameter groups at ``model``'s current parameters, by name.

    FSDP2 and tensor parallel replace each parameter with a sharded (DTensor) one under the same name, but a
    user builds the optimizer before the trainer parallelizes: its groups still hold the old tensors. ``names``
    maps ``id(old parameter)`` to its name (taken before parallelizing). Optimizer state must still be empty.
    ``keep_only_present``: a pipeline stage holds some of the layers; parameters it does not hold leave the
    optimizer (elsewhere a parameter missing from the model is an error).
    """
    current = dict(model.named_parameters())
    moved = [p for g in optimizer.param_groups for p in g["params"] if current.get(names.get(id(p), "")) is not p]
    if not moved:
        return
    if optimizer.state:
        raise ConfigError("optimizer", type(optimizer).__name__, "an optimizer that has not stepped yet: FSDP2 / "
                          "tensor / pipeline parallel replace the parameters, and existing state cannot follow them")
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            raise ConfigError("optimizer", type(optimizer).__name__, "an optimizer over the model's own "
                              "parameters (one it holds is not among model.named_parameters())")
        held = [names[id(p)] for p in group["params"]]
        if not keep_only_present and any(n not in current for n in held):
            raise ConfigError("optimizer", type(optimizer).__name__, "an optimizer over the model's own "
                              "parameters (one it holds is not among model.named_parameters())")
        group["params"] = [current[n] for n in held if n in current]


def describe_layout(par: Parallelized) -> str:
    """'dp_shard 2 × tp 2 (FSDP2)' for the summary."""
    kind = par.kind_label
    topo = par.dp.hierarchical
    if topo is not None and kind:  # dist.hierarchical: where the compressor runs, for the summary and metrics
        kind += (f", hierarchical sync on {topo.nodes} nodes × {topo.procs_per_node}: fp32 inside a node, "
                 + ("compressed across" if par.dp.hook_state is not None else "fp32 across"))
    return par.spec.describe + (f" ({kind})" if kind else "")
