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

The trainer talks only to the returned :class:`Parallelized`: ``module`` to run, ``micro_batch(syncing)``
around each micro-batch's forward/backward (DDP's ``no_sync`` and FSDP2's ``set_requires_gradient_sync``
behind one name, with the exposed-communication timer), ``take_exposed()`` / ``counted_bytes()`` per parallel
dimension, ``state_components()`` for checkpoints, ``clip_grad_norm`` that works on sharded gradients, and
``ledger``: the run's :class:`~syncwise.comm.CommLedger`, made here (or given) and handed to every wrapper, hook,
compressor and strategy built here, so each counts its collectives into this run's counters and no one else's.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.context import Topology
from ..comm.counting import CollectiveCounter, DimensionTimes, mesh_groups
from ..comm.stats import CommLedger
from ..errors import ConfigError, SyncwiseError
from ..layout import NO_COMPRESS, Compress, Layout, hierarchical_applies, node_reshard, parse_compress, parse_sync
from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import DataParallel, StageGradientSync, apply_data_parallel, compressor_of
from .mesh import adopt_mesh, build_mesh, check_torch_support
from .sync import build_sync
from .sync_spec import SyncStrategy
from ..layout import BUCKET_CAP_MB, MIN_NUMEL


COUNTED_STEPS = 2  # steps whose FSDP2 / tensor-parallel collectives are counted (see Parallelized.begin_step)
TP_SAMPLE_EVERY = 10  # after those, tensor parallel's collectives are timed every this many steps (begin_step)


