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
``reduce_dtype`` is FSDP's form of compressed gradient communication; syncwise's other compressors run
across replicas as FSDP2's all-reduce hook (``fsdp_gradient_sync`` decides which, ``attach_compression``
attaches the hook). On gloo the reduce-scatter is emulated by PyTorch (an all-reduce and a slice):
correct, but not a timing reference.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..comm import ops
from ..errors import ConfigError
from ..layout import check_fsdp_compress, parse_compress

_REDUCE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_gradient_sync(compress_spec: Any, dp_replicate: int, dp_shard: int = 1, pp: int = 1
                       ) -> tuple[Optional[torch.dtype], bool]:
    """How a layout that FSDP2 holds (dp_shard > 1 or tp > 1) reduces gradients under ``--compress``:
    ``(reduce_dtype, compress_across_replicas)``.

    - ``none`` / ``bf16`` / ``fp16``: FSDP2's own collectives in that reduce dtype (None: fp32), HSDP's native
      all-reduce across replicas included — a 16-bit reduce dtype is FSDP's form of compressed communication.
    - any other syncwise compressor: the reduce-scatter inside a replica group stays fp32 and the compressor
      runs as FSDP2's all-reduce hook across the ``dp_replicate`` groups (:func:`attach_compression`), which is
      where the slow links are (replicas span nodes). It needs ``dp_replicate ≥ 2``: with one replica every
      rank is inside FSDP2's reduce-scatter, which has no hook to rewrite.
    - ``int8`` / ``fp8`` with one replica and ``dp_shard`` > 1: FSDP2's reduce-scatter itself, quantized
      (``(torch.float32, False)``; :func:`fsdp_reduce_codec` gives the codec, ``fsdp_quant`` runs it).
    - ``torch-*`` (PyTorch's DDP comm hooks) need DDP's buckets: refused.

    ``compress_spec``: the parsed spec (``syncwise.layout.Compress``, as ``parallelize`` has it) or its text.
    """
    c = parse_compress(compress_spec, "compress")
    across = check_fsdp_compress(c, max(dp_replicate, 1), "compress", dp_shard=dp_shard, pp=pp)  # syncwise.layout
    if not across:
        return _REDUCE_DTYPES.get(c.name, torch.float32), False
    if isinstance(compress_spec, str):  # text: the compressor's own bounds, as everywhere (an instance has them)
        from ..compress.registry import build_compressor
        build_compressor(c)
    return torch.float32, True


