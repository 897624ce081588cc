"""The seam the trainer talks to, one class per data-parallel kind (``parallelize`` chooses it once, by the layout).

* :class:`SingleProcess` — no data parallel (one rank, or tensor parallel alone);
* :class:`Replicas` — DDP with syncwise's gradient-sync hook (and a reduced-sync strategy over whole replicas);
* :class:`Sharded` — FSDP2: sharded (``dp_shard > 1``), HSDP (replicas of shards, FSDP2's own all-reduce, a
  compressor across the replica groups, or local steps over them), or replicas of a tensor-parallel model;
* :class:`PipelineStage` — this rank's pipeline stages (``pp > 1``), their replicas averaged after the schedule;
* :class:`ShardedPipelineStage` — pipeline stages that are each an FSDP2 root.

:class:`Parallelized`, their base, holds what every kind shares: the model and the module the step runs, the resolved
layout, the run's :class:`~syncwise.comm.CommLedger`, expert parallel's gradient sum, and the dispatch counter and
clocks of the collectives that bypass ``syncwise.comm`` (FSDP2's and DTensor's, armed by the layout's dimensions,
not by the kind). A kind says how a micro-batch's backward syncs (:meth:`Parallelized._backward`,
:meth:`Parallelized._synced`), what it adds to the step's bytes, seconds and metrics, how the gradient norm is taken,
and how step 5 of ``parallelize`` (data parallel) is applied to it (:meth:`Parallelized.apply_data_parallel`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.context import Topology
from ..comm.counting import CollectiveCounter, DimensionTimes, mesh_groups
from ..comm.stats import CommLedger
from ..errors import ConfigError, SyncwiseError
from ..layout import Layout, hierarchical_applies, node_reshard
from .data_parallel import DataParallel, StageGradientSync, apply_data_parallel
from .sync import build_sync
from .sync_spec import SyncStrategy

COUNTED_STEPS = 2  # steps whose FSDP2 / tensor-parallel collectives are counted (see Parallelized.begin_step)
TP_SAMPLE_EVERY = 10  # after those, tensor parallel's collectives are timed every this many steps (begin_step)


@dataclass(frozen=True)
class DataParallelInputs:
    """What ``parallelize`` hands to a kind's :meth:`Parallelized.apply_data_parallel` (its step 5)."""

    model: nn.Module                 # the model as given (a pipeline stage's ``Parallelized.model`` is its stages)
    compressor: Any                  # syncwise's compressor, a TorchHookSpec, or None
    sync: Any                        # the parsed reduced-sync spec, or None
    bucket_cap_mb: float
    min_numel: int
    device: torch.device
    world: int
    param_dtype: Optional[torch.dtype]