@dataclass
class Parallelized:
    """The parallel model and what the loop needs to know about its communication."""

    model: nn.Module                 # the model itself (evaluation, checkpoints, router updates)
    module: nn.Module                # what the step runs: wrapped (DDP), sharded (FSDP2/TP), compiled
    spec: Layout                     # resolved against the world size, with the compressor's and the sync's specs
    mesh: Any = None                 # the DeviceMesh (None in a single process)
    dp: DataParallel = field(default_factory=lambda: DataParallel(module=nn.Identity()))
    sync: Optional[SyncStrategy] = None
    fsdp: bool = False
    dp_group: Any = None             # the data-parallel ranks of this rank's stage (None: every rank)
    expert_replicas: Any = None      # ranks holding the same routed experts (expert parallel; None: no copies)
    pipeline: Any = None             # AsyncPipeline (pp > 1): runs this rank's stages; the step calls its step()
    stage_sync: Any = None           # StageGradientSync: a pipeline stage's data parallel (pp > 1, dp > 1)
    ledger: CommLedger = field(default_factory=CommLedger)  # the run's counters of syncwise's own collectives
    _exposed: Callable[[], float] = lambda: 0.0
    _counter: Optional[CollectiveCounter] = None  # FSDP2's and DTensor's collectives (they bypass syncwise.comm)
    _times: DimensionTimes = field(default_factory=DimensionTimes)  # FSDP2's (timed comms) and DTensor's clocks
    _counting: bool = False
    _steps_counted: int = 0
    _steps_begun: int = 0
    _counted: dict = field(default_factory=dict)
    _last_tp: Optional[tuple] = None  # the last timed step's tensor-parallel (seconds, exposed seconds)
    _timing_tp: bool = False           # whether this step's tensor-parallel collectives are timed
    _warmup_sync: bool = False         # local steps over HSDP's replica groups: this step is a warm-up step

    # ---- what the step asks ------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Gradients cross ranks (a data-parallel degree above 1, or experts split across ranks)."""
        return self.fsdp or self.dp.distributed or self.spec.ep > 1 or self.stage_sync is not None

    def syncs_gradients(self, step: int) -> bool:
        """Whether this step's last micro-batch syncs gradients (local SGD keeps them local after warm-up)."""
        # Local steps over HSDP's replica groups: FSDP2 (over dp_shard alone) reduce-scatters every step; the sync
        # strategy keeps the replica groups apart between its outer steps.
        if self.fsdp and self.sync is not None:  # a warm-up step also averages the gradients across the groups
            self._warmup_sync = self.sync.syncs_gradients(step)
        return self.distributed and (self.sync is None or self.fsdp or self.sync.syncs_gradients(step))

    @contextlib.contextmanager
    def micro_batch(self, syncing: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients sync only when ``syncing`` (the last
        micro-batch of a step); then the time the backward waited on the network is measured."""
        with self._counter if self._counting else contextlib.nullcontext():
            if self.pipeline is not None:  # the schedule runs every microbatch; then the stage's replicas sync
                yield                      # (FSDP2 stages reduce-scatter in the last microbatch's backward)
                if syncing and self.stage_sync is not None:
                    self._exposed = self.stage_sync.sync()  # a reader (CUDA events on a GPU)
                if syncing and self.dp.hook_state is not None:
                    self.dp.hook_state.steps += 1
                if syncing:
                    self._reduce_expert_gradients()
            elif self.fsdp:
                from .fsdp import no_gradient_sync
                with no_gradient_sync(self.module, last=syncing):
                    yield
                if syncing and self.dp.hook_state is not None:
                    self.dp.hook_state.steps += 1
            elif self.dp.distributed:
                timer = self.dp.timer
                with contextlib.nullcontext() if syncing else self.module.no_sync():
                    timer.reset()
                    yield
                    if syncing:
                        self._exposed = timer.backward_done()
                        self.dp.record_sync()
                if syncing:
                    self._reduce_expert_gradients()
            else:
                yield
                if syncing:
                    self._reduce_expert_gradients()

    def _reduce_expert_gradients(self) -> None:
        """Expert parallel: each routed expert's gradient already sums its ep group's tokens; sum it over the
        ranks holding the same experts and divide by dp, as the dense ones are averaged. With a compressor, the
        sum over the copies is the compressor's average over them (× copies), so expert gradients cross the
        network compressed too (the hook's worker is idle once the syncing backward has returned)."""
        if self.spec.ep == 1:
            return
        from .expert_parallel import reduce_expert_gradients
        state = self.compression_state
        reduce_expert_gradients(self.model, self.spec.dp, self.expert_replicas, stats=self.ledger.dp,
                                compressed=state if state is not None and state.compressor.name != "none" else None)

    def take_exposed(self) -> Callable[[], float]:
        """The reader of the last syncing backward's exposed communication (seconds); resets it."""
        reader, self._exposed = self._exposed, (lambda: 0.0)
        return reader

    def begin_step(self) -> None:
        """Arm the dispatch counter for this step: FSDP2's and DTensor's collectives (they bypass syncwise.comm)
        are counted during the first ``COUNTED_STEPS`` steps only (it intercepts every operator: ~20 % of a small
        model's step on a CPU); later steps repeat the last count. With tensor parallel it is also the clock of
        DTensor's collectives, so it runs again every ``TP_SAMPLE_EVERY`` steps and the steps between repeat the
        last timed step's tensor-parallel seconds (a fixed layout sends the same collectives every step): ~2 % of
        the step instead of ~20 %. (FSDP2's all-gathers and reduce-scatters are counted and timed every step by
        their own comms.)"""
        self._steps_begun += 1
        self._counting = self._counter is not None and (
            self._steps_counted < COUNTED_STEPS or (self.spec.tp > 1 and self._steps_begun % TP_SAMPLE_EVERY == 0))
        self._timing_tp = self.spec.tp > 1 and self._counting
        if self._counting:
            self._counter.reset()
        self._times.take()  # collectives between steps are not the step's
        self._times.take_bytes()

    def counted_bytes(self) -> dict[str, int]:
        """The step's bytes that no ``CommStats`` sees, per dimension: FSDP2's (``dp``) and DTensor's (``tp``)
        collectives from the dispatch counter, the pipeline's activations and their gradients (``pp``). The step
        meter (``syncwise.train.meter.StepBytes``) adds syncwise's own collectives and attributes them."""
        if self._counting:
            self._counted = dict(self._counter.bytes)
            self._steps_counted += 1
            self._counting = False
        timed = self._times.take_bytes()  # FSDP2's all-gathers and reduce-scatters, every step
        out = {"dp": self._counted.get("dp", 0) + timed.get("dp", 0)}
        if self.fsdp and self.spec.dp_shard > 1:
            out["fsdp"] = timed.get("fsdp", 0)
        if self.spec.tp > 1:
            out["tp"] = self._counted.get("tp", 0)
        if self.pipeline is not None:  # activations and their gradients sent to the neighbouring stages
            out["pp"] = self.pipeline.last_p2p_bytes
        return out

    @property
    def replicas_timed(self) -> bool:
        """Whether the replicas' gradient traffic ('dp') has a clock: not HSDP's own all-reduce across replicas,
        which FSDP2 issues inside its reduce (counted by the dispatch counter, timed by nothing)."""
        return not (self.fsdp and self.spec.dp_replicate > 1 and self.spec.dp_shard > 1
                    and self.dp.hook_state is None)

    def take_times(self) -> Callable[[], dict[str, tuple[float, Optional[float]]]]:
        """A reader of the step's seconds per dimension that no ``CommStats`` times: ``{dim: (seconds, exposed
        seconds or None)}`` — FSDP2's collectives ('fsdp', and 'dp' for FSDP2 over replicas), DTensor's ('tp'),
        the pipeline's waits on its neighbours ('pp': the step's time its stages did not compute — the activations
        and gradients in transit and the schedule's bubble, which on a pipeline are one wait). Read when the row is
        settled (CUDA events)."""
        reader = self._times.take()
        pp = None
        if self.pipeline is not None and self.pipeline.last_step_s is not None:
            wait = max(0.0, self.pipeline.last_step_s - (self.pipeline.last_compute_s or 0.0))
            pp = (wait, wait)

        timed_tp = self._timing_tp

        def read() -> dict[str, tuple[float, Optional[float]]]:
            out = reader()
            if self.spec.tp > 1:  # a step the counter did not time repeats the last timed step's seconds
                if timed_tp and "tp" in out:
                    self._last_tp = out["tp"]
                elif self._last_tp is not None:
                    out["tp"] = self._last_tp
            if pp is not None:
                out["pp"] = pp
            return out
        return read

    def step_metrics(self) -> dict[str, Optional[float]]:
        """What the parallel layout measured in the last step beyond bytes: the pipeline bubble (the share of
        the step this rank's stages did not compute)."""
        return {"pp_bubble": self.pipeline.last_bubble} if self.pipeline is not None else {}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip all gradients to ``max_norm`` (inf: only measure); the total norm as a plain tensor."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        # DTensors mixed with plain tensors (torch's clip refuses the mix), or a pipeline stage's layers (the norm
        # combines over the stages)
        if self.spec.tp > 1 or self.spec.ep > 1 or self.pipeline is not None:
            from .tensor_parallel import clip_grad_norm
            across = self.mesh["pp"].get_group() if self.pipeline is not None else None
            return clip_grad_norm(params, max_norm, across=across, stats=self.ledger.norm)
        from .fsdp import full_grad_norm
        return full_grad_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def state_components(self) -> dict[str, tuple[Any, bool]]:
        """Checkpointable state the parallel wrappers own: name → (component, per rank)."""
        out: dict[str, tuple[Any, bool]] = {}
        if self.compression_state is not None:
            out["compressor"] = (self.compression_state, True)
        if self.sync is not None:
            out["sync"] = (self.sync, True)
        return out

    def close(self) -> None:
        """Stop the compression hook's worker thread between runs (it restarts on the next bucket): a thread left
        blocked at interpreter exit, while the process groups are torn down, is one more thing that can abort it."""
        if self.compression_state is not None:
            self.compression_state.close()

    @property
    def compression_state(self) -> Any:
        """The run's gradient-compression state (CompressionHookState), wherever the layout keeps it: DDP's hook,
        FSDP2's all-reduce hook or a pipeline stage's sync; None without one."""
        return self.dp.hook_state or (self.stage_sync.hook_state if self.stage_sync is not None else None)

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (ranks in one tensor-parallel group read the same)."""
        return self.spec.dp_rank(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0

    @property
    def dp_size(self) -> int:
        return self.spec.dp


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
    par = Parallelized(model=model, module=model, spec=spec, mesh=mesh, ledger=ledger)
    # 2. pipeline: this rank's stages; the other layers are dropped before anything below shards or copies them
    if spec.pp > 1:
        _split_pipeline(par, model, mesh, device, loss_fn, split_fn)
    parts = par.pipeline.stage_modules if par.pipeline is not None else [model]
    # 3. tensor / sequence parallel, on each part (a stage's plan covers the layers it has)
    if spec.tp > 1:
        from .tensor_parallel import apply_tensor_parallel
        for part in parts:
            apply_tensor_parallel(part, mesh["tp"], plan=tp_plan)
    # 4. expert parallel: each MoE layer's routed experts split over ep data-parallel neighbours (all-to-all)
    if spec.ep > 1:
        from .expert_parallel import apply_expert_parallel
        from .mesh import build_expert_mesh
        expert_mesh = build_expert_mesh(spec, device.type)  # (collective: every rank builds it)
        if any(True for _ in getattr(par.model, "moe_layers", lambda: ())()):  # a stage may hold dense layers only
            apply_expert_parallel(par.model, expert_mesh["ep"], dispatch=spec.ep_dispatch, stats=ledger.ep)
        par.expert_replicas = expert_mesh["ep_replicate"].get_group() if spec.dp > spec.ep else None
    # 5. data parallel
    dp_dims = tuple(n for n in ("dp_replicate", "dp_shard") if getattr(spec, n) > 1)
    # Replicas of a tensor-parallel model go through FSDP2 too (HSDP with shards of one): DDP would turn TP's
    # DTensors back into local tensors (torch's DDP + TP work-around), and then neither gradient clipping nor
    # resharding checkpoints would see the sharded parameters.
    if dp_dims and spec.fsdp:
        from .fsdp import apply_fsdp, attach_compression, fsdp_gradient_sync, fsdp_reduce_codec
        from .fsdp_quant import gather_codec
        reduce_dtype, compress_replicas = fsdp_gradient_sync(spec.compress, spec.dp_replicate, spec.dp_shard, spec.pp)
        # parallel.fsdp_gather / fsdp_reshard and the quantized reduce-scatter (int8 / fp8, one replica): every
        # apply_fsdp below takes them (docs/parallelism.md)
        quant = {"reduce_codec": fsdp_reduce_codec(spec.compress, spec.dp_replicate, spec.dp_shard, spec.pp),
                 "gather_codec": gather_codec(spec.fsdp_gather),
                 "reshard_after_forward": _fsdp_reshard(spec, world),
                 "seed": int(spec.compress.options.get("seed", 0) or 0)}
        # Each pipeline stage is its own FSDP2 root (torch's PipelineStage defers its reduce-scatter to the last
        # microbatch's backward).
        roots = parts
        if sync is not None:
            # Local steps over HSDP's replica groups (Layout.check allows dp_shard × dp_replicate ≥ 2 only): FSDP2
            # inside each replica group, no gradient all-reduce across the groups; every period the sync strategy
            # averages each rank's local shards with the same shard of the other groups (the dp_replicate group).
            for root in roots:
                apply_fsdp(root, mesh, ("dp_shard",), param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype or torch.float32, **quant)
            par.sync = build_sync(sync, model, group=mesh["dp_replicate"].get_group(), stats=ledger.dp)
            if par.sync is not None and sync.warmup:
                _attach_warmup_all_reduce(roots, par, mesh["dp_replicate"].get_group())
        elif compress_replicas:
            # FSDP2 inside each replica group; syncwise's compressor is the all-reduce across the groups.
            par.dp = DataParallel(module=model, hook_state=None)
            for root in roots:
                apply_fsdp(root, mesh, ("dp_shard",), param_dtype=param_dtype, reduce_dtype=torch.float32, **quant)
            par.dp.hook_state = _replica_hook_state(compressor, mesh, par.model, min_numel)
            for root in roots:
                attach_compression(root, par.dp.hook_state)
        else:
            # HSDP over both data-parallel dimensions; apply_fsdp treats one replica (1 × N) as plain FSDP2.
            for root in roots:
                apply_fsdp(root, mesh, ("dp_replicate", "dp_shard"), param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype or torch.float32, **quant)
        par.fsdp = True
    elif dp_dims and par.pipeline is not None:  # this rank's stages' gradients averaged over their replicas
        par.stage_sync = StageGradientSync(par.model, compressor, par.dp_group, bucket_cap_mb, min_numel,
                                           ignore=_expert_names(par.model) if spec.ep > 1 else None, stats=ledger.dp)
    elif dp_dims:  # dp_replicate alone: DDP (the experts of expert parallel excluded: summed in their own group)
        ignore = _expert_names(model) if spec.ep > 1 else None
        par.dp = apply_data_parallel(model, compressor, bucket_cap_mb, min_numel, device, process_group=par.dp_group,
                                     ignore=ignore, inline_compress=spec.ep > 1,
                                     hierarchical=_hierarchical_here(spec, world), stats=ledger.dp)
        par.module = par.dp.module
        # 6. reduced-sync strategy, over the same ranks (whole replicas only: Layout.check)
        par.sync = build_sync(sync, model, stats=ledger.dp)
    if spec.fsdp and mesh is not None and not compile:  # (a dispatch mode would recompile a compiled module)
        labels = {"dp_replicate": "dp", "dp_shard": "fsdp", "tp": "tp"}
        if par.dp.hook_state is not None or par.sync is not None:
            del labels["dp_replicate"]  # the compressor counts its own collectives (syncwise.comm)
        groups = mesh_groups(mesh, labels)
        if dp_dims:
            from .fsdp import attach_timing
            for root in (par.pipeline.stage_modules if par.pipeline is not None else [model]):
                attach_timing(root, par._times, groups)
        par._counter = CollectiveCounter(groups, times=par._times, timed=("tp",))
    # 7. compile
    if compile:
        par.module = torch.compile(par.module)
    return par


def _count_compressor_in(compressor: Any, ledger: CommLedger) -> None:
    """A syncwise compressor counts its collectives into the run's ``ledger.dp`` (torch's hooks have no counter)."""
    from ..compress.base import Compressor

    if isinstance(compressor, Compressor):
        compressor.stats = ledger.dp


def _attach_warmup_all_reduce(roots: list, par: Parallelized, group: Any) -> None:
    """The warm-up of local steps over HSDP's replica groups (``warmup=W``): during its steps each FSDP2 unit's
    reduce-scatter output (this rank's gradient shard, averaged inside its group) is averaged across the groups too
    (FSDP2's all-reduce hook; what HSDP's own all-reduce would do), so every group takes the same steps until the
    outer loop starts from identical replicas. Counted in the run's ``ledger.dp``."""
    from torch.distributed.fsdp import FSDPModule

    from ..comm import ops

    def hook(flat: torch.Tensor) -> None:
        if par._warmup_sync:
            ops.all_reduce(flat, "avg", group=group, stats=par.ledger.dp)

    for root in roots:
        for unit in [m for m in root.modules() if isinstance(m, FSDPModule)]:
            unit.set_all_reduce_hook(hook)


def _fsdp_reshard(spec: Layout, world: int) -> "bool | int":
    """FSDP2's reshard_after_forward for parallel.fsdp_reshard on this job's nodes (torchrun's LOCAL_WORLD_SIZE;
    the rule: ``layout.node_reshard``)."""
    if spec.fsdp_reshard != "node":
        return spec.fsdp_reshard == "all"
    return node_reshard(spec, Topology.from_env(world).procs_per_node)


def _hierarchical_here(spec: Layout, world: int) -> bool:
    """dist.hierarchical on this job's topology (torchrun's LOCAL_WORLD_SIZE; ``layout.hierarchical_applies``).
    Under 'auto' a topology the hierarchical sync cannot split (uneven nodes) keeps the flat sync."""
    if spec.hierarchical == "off" or world < 2:
        return False
    try:
        topo = Topology.from_env(world)
    except (ConfigError, SyncwiseError):
        if spec.hierarchical == "auto":
            return False
        raise
    return hierarchical_applies(spec, topo.nodes, topo.procs_per_node)


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
        return Compress(str(text).split(":")[0].strip().lower(), {}, str(text))


def _split_pipeline(par: Parallelized, model: nn.Module, mesh: Any, device: torch.device, loss_fn: Any,
                    split_fn: Any) -> None:
    """Cut ``model`` into this rank's pipeline stages (``AsyncPipeline.partition_model``: layers balanced by FLOPs)
    and make ``par.model`` their union under the full model's names (checkpoints, the optimizer, router biases)."""
    from .pipeline import AsyncPipeline

    spec = par.spec
    pipe = AsyncPipeline(spec.pp * spec.stages_per_rank, schedule=spec.pp_schedule, microbatches=spec.microbatches,
                         loss_fn=loss_fn, group=mesh["pp"].get_group(), device=device, stats=par.ledger.pp)
    pipe.partition_model(model, split_fn)
    par.pipeline, par.model, par.module = pipe, pipe.module, pipe.module
    # The stage's data-parallel ranks (replicas × shards): its gradient sync and the MoE load counts' sum (layers
    # differ between stages, so the counts cannot be summed over the world).
    if spec.dp_shard == 1:
        par.dp_group = mesh["dp_replicate"].get_group()
    elif spec.dp_replicate == 1:
        par.dp_group = mesh["dp_shard"].get_group()
    else:
        par.dp_group = adopt_mesh(mesh["dp_replicate", "dp_shard"]._flatten("dp")).get_group()


def _expert_names(model: nn.Module) -> list[str]:
    from .expert_parallel import expert_parameters
    return list(expert_parameters(model))


def _replica_hook_state(compressor: Any, mesh: Any, model: nn.Module, min_numel: int) -> Any:
    """The compression hook's state over this rank's dp_replicate group."""
    from ..compress import CompressionHookState, CompressionPolicy

    # The mesh's own group, not a dedicated one: new_group is collective over the whole world, and each rank
    # here knows only its own replicate group; FSDP2 (over dp_shard alone) never uses this group itself.
    return CompressionHookState(compressor, process_group=mesh["dp_replicate"].get_group(), param_names=model,
                                policy=CompressionPolicy(min_numel=min_numel), dedicated_group=False)


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
    kind = "FSDP2" if par.fsdp and par.spec.dp_replicate == 1 else \
        "HSDP, local steps" if par.fsdp and par.sync is not None else \
        "HSDP" if par.fsdp and par.spec.sharded else \
        "FSDP2 replicas" if par.fsdp else "DDP" if par.dp.distributed else None
    topo = par.dp.hierarchical
    if topo is not None and kind:  # dist.hierarchical: where the compressor runs, for the summary and metrics
        kind += (f", hierarchical sync on {topo.nodes} nodes × {topo.procs_per_node}: fp32 inside a node, "
                 + ("compressed across" if par.dp.hook_state is not None else "fp32 across"))
    return par.spec.describe + (f" ({kind})" if kind else "")