def fsdp_reduce_codec(compress_spec: Any, dp_replicate: int, dp_shard: int, pp: int = 1) -> Any:
    """The quantized reduce-scatter's codec (``fsdp_quant.BlockCodec``) when ``--compress`` runs as FSDP2's
    reduce-scatter (``syncwise.layout.fsdp_quantized_reduce``), else None."""
    from ..layout import fsdp_quantized_reduce
    from .fsdp_quant import codec_of

    c = parse_compress(compress_spec, "compress")
    return codec_of(c) if fsdp_quantized_reduce(c, max(dp_replicate, 1), dp_shard, pp) else None


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
               reshard_after_forward: Union[bool, int] = True, reduce_codec: Any = None,
               gather_codec: Any = None, seed: int = 0, hierarchical_reduce: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``dp_dims=("dp_shard",)``) or HSDP
    (``("dp_replicate", "dp_shard")``) over ``mesh`` (``syncwise.parallel.mesh.build_mesh``; None: the
    whole world); returns the model (now also an ``FSDPModule``).

    Call it after tensor parallel and activation checkpointing, and before building the optimizer.
    ``reshard_after_forward=True`` frees each unit's gathered parameters after its forward (ZeRO-3,
    least memory, one more all-gather in backward); False keeps them to the backward (ZeRO-2-like).
    The root is never resharded after forward: backward needs it first; neither is the last unit (as in
    torchtitan): backward starts with it, so resharding it would free its parameters only to all-gather them
    again at once. ``reduce_dtype=None`` reduces in the gradients' own dtype. ``param_dtype``: the dtype the
    parameters are all-gathered and computed in — ``torch.bfloat16`` under bf16 autocast (the trainer passes it),
    so FSDP2 moves half the bytes and autocast has nothing to re-cast (issue 24); None keeps them fp32.
    ``reshard_after_forward`` may also be an int k (a divisor of the shard group's size): after forward each unit
    keeps its parameters sharded over groups of k neighbouring shard ranks (``fsdp_reshard=node``: the ranks of a
    node), so backward's all-gather stays inside them (ZeRO++'s hpZ).

    ``reduce_codec`` / ``gather_codec`` (``syncwise.parallel.fsdp_quant.BlockCodec``, None: FSDP2's own
    collectives): every unit's gradient reduce-scatter and parameter all-gather quantized in blocks
    (``QuantizedReduceScatter``: all-to-all and an fp32 sum in rank order; ``QuantizedAllGather``: dequantized into
    FSDP2's buffer). ``seed``: stochastic rounding's (per unit and rank). ``hierarchical_reduce``
    (``dist.hierarchical``, ``syncwise.layout.hierarchical_applies``): the quantized reduce-scatter sums inside each
    node at full precision and quantizes only across nodes, and the quantized gather goes across nodes first, then
    inside the node, over the same groups (the topology: ``comm.ops.procs_per_node``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = _dp_mesh(mesh, dp_dims)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = [u for u in fsdp_units(model) if u is not model]
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False if last else reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    if getattr(model, "awaiting_shards", False):  # built on the meta device (models.hf_model, sharded=True)
        _materialise_shards(model)
    if reduce_codec is not None or gather_codec is not None:
        _attach_quantized(model, dp_mesh, reduce_codec, gather_codec, seed,
                          _reduce_hierarchy(mesh, dp_mesh) if hierarchical_reduce and reduce_codec is not None
                          else None)
    return model


def _reduce_hierarchy(mesh: Any, dp_mesh: Any) -> Any:
    """(node_group, cross_group) of this rank's shard group (``fsdp_quant.node_groups``) on the job's topology: every
    shard group of the job's mesh (one per tp rank) is split alike, on every rank."""
    import torch.distributed as dist

    from .fsdp_quant import node_groups

    per = ops.procs_per_node()
    if per is None:
        raise ConfigError("dist.hierarchical", "on", "a known topology (torchrun's LOCAL_WORLD_SIZE or a CommContext) "
                          "for the hierarchical quantized reduce-scatter")
    if dp_mesh is None:
        groups = [list(range(dist.get_world_size()))]
    elif mesh is not None and "dp_shard" in (mesh.mesh_dim_names or ()) and dp_mesh.ndim == 1:
        names = list(mesh.mesh_dim_names)
        full = mesh.mesh.movedim(names.index("dp_shard"), -1)   # every shard group, the same on every rank
        groups = full.reshape(-1, full.shape[-1]).tolist()
    else:
        groups = [dp_mesh.mesh.flatten().tolist()]              # a 1-D mesh given alone: the whole job's group
    return node_groups(groups, per, dist.get_rank())


@torch.no_grad()
def _materialise_shards(model: nn.Module) -> None:
    """A model built on the meta device for sharding (``awaiting_shards``; ``hand_over_shards()`` gives the device
    and, on rank 0, the whole model's tensors), now sharded by ``fully_shard``: allocate this rank's shards there
    (``to_empty``) and fill them from rank 0's — parameters and persistent buffers by ``set_model_state_dict``
    (``full_state_dict``, ``broadcast_from_rank0``: one tensor at a time, so a rank holds at most one whole tensor
    besides its shards), the buffers a state dict leaves out (rotary frequencies) by a broadcast each. Every rank
    of the default group calls it alike (``apply_fsdp`` runs on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device, full = model.hand_over_shards()
    model.to_empty(device=device)
    set_model_state_dict(model, full[0] if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    kept = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name not in kept:
            if full is not None:
                buf.copy_(full[1][name])
            ops.broadcast(buf, src=0, stats=None)  # (set-up: no run's ledger counts it)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise RuntimeError("apply_fsdp: a tensor of a model built on the meta device is still there after sharding")


def _shard_size(dp_mesh: Any) -> int:
    import torch.distributed as dist
    if dp_mesh is None:
        return dist.get_world_size()
    return dp_mesh.size(-1)  # HSDP: (dp_replicate, dp_shard); FSDP: (dp_shard,)


def _attach_quantized(model: nn.Module, dp_mesh: Any, reduce_codec: Any, gather_codec: Any, seed: int,
                      hierarchy: Any = None) -> None:
    """Set every unit's custom collectives (``fsdp_quant``); ``attach_timing`` wraps them later (it reads
    ``_syncwise_comms``)."""
    from torch.distributed.fsdp import FSDPModule

    from .fsdp_quant import QuantizedAllGather, QuantizedReduceScatter

    world = _shard_size(dp_mesh)
    for i, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        comms = {}
        if gather_codec is not None:
            comms["all_gather"] = QuantizedAllGather(gather_codec, world, hierarchy=hierarchy)
            module.set_custom_all_gather(comms["all_gather"])
        if reduce_codec is not None:
            comms["reduce_scatter"] = QuantizedReduceScatter(reduce_codec, seed=seed, unit=i, hierarchy=hierarchy)
            module.set_custom_reduce_scatter(comms["reduce_scatter"])
        module._syncwise_comms = comms


# ---------------------------------------------------------------------------------------- timing
def attach_timing(model: nn.Module, times: Any, labels: dict[str, str]) -> None:
    """Count and time FSDP2's all-gathers and reduce-scatters of every unit under ``model`` (FSDP2's public
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, with torch's default collective inside): bytes (this
    rank's input, as ``CommStats`` counts) and an interval per call into ``times``
    (``syncwise.comm.counting.DimensionTimes``) under the label of the group that carried it (``labels``: group
    name → 'fsdp' / 'dp'). A synchronous call on the CPU blocks the step for its whole duration: exposed = its time.
    An asynchronous one (or one on a GPU, timed by CUDA events on FSDP2's communication stream) has its time only.
    The collectives inside are hidden from the dispatch counter (``uncounted``): counted here, once."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from ..comm.counting import uncounted
    from ..comm.timing import Interval

    labels = dict(labels)

    def timed(call: Any, output: torch.Tensor, payload: torch.Tensor, group: Any, async_op: bool,
              inner: Any = None) -> Any:
        label = labels.get(group.group_name)
        if label is None:
            return call()
        wire = getattr(inner, "wire_bytes", None)  # a quantized collective: what it puts on the wire
        nbytes = wire(payload, group) if wire else payload.numel() * payload.element_size()
        # split per hop by the collective's pattern over its group (comm.ops.cross_share: a ring's N_g / W, an
        # all-to-all's chunks for other nodes); a quantized reduce-scatter says its own (all-to-all, hierarchical)
        split = getattr(inner, "split_bytes", None)
        times.count(label, nbytes, split(nbytes, payload, group) if split else ops.split_bytes(nbytes, group, "ring"))
        iv = Interval(payload.device).start()
        with uncounted():
            work = call()
        if iv.cuda:
            times.add(label, iv.stop(), None)
        elif work is not None and async_op:  # completes later: its future stops the clock
            work.get_future().then(lambda _f: iv.stop())
            times.add(label, _Later(iv), None)
        else:
            iv.stop()
            times.add(label, iv, iv.seconds())
        return work

    class TimedAllGather(DefaultAllGather):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
            return self.inner.allocate(*args, **kwargs)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: D102
            return timed(lambda: self.inner(output_tensor, input_tensor, group, async_op),
                         output_tensor, input_tensor, group, async_op, self.inner)

    class TimedReduceScatter(DefaultReduceScatter):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
            return self.inner.allocate(*args, **kwargs)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: D102
            return timed(lambda: self.inner(output_tensor, input_tensor, group, op, async_op),
                         output_tensor, input_tensor, group, async_op, self.inner)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # fsdp_reshard=node: backward re-gathers over the post-forward group (a node's ranks), the same dimension
            for pg in _param_groups(module):
                post, main = getattr(pg, "post_forward_mesh_info", None), pg.mesh_info
                main_label = labels.get(main.shard_process_group.group_name)
                if post is not None and main_label is not None:
                    labels.setdefault(post.shard_process_group.group_name, main_label)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # around the unit's own collectives: FSDP2's, or the quantized ones apply_fsdp set (fsdp_quant)
            comms = getattr(module, "_syncwise_comms", {})
            module.set_custom_all_gather(TimedAllGather(comms.get("all_gather") or DefaultAllGather()))
            module.set_custom_reduce_scatter(TimedReduceScatter(comms.get("reduce_scatter") or DefaultReduceScatter()))


class _Later:
    """An interval stopped by a future's callback: read after the step, when it has completed."""

    def __init__(self, iv: Any) -> None:
        self.iv = iv

    def seconds(self) -> float:
        return self.iv.seconds() if self.iv.stopped else 0.0


# ---------------------------------------------------------------------------------------- compression
def _param_groups(unit: nn.Module) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.9 kept one group per unit
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return groups


def _shard_views(flat: torch.Tensor, fsdp_params: list) -> list[torch.Tensor]:
    """This rank's gradient shard of each parameter inside FSDP2's flat reduce-scatter output, in the layout
    ``foreach_reduce`` uses to hand them out (each parameter's dim-0 padded shard, back to back)."""
    views, offset = [], 0
    for fp in fsdp_params:
        views.append(torch.as_strided(flat, fp.sharded_size, fp.contiguous_sharded_stride, offset))
        offset += fp.padded_sharded_param_size.numel()
    if offset != flat.numel():
        raise RuntimeError(f"FSDP2's reduce output has {flat.numel()} elements, its parameters' padded shards "
                           f"{offset}: this torch lays the flat gradient out differently than syncwise expects")
    return views


def attach_compression(model: nn.Module, state: Any) -> None:
    """Run ``state``'s compressor (a ``CompressionHookState`` over the dp_replicate ranks) as the all-reduce
    across replicas of every FSDP2 unit of ``model``.

    ``apply_fsdp`` must have sharded over ``("dp_shard",)`` only: FSDP2 then reduce-scatters inside the
    replica group and calls the hook with that output, and the hook averages each parameter's shard across
    the replicas with the compressor, keyed by parameter name (error feedback, PowerSGD's Q, top-k momentum
    follow the parameter) — the HSDP all-reduce, compressed. The hook runs synchronously in FSDP2's
    post-backward, in unit order, which is the same on every rank, so the compressor's collectives line up
    without the DDP hook's worker thread."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        for group in _param_groups(unit):
            params = list(group.fsdp_params)
            keys = [names[id(fp.sharded_param)] for fp in params]
            if group._is_hsdp:
                raise ConfigError("dp_dims", "HSDP", "FSDP2 over dp_shard alone when syncwise compresses the "
                                  "replicas' all-reduce (HSDP would all-reduce them first)")

            def hook(flat: torch.Tensor, params: list = params, keys: list = keys) -> None:
                views = _shard_views(flat, params)
                state.average(views, keys, blocking=True)   # inside the backward: the step waits for it

            unit.set_all_reduce_hook(hook)


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