@dataclass
class Parallelized:
    """The parallel model and what the loop needs to know about its communication (the base of every kind)."""

    kind: ClassVar[str] = "single"
    fsdp: ClassVar[bool] = False     # FSDP2 holds the data-parallel ranks (Sharded, ShardedPipelineStage)
    pipeline = None                  # (not a field here) a PipelineStage's AsyncPipeline; None on the other kinds

    model: nn.Module                 # the model itself (evaluation, checkpoints, router updates)
    module: nn.Module                # what the step runs: wrapped (DDP), sharded (FSDP2/TP), compiled
    spec: Layout                     # resolved against the world size, with the compressor's and the sync's specs
    mesh: Any = None                 # the DeviceMesh (None in a single process)
    dp: DataParallel = field(default_factory=lambda: DataParallel(module=nn.Identity()))
    sync: Optional[SyncStrategy] = None
    dp_group: Any = None             # the data-parallel ranks of this rank's stage (None: every rank)
    expert_replicas: Any = None      # ranks holding the same routed experts (expert parallel; None: no copies)
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
    #: the part of the last counted_bytes() whose hop is known, per dimension ({dim: {'intra', 'cross'}}: FSDP2's
    #: timed comms, the dispatch counter's)
    counted_hops: dict = field(default_factory=dict)

    # ---- what the trainer asks of the model's shape ---------------------------------------------------------
    @property
    def parts(self) -> list[nn.Module]:
        """The modules this rank runs, each one root for tensor parallel and FSDP2: the model, or its stages."""
        return [self.model]

    @property
    def holds_all_layers(self) -> bool:
        """Whether this rank holds every layer of the model (not so on a pipeline stage: parameters it does not
        hold leave the optimizer)."""
        return True

    @property
    def accepts_mappings(self) -> bool:
        """Whether a batch's inputs may be a mapping of keyword arguments (a pipeline schedule takes tensors)."""
        return True

    def eval_loss(self, inputs: Any, targets: Any, loss: Callable[[nn.Module, Any, Any], torch.Tensor]
                  ) -> torch.Tensor:
        """One validation batch's loss: ``loss(model, inputs, targets)`` on the whole model."""
        return loss(self.model, inputs, targets)

    # ---- what the step asks ------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Gradients cross ranks (a data-parallel degree above 1, or experts split across ranks)."""
        return self.spec.ep > 1

    def syncs_gradients(self, step: int) -> bool:
        """Whether this step's last micro-batch syncs gradients (local SGD keeps them local after warm-up)."""
        return self.distributed and (self.sync is None or self.sync.syncs_gradients(step))

    @contextlib.contextmanager
    def micro_batch(self, syncing: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients sync only when ``syncing`` (the last
        micro-batch of a step); then the time the backward waited on the network is measured."""
        with self._counter if self._counting else contextlib.nullcontext():
            with self._backward(syncing):
                yield
            if syncing:
                self._synced()

    def _backward(self, syncing: bool) -> ContextManager[None]:
        """Around a micro-batch's forward and backward: what keeps its gradients local unless ``syncing``."""
        return contextlib.nullcontext()

    def _synced(self) -> None:
        """After the syncing micro-batch's backward: the gradient sync that follows it."""
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
        """The step's bytes that no ``CommStats`` sees, per dimension: FSDP2's (``dp``, ``fsdp``) and DTensor's
        (``tp``) collectives from the dispatch counter and FSDP2's timed comms, the pipeline's activations and their
        gradients (``pp``). The step meter (``syncwise.train.meter.StepBytes``) adds syncwise's own collectives and
        attributes them."""
        if self._counting:
            self._counted = dict(self._counter.bytes)
            self._counted_split = {d: dict(h) for d, h in self._counter.hops.items()}  # per hop, repeated too
            self._steps_counted += 1
            self._counting = False
        timed = self._times.take_bytes()  # FSDP2's all-gathers and reduce-scatters, every step
        hops = self._times.taken_hops()   # the part of them split per hop (comm.ops.cross_share)
        out = {"dp": self._counted.get("dp", 0) + timed.get("dp", 0), **self._shard_bytes(timed)}
        counted_dims = ["dp"]
        if self.spec.tp > 1:
            out["tp"] = self._counted.get("tp", 0)
            counted_dims.append("tp")
        # the dispatch counter's split of the labels reported (dp: HSDP's all-reduce; tp: DTensor's)
        for dim, split in getattr(self, "_counted_split", {}).items():
            if dim in counted_dims:
                mine = hops.setdefault(dim, {})
                for h, n in split.items():
                    mine[h] = mine.get(h, 0) + n
        self.counted_hops = hops
        return out

    def _shard_bytes(self, timed: dict[str, int]) -> dict[str, int]:
        """The step's bytes of sharded parameters' all-gathers and gradients' reduce-scatters (FSDP2's)."""
        return {}

    @property
    def replicas_timed(self) -> bool:
        """Whether the replicas' gradient traffic ('dp') has a clock (not so for HSDP's own all-reduce)."""
        return True

    def take_times(self) -> Callable[[], dict[str, tuple[float, Optional[float]]]]:
        """A reader of the step's seconds per dimension that no ``CommStats`` times: ``{dim: (seconds, exposed
        seconds or None)}`` — FSDP2's collectives ('fsdp', and 'dp' for FSDP2 over replicas), DTensor's ('tp'),
        and what the kind times itself (:meth:`_own_times`: a pipeline's waits on its neighbours). Read when the row
        is settled (CUDA events)."""
        reader = self._times.take()
        own = self._own_times()
        timed_tp = self._timing_tp

        def read() -> dict[str, tuple[float, Optional[float]]]:
            out = reader()
            if self.spec.tp > 1:  # a step the counter did not time repeats the last timed step's seconds
                if timed_tp and "tp" in out:
                    self._last_tp = out["tp"]
                elif self._last_tp is not None:
                    out["tp"] = self._last_tp
            out.update(own)
            return out
        return read

    def _own_times(self) -> dict[str, tuple[float, Optional[float]]]:
        """The step's seconds per dimension the kind measures itself, taken at the step's end."""
        return {}

    def step_metrics(self) -> dict[str, Optional[float]]:
        """What the parallel layout measured in the last step beyond bytes (a pipeline's bubble)."""
        return {}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip all gradients to ``max_norm`` (inf: only measure); the total norm as a plain tensor."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.spec.tp > 1 or self.spec.ep > 1:  # DTensors mixed with plain tensors (torch's clip refuses the mix)
            return self._clip_split(params, max_norm, across=None)
        from .fsdp import full_grad_norm
        return full_grad_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _clip_split(self, params: list, max_norm: float, across: Any) -> torch.Tensor:
        """The norm of gradients split over ranks (DTensors, experts; a pipeline's stages ``across`` a group)."""
        from .tensor_parallel import clip_grad_norm
        return clip_grad_norm(params, max_norm, across=across, stats=self.ledger.norm)

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
        return self.dp.hook_state

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (ranks in one tensor-parallel group read the same)."""
        return self.spec.dp_rank(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0

    @property
    def dp_size(self) -> int:
        return self.spec.dp

    @property
    def kind_label(self) -> Optional[str]:
        """How the data-parallel ranks sync, for the summary ('DDP', 'HSDP', ...); None: nothing to say."""
        return None

    # ---- how parallelize builds it ----------------------------------------------------------------------------
    def apply_data_parallel(self, given: DataParallelInputs) -> None:
        """Step 5 of ``parallelize``: data parallel over the ``dp_*`` dimensions (none in a single process)."""

    def count_dispatch(self) -> None:
        """Count (and for tensor parallel time) the collectives that bypass ``syncwise.comm``: FSDP2's and DTensor's
        (the dispatch counter, armed per step by :meth:`begin_step`)."""
        labels = {"dp_replicate": "dp", "dp_shard": "fsdp", "tp": "tp"}
        if self.dp.hook_state is not None or self.sync is not None:
            del labels["dp_replicate"]  # the compressor counts its own collectives (syncwise.comm)
        groups = mesh_groups(self.mesh, labels)
        self._time_fsdp(groups)
        self._counter = CollectiveCounter(groups, times=self._times, timed=("tp",))

    def _time_fsdp(self, groups: dict) -> None:
        """Count and time FSDP2's all-gathers and reduce-scatters by their own comms (FSDP2's kinds only)."""


@dataclass
class SingleProcess(Parallelized):
    """No data parallel: one process, or tensor parallel alone (every gradient is this rank's)."""

    kind: ClassVar[str] = "single"


@dataclass
class Replicas(Parallelized):
    """DDP over ``dp_replicate`` with syncwise's gradient-sync hook (compressed, timed, counted), and a
    reduced-sync strategy over the same whole replicas."""

    kind: ClassVar[str] = "ddp"

    @property
    def distributed(self) -> bool:
        return self.dp.distributed or super().distributed

    def _backward(self, syncing: bool) -> ContextManager[None]:
        return self._timed_backward(syncing)

    @contextlib.contextmanager
    def _timed_backward(self, syncing: bool) -> Iterator[None]:
        """DDP's ``no_sync`` unless ``syncing``; the bucket timer learns when the last gradient became ready."""
        with contextlib.nullcontext() if syncing else self.module.no_sync():
            self.dp.timer.reset()
            yield

    def _synced(self) -> None:
        self._exposed = self.dp.timer.backward_done()
        self.dp.record_sync()
        super()._synced()

    @property
    def kind_label(self) -> Optional[str]:
        return "DDP" if self.dp.distributed else None

    def apply_data_parallel(self, given: DataParallelInputs) -> None:
        """dp_replicate alone: DDP (the experts of expert parallel excluded: summed in their own group); then the
        reduced-sync strategy over the same ranks (whole replicas only: Layout.check)."""
        spec, model = self.spec, self.model
        ignore = _expert_names(model) if spec.ep > 1 else None
        self.dp = apply_data_parallel(model, given.compressor, given.bucket_cap_mb, given.min_numel, given.device,
                                      process_group=self.dp_group, ignore=ignore, inline_compress=spec.ep > 1,
                                      hierarchical=_hierarchical_here(spec, given.world), stats=self.ledger.dp)
        self.module = self.dp.module
        self.sync = build_sync(given.sync, model, stats=self.ledger.dp)


@dataclass
class Sharded(Parallelized):
    """FSDP2 over the data-parallel dimensions: sharded, HSDP (FSDP2's own all-reduce across the replica groups, a
    syncwise compressor as that all-reduce, or local steps over the groups), or replicas of a tensor-parallel model."""

    kind: ClassVar[str] = "fsdp"
    fsdp: ClassVar[bool] = True
    _warmup_sync: bool = False         # local steps over HSDP's replica groups: this step is a warm-up step

    @property
    def distributed(self) -> bool:
        return True

    def syncs_gradients(self, step: int) -> bool:
        # Local steps over HSDP's replica groups: FSDP2 (over dp_shard alone) reduce-scatters every step; the sync
        # strategy keeps the replica groups apart between its outer steps.
        if self.sync is not None:  # a warm-up step also averages the gradients across the groups
            self._warmup_sync = self.sync.syncs_gradients(step)
        return True

    def _backward(self, syncing: bool) -> ContextManager[None]:
        from .fsdp import no_gradient_sync
        return no_gradient_sync(self.module, last=syncing)

    def _synced(self) -> None:
        if self.dp.hook_state is not None:  # the compressor across the replica groups (FSDP2's all-reduce hook)
            self.dp.hook_state.steps += 1
        super()._synced()

    def _shard_bytes(self, timed: dict[str, int]) -> dict[str, int]:
        return {"fsdp": timed.get("fsdp", 0)} if self.spec.dp_shard > 1 else {}

    @property
    def replicas_timed(self) -> bool:
        """Not HSDP's own all-reduce across replicas, which FSDP2 issues inside its reduce (counted by the dispatch
        counter, timed by nothing)."""
        return not (self.spec.dp_replicate > 1 and self.spec.dp_shard > 1 and self.dp.hook_state is None)

    @property
    def kind_label(self) -> Optional[str]:
        if self.spec.dp_replicate == 1 and getattr(self, "hierarchical_reduce", False):
            return (f"FSDP2, {self.spec.compress.name} reduce-scatter hierarchical: fp32 inside a node, "
                    f"{self.spec.compress.name} across")
        return "FSDP2" if self.spec.dp_replicate == 1 else "HSDP, local steps" if self.sync is not None else \
            "HSDP" if self.spec.sharded else "FSDP2 replicas"

    def apply_data_parallel(self, given: DataParallelInputs) -> None:
        """FSDP2 on each root (the model, or each pipeline stage: torch's PipelineStage defers its reduce-scatter to
        the last microbatch's backward). Replicas of a tensor-parallel model go through FSDP2 too (HSDP with shards
        of one): DDP would turn TP's DTensors back into local tensors (torch's DDP + TP work-around), and then
        neither gradient clipping nor resharding checkpoints would see the sharded parameters."""
        from .fsdp import apply_fsdp, attach_compression, fsdp_gradient_sync, fsdp_reduce_codec
        from .fsdp_quant import gather_codec
        spec, mesh, roots, param_dtype = self.spec, self.mesh, self.parts, given.param_dtype
        reduce_dtype, compress_replicas = fsdp_gradient_sync(spec.compress, spec.dp_replicate, spec.dp_shard, spec.pp)
        # parallel.fsdp_gather / fsdp_reshard and the quantized reduce-scatter (int8 / fp8, one replica): every
        # apply_fsdp below takes them (docs/parallelism.md)
        quant = {"reduce_codec": fsdp_reduce_codec(spec.compress, spec.dp_replicate, spec.dp_shard, spec.pp),
                 "gather_codec": gather_codec(spec.fsdp_gather),
                 "reshard_after_forward": _fsdp_reshard(spec, given.world),
                 "seed": int(spec.compress.options.get("seed", 0) or 0)}
        # dist.hierarchical: the quantized reduce-scatter sums inside a node in fp32, quantizes across nodes
        quant["hierarchical_reduce"] = quant["reduce_codec"] is not None and _hierarchical_here(spec, given.world)
        self.hierarchical_reduce = quant["hierarchical_reduce"]
        if given.sync is not None:
            # Local steps over HSDP's replica groups (Layout.check allows dp_shard × dp_replicate ≥ 2 only): FSDP2
            # inside each replica group, no gradient all-reduce across the groups; every period the sync strategy
            # averages each rank's local shards with the same shard of the other groups (the dp_replicate group).
            for root in roots:
                apply_fsdp(root, mesh, ("dp_shard",), param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype or torch.float32, **quant)
            self.sync = build_sync(given.sync, given.model, group=mesh["dp_replicate"].get_group(),
                                   stats=self.ledger.dp)
            if self.sync is not None and given.sync.warmup:
                self._attach_warmup_all_reduce(mesh["dp_replicate"].get_group())
        elif compress_replicas:
            # FSDP2 inside each replica group; syncwise's compressor is the all-reduce across the groups.
            self.dp = DataParallel(module=given.model, hook_state=None)
            for root in roots:
                apply_fsdp(root, mesh, ("dp_shard",), param_dtype=param_dtype, reduce_dtype=torch.float32, **quant)
            self.dp.hook_state = _replica_hook_state(given.compressor, mesh, self.model, given.min_numel)
            for root in roots:
                attach_compression(root, self.dp.hook_state)
        else:
            # HSDP over both data-parallel dimensions; apply_fsdp treats one replica (1 × N) as plain FSDP2.
            for root in roots:
                apply_fsdp(root, mesh, ("dp_replicate", "dp_shard"), param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype or torch.float32, **quant)

    def _attach_warmup_all_reduce(self, group: Any) -> None:
        """The warm-up of local steps over HSDP's replica groups (``warmup=W``): during its steps each FSDP2 unit's
        reduce-scatter output (this rank's gradient shard, averaged inside its group) is averaged across the groups
        too (FSDP2's all-reduce hook; what HSDP's own all-reduce would do), so every group takes the same steps until
        the outer loop starts from identical replicas. Counted in the run's ``ledger.dp``."""
        from torch.distributed.fsdp import FSDPModule

        from ..comm import ops

        def hook(flat: torch.Tensor) -> None:
            if self._warmup_sync:
                ops.all_reduce(flat, "avg", group=group, stats=self.ledger.dp)

        for root in self.parts:
            for unit in [m for m in root.modules() if isinstance(m, FSDPModule)]:
                unit.set_all_reduce_hook(hook)

    def _time_fsdp(self, groups: dict) -> None:
        from .fsdp import attach_timing
        for root in self.parts:
            attach_timing(root, self._times, groups)


@dataclass
class PipelineStage(Parallelized):
    """This rank's pipeline stages (``pp > 1``, ``AsyncPipeline``): the schedule runs every microbatch of a step;
    then the stages' replicas average their gradients (``StageGradientSync``)."""

    kind: ClassVar[str] = "pipeline"
    pipeline: Any = None             # AsyncPipeline: runs this rank's stages; the step calls its step()
    stage_sync: Any = None           # StageGradientSync: a pipeline stage's data parallel (dp > 1)

    @property
    def parts(self) -> list[nn.Module]:
        return self.pipeline.stage_modules

    @property
    def holds_all_layers(self) -> bool:
        return False

    @property
    def accepts_mappings(self) -> bool:
        return False

    def eval_loss(self, inputs: Any, targets: Any, loss: Callable[[nn.Module, Any, Any], torch.Tensor]
                  ) -> torch.Tensor:
        """Every stage runs its part; the last one's loss is broadcast."""
        return self.pipeline.eval_loss(inputs, targets)

    @property
    def distributed(self) -> bool:
        return super().distributed or self.stage_sync is not None

    def _backward(self, syncing: bool) -> ContextManager[None]:
        """Nothing: the schedule runs every microbatch (FSDP2 stages reduce-scatter in the last one's backward)."""
        return contextlib.nullcontext()

    def _synced(self) -> None:
        if self.stage_sync is not None:  # the stage's replicas average their gradients after the schedule
            self._exposed = self.stage_sync.sync()  # a reader (CUDA events on a GPU)
        super()._synced()

    def counted_bytes(self) -> dict[str, int]:
        # activations and their gradients sent to the neighbouring stages
        return {**super().counted_bytes(), "pp": self.pipeline.last_p2p_bytes}

    def _own_times(self) -> dict[str, tuple[float, Optional[float]]]:
        """'pp': the step's time its stages did not compute — the activations and gradients in transit and the
        schedule's bubble, which on a pipeline are one wait."""
        if self.pipeline.last_step_s is None:
            return {}
        wait = max(0.0, self.pipeline.last_step_s - (self.pipeline.last_compute_s or 0.0))
        return {"pp": (wait, wait)}

    def step_metrics(self) -> dict[str, Optional[float]]:
        """The pipeline bubble (the share of the step this rank's stages did not compute)."""
        return {"pp_bubble": self.pipeline.last_bubble}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm combines over the stages (each holds some of the layers)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return self._clip_split(params, max_norm, across=self.mesh["pp"].get_group())

    @property
    def compression_state(self) -> Any:
        return super().compression_state or (self.stage_sync.hook_state if self.stage_sync is not None else None)

    def split(self, model: nn.Module, device: torch.device, loss_fn: Any, split_fn: Any) -> None:
        """Cut ``model`` into this rank's pipeline stages (``AsyncPipeline.partition_model``: layers balanced by
        FLOPs) and make ``self.model`` their union under the full model's names (checkpoints, the optimizer, router
        biases)."""
        from .mesh import adopt_mesh
        from .pipeline import AsyncPipeline

        spec, mesh = self.spec, self.mesh
        pipe = AsyncPipeline(spec.pp * spec.stages_per_rank, schedule=spec.pp_schedule,
                             microbatches=spec.microbatches, loss_fn=loss_fn, group=mesh["pp"].get_group(),
                             device=device, stats=self.ledger.pp)
        pipe.partition_model(model, split_fn)
        self.pipeline, self.model, self.module = pipe, pipe.module, pipe.module
        # The stage's data-parallel ranks (replicas × shards): its gradient sync and the MoE load counts' sum (layers
        # differ between stages, so the counts cannot be summed over the world).
        if spec.dp_shard == 1:
            self.dp_group = mesh["dp_replicate"].get_group()
        elif spec.dp_replicate == 1:
            self.dp_group = mesh["dp_shard"].get_group()
        else:
            self.dp_group = adopt_mesh(mesh["dp_replicate", "dp_shard"]._flatten("dp")).get_group()

    def apply_data_parallel(self, given: DataParallelInputs) -> None:
        """This rank's stages' gradients averaged over their replicas after the schedule (none without replicas)."""
        if self.spec.dp == 1:
            return
        self.stage_sync = StageGradientSync(self.model, given.compressor, self.dp_group, given.bucket_cap_mb,
                                            given.min_numel, stats=self.ledger.dp,
                                            ignore=_expert_names(self.model) if self.spec.ep > 1 else None)


@dataclass
class ShardedPipelineStage(PipelineStage, Sharded):
    """Pipeline stages that are each an FSDP2 root: the schedule as a :class:`PipelineStage` (the last microbatch's
    backward reduce-scatters), FSDP2's counting, clocks and labels as :class:`Sharded`."""

    kind: ClassVar[str] = "pipeline-fsdp"
    apply_data_parallel = Sharded.apply_data_parallel


def kind_of(spec: Layout) -> type[Parallelized]:
    """The :class:`Parallelized` kind that runs ``spec`` (resolved), chosen once by ``parallelize``."""
    data_parallel = spec.dp_replicate > 1 or spec.dp_shard > 1
    if spec.pp > 1:
        return ShardedPipelineStage if data_parallel and spec.fsdp else PipelineStage
    if not data_parallel:
        return SingleProcess
    return Sharded if spec.fsdp else Replicas


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
