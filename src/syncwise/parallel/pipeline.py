"""Pipeline parallelism on ``torch.distributed.pipelining``: the schedules, the layer split, ``AsyncPipeline``.

syncwise writes no scheduler: ``AsyncPipeline`` is a thin front to torch's ``PipelineStage`` and its schedules
(GPipe, 1F1B, interleaved 1F1B, looped BFS, zero bubble, ZB-V, DualPipeV). What it adds:

* ``check_pipeline`` — every rule the schedules enforce (and the ones they would only meet at run time), as
  ``ConfigError``s before any worker starts;
* ``split_layers`` / ``build_stage_modules`` — the DeepSeek model cut into contiguous layer ranges balanced by the
  model's own FLOPs count (``deepseek.flops_per_token``); each stage is the model itself with the other layers,
  the embedding (except on the first stage) and the norm + head (except on the last) removed, so parameter
  names stay the full model's and ``torch.distributed.checkpoint`` reshards between pp and non-pp layouts;
* the loss: each microbatch's mean loss is weighted by its share of the batch and torch's own gradient scaling is
  off (``scale_grads=False``), so the microbatch losses sum to the whole batch's mean loss and the gradients are
  those of one process on the whole batch;
* per step, measured on this rank: the bubble (the share of the step's wall time its stages did not compute)
  and the bytes its stages sent to their neighbours (counted from the tensors of the send operations).

Which schedules run on gloo (torch 2.13, pp=2, checked with ``tests/test_pipeline.py``): all seven. A schedule
that cannot run on a backend is listed in ``ScheduleSpec.refused`` and refused with a ``ConfigError`` naming
``parallel.pp_schedule`` instead of being allowed to hang.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import ops as comm_ops, timing
from ..errors import ConfigError, SyncwiseError
from ..layout import SCHEDULE_SPECS, ScheduleSpec, check_pipeline_shape, schedule_spec
from ..specs import count


# ------------------------------------------------------------------------------------------------ the schedules
# The schedules' table and their torch-free rules (stages per rank, microbatches, one stage per layer) are the
# layout owner's (syncwise.layout: ScheduleSpec, SCHEDULE_SPECS, check_pipeline_shape); what the installed torch
# ships and which backend a schedule cannot run on are checked here.


def torch_schedules() -> dict[str, type]:
    """syncwise name → torch schedule class, for the schedules the installed torch ships (imported on first use:
    torch.distributed.pipelining takes a second and a half to import)."""
    import torch.distributed.pipelining as pipelining

    return {name: getattr(pipelining, spec.torch_name) for name, spec in SCHEDULE_SPECS.items()
            if getattr(pipelining, spec.torch_name, None) is not None}


def __getattr__(name: str) -> Any:
    # ``SCHEDULES`` is computed on first access (PEP 562) so importing this module stays cheap.
    if name == "SCHEDULES":
        return torch_schedules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _schedule_spec(schedule: str, pp: int, backend: Optional[str]) -> ScheduleSpec:
    """The spec of ``schedule``, or a ConfigError: unknown, absent from this torch, or unable to run on
    ``backend``."""
    spec = schedule_spec(schedule)
    if pp > 1 and schedule not in torch_schedules():
        have = ", ".join(torch_schedules()) or "none"
        raise ConfigError("parallel.pp_schedule", schedule, f"a schedule this torch ({torch.__version__}) ships: "
                          f"{spec.torch_name} is not available in this torch version; available: {have}")
    for refused_backend, why in spec.refused:
        if pp > 1 and backend == refused_backend:
            raise ConfigError("parallel.pp_schedule", schedule, f"a schedule that runs on {backend}: {why}")
    return spec


def check_pipeline(n_layers: int, pp: int, schedule: str, microbatches: int, stages_per_rank: int = 1, *,
                   backend: Optional[str] = None) -> ScheduleSpec:
    """Validate a pipeline layout before any worker starts; return the schedule's spec.

    Raises ConfigError naming ``parallel.pp`` / ``parallel.pp_schedule`` / ``parallel.microbatches`` /
    ``parallel.stages_per_rank`` for: an unknown schedule or one the installed torch does not ship, or one that
    cannot run on ``backend`` ("gloo", "nccl"; None: not checked); then the layout owner's torch-free rules
    (``syncwise.layout.check_pipeline_shape``: stages per rank, one stage per layer, microbatches).
    """
    count("parallel.pp", pp)
    _schedule_spec(schedule, pp, backend)
    return check_pipeline_shape(n_layers, pp, schedule, microbatches, stages_per_rank)


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The global stage indices ``pp_rank`` holds, ascending: looped (rank r: r, r + pp, ...) or, for V schedules
    (zbv, dualpipev), r and 2·pp − 1 − r — torch's own placements."""
    spec = _schedule_spec(schedule, 1, None)
    if spec.v_shape:
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + pp * i for i in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, n_stages: int, schedule: str) -> int:
    """Which pp rank holds global stage ``stage``."""
    if SCHEDULE_SPECS[schedule].v_shape:
        return stage if stage < pp else n_stages - 1 - stage
    return stage % pp


# ------------------------------------------------------------------------------------------------ the split
def layer_flops(model_config: Any) -> tuple[list[int], int]:
    """(training FLOPs per token of each block, FLOPs per token of the final norm + head), from
    ``deepseek.flops_per_token`` itself: a block's FLOPs are the difference between the model with two blocks of
    its kind (dense or MoE) and with one, so the accounting is the model's own (PaLM's 6·N + attention; the
    embedding lookup does no matmul and counts 0). Blocks and head add up to ``flops_per_token(cfg)``."""
    from ..models.config import resolve_config
    from ..models.deepseek import flops_per_token

    cfg = resolve_config(model_config)

    def block(moe: bool) -> int:
        def model(n: int) -> float:
            return flops_per_token(dataclasses.replace(cfg, n_layers=n, n_dense_layers=0 if moe else n))
        return int(round(model(2) - model(1)))

    kinds = {moe: block(moe) for moe in {cfg.layer_is_moe(i) for i in range(cfg.n_layers)}}
    per_layer = [kinds[cfg.layer_is_moe(i)] for i in range(cfg.n_layers)]
    return per_layer, int(round(flops_per_token(cfg))) - sum(per_layer)


def _partition(costs: Sequence[int], n: int, first_extra: int = 0, last_extra: int = 0) -> list[list[int]]:
    """Contiguous split of ``costs`` into ``n`` non-empty ranges: the smallest possible largest stage, then (among
    those) the smallest sum of squared stage costs; ties go to the earliest cut. ``first_extra`` / ``last_extra``
    are added to the first / last stage. Exact integer dynamic programming, O(n · L²)."""
    L = len(costs)
    if not 1 <= n <= L:
        raise ConfigError("parallel.pp", n, f"at most one stage per layer ({L} layers)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if a == 0 else 0) + (last_extra if b == L else 0)

    def solve(combine: Callable[[int, int], int], limit: Optional[int]) -> tuple[list[list[int]], list[list[int]]]:
        # best[j][b]: value of splitting costs[:b] into j stages; cut[j][b]: where stage j starts.
        inf = float("inf")
        best = [[inf] * (L + 1) for _ in range(n + 1)]
        cut = [[0] * (L + 1) for _ in range(n + 1)]
        best[0][0] = 0
        for j in range(1, n + 1):
            for b in range(j, L - (n - j) + 1):
                for a in range(j - 1, b):
                    c = cost(a, b)
                    if best[j - 1][a] == inf or (limit is not None and c > limit):
                        continue
                    v = combine(best[j - 1][a], c)
                    if v < best[j][b]:
                        best[j][b], cut[j][b] = v, a
        return best, cut

    best, _ = solve(max, None)
    limit = int(best[n][L])
    best, cut = solve(lambda acc, c: acc + c * c, limit)
    ranges, b = [], L
    for j in range(n, 0, -1):
        a = cut[j][b]
        ranges.append(list(range(a, b)))
        b = a
    return ranges[::-1]


def split_layers(model_config: Any, n_stages: int) -> list[list[int]]:
    """Contiguous layer indices per stage, balanced by the model's FLOPs per layer (``layer_flops``: dense and MoE
    blocks differ); the embedding (0 FLOPs: a lookup) counts towards the first stage, the final norm + head
    towards the last (the loss, elementwise, is not in the model's count). Deterministic; every stage gets ≥ 1
    layer."""
    per_layer, head = layer_flops(model_config)
    return _partition(per_layer, n_stages, 0, head)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s submodules and parameters (no tensor is copied), whose own
    registries (``_modules``, ``_parameters``, hooks, ...) can be changed without touching ``module``."""
    out = copy.copy(module)
    for key, value in list(out.__dict__.items()):
        if isinstance(value, (dict, set)):
            out.__dict__[key] = copy.copy(value)
    return out


def _split_deepseek(model: nn.Module, n_stages: int, stage_ids: Sequence[int]) -> list[nn.Module]:
    cfg = model.config
    if n_stages > 1 and cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings", True, "false under pipeline parallel: the tied matrix would live "
                          "on the first and the last stage at once")
    ranges = split_layers(cfg, n_stages)
    stages = []
    for s in stage_ids:
        stage = _shallow_copy(model)
        # torchtitan's convention: keep the ModuleDict keys ("0".."L-1"), so parameter names stay the full model's.
        stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in ranges[s]})
        if s != 0:
            stage.tok_embeddings = None
        if s != n_stages - 1:
            stage.norm = None
            stage.output = None
        stages.append(stage)
    return stages


def _split_sequential(model: nn.Sequential, n_stages: int, stage_ids: Sequence[int]) -> list[nn.Module]:
    names = list(model._modules)
    costs = [max(1, sum(p.numel() for p in child.parameters())) for child in model]
    ranges = _partition(costs, n_stages)
    # The children keep their names ("3", not "0"): parameter names stay the full model's.
    return [nn.Sequential(OrderedDict((names[i], model[i]) for i in ranges[s])) for s in stage_ids]


def merge_stage_modules(modules: Sequence[nn.Module]) -> nn.Module:
    """One module holding every parameter and buffer of ``modules`` (stages of one model, e.g. the two stages of a
    rank in an interleaved or V schedule) under the full model's names: for state dicts, checkpoints
    (``torch.distributed.checkpoint``), optimizers and gradient norms — not to run (its forward would chain
    nothing). Nothing is copied; one stage is returned as it is."""
    if len(modules) == 1:
        return modules[0]

    def merge(a: nn.Module, b: nn.Module) -> nn.Module:
        out = _shallow_copy(a)
        for name, child in b._modules.items():
            mine = out._modules.get(name)
            if child is None or mine is child:
                continue
            out._modules[name] = child if mine is None else merge(mine, child)
        for registry in ("_parameters", "_buffers"):
            for name, t in getattr(b, registry).items():
                if t is not None and getattr(out, registry).get(name) is None:
                    getattr(out, registry)[name] = t
        return out

    merged = modules[0]
    for m in modules[1:]:
        merged = merge(merged, m)
    return merged


def build_stage_modules(model: nn.Module, n_stages: int, stage_ids: Sequence[int],
                        split_fn: Optional[Callable[[nn.Module, int, int], nn.Module]] = None) -> list[nn.Module]:
    """The stage modules of ``stage_ids`` (global stage indices, ascending) for an ``n_stages``-stage pipeline.

    * DeepSeekLM: layers split by ``split_layers``; each stage is the model itself pruned (a shallow copy that
      shares its parameters: nothing is copied) — other layers deleted from the ``layers`` ModuleDict, the
      embedding set to None except on stage 0, the norm and head set to None except on the last stage. Parameter
      names are the full model's, so the union of all stages' ``state_dict()`` is the full model's and
      ``torch.distributed.checkpoint`` reshards between pp and non-pp runs. The full ``model`` is left intact;
      drop it (keep only the stages) so the other stages' layers are freed, and never checkpoint it under pp
      (its other layers do not train on this rank).
    * ``nn.Sequential``: contiguous children, balanced by parameter count, with their original names.
    * any other model: ``split_fn(model, stage_index, n_stages) -> nn.Module`` is the split plan. Its stage
      ``s`` must take what stage ``s − 1`` returns (a tensor or tuple of tensors; stage 0 takes the batch's
      inputs) and the last stage must return what the loss function takes as its first argument. Keep the
      parameter names of the full model (delete or set to None what a stage does not own, as above) if its
      checkpoints must load without pipeline parallel.
    """
    n_stages = count("parallel.pp", n_stages)
    if any(not 0 <= s < n_stages for s in stage_ids):
        raise ConfigError("parallel.stages_per_rank", list(stage_ids), f"stage indices in 0..{n_stages - 1}")
    if split_fn is not None:
        return [split_fn(model, s, n_stages) for s in stage_ids]
    from ..models.deepseek import DeepSeekLM

    if isinstance(model, DeepSeekLM):
        return _split_deepseek(model, n_stages, stage_ids)
    if isinstance(model, nn.Sequential):
        return _split_sequential(model, n_stages, stage_ids)
    raise ConfigError("parallel.pp", n_stages, f"a model syncwise can split (DeepSeekLM, nn.Sequential), or a "
                      f"split plan split_fn(model, stage_index, n_stages) -> nn.Module for {type(model).__name__}")


# ------------------------------------------------------------------------------------------------ measuring
class _StepMeter:
    """What this rank's stages did in one step: compute seconds, bytes sent, sends still in flight. ``stats``: where
    the batched sends are counted as well (the pipeline's ``p2p_stats``: the step's ``pp`` bytes are ``bytes``)."""

    def __init__(self, overlap: bool, stats: Any = None) -> None:
        self.overlap = overlap
        self.stats = stats
        self.compute_s = 0.0
        self.bytes = 0
        self.pending: list[Any] = []
        self.unsent: list[Any] = []
        self.intervals: list[timing.Interval] = []  # the stage computes of this step

    def reset(self) -> None:
        self.compute_s, self.bytes, self.intervals = 0.0, 0, []

    def settle(self) -> float:
        """The step's compute seconds (on CUDA: waits for the last compute's end event)."""
        self.compute_s += sum(iv.seconds() for iv in self.intervals)
        self.intervals = []
        return self.compute_s

    # Without overlap, sends and receives go out through ``batch_isend_irecv`` (issue 24): NCCL runs the p2p
    # operations of one rank in launch order on one stream, so two stages that each issue an unbatched send to
    # the other and then the matching receive can both block in the send; one batch is one NCCL group launch,
    # which pairs them. A send waits (in ``unsent``) for the next receive of the stage, or for the drain before
    # its next compute, and goes out in one batch with it.
    def sends(self, ops: list) -> list:
        """Count the send ops' bytes; without overlap, keep them to go out batched with the next receives (or at
        the drain before the next compute), so the next compute waits for them (the schedule then has nothing
        left to send)."""
        self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if self.overlap or not ops:
            return ops
        self.unsent += ops
        return []

    def receives(self, ops: list) -> list:
        """Without overlap, receive here, where the schedule posts the receive — in one batch with the sends not
        issued yet — and wait for it (the schedule then has nothing left to wait for); with overlap, the
        schedule's asynchronous receives as they are."""
        if self.overlap or not ops:
            return ops
        batch, self.unsent = self.unsent + ops, []
        for work in comm_ops.batch_isend_irecv(batch, stats=self.stats):
            work.wait()
        return []

    def drain(self) -> None:
        """Issue the sends still kept and wait for every send issued without overlap (before a compute, and at
        the end of the step)."""
        if self.unsent:
            batch, self.unsent = self.unsent, []
            self.pending += comm_ops.batch_isend_irecv(batch, stats=self.stats)
        while self.pending:
            self.pending.pop(0).wait()


@functools.lru_cache(maxsize=None)
def _stage_class() -> type:
    """A ``PipelineStage`` that times its compute, counts its sends and (without overlap) completes them before
    computing again. Built on first use: importing torch.distributed.pipelining is slow."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    class MeasuredStage(PipelineStage):
        meter: _StepMeter

        def _timed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
            self.meter.drain()           # without overlap: this stage's sends finish before it computes again
            interval = timing.Interval(self.device).start()  # comm.timing: CUDA events on a GPU
            try:
                return fn(*args, **kwargs)
            finally:
                self.meter.intervals.append(interval.stop())

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
            return self.meter.sends(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
            return self.meter.sends(super().get_bwd_send_ops(bwd_chunk_id))

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
            return self.meter.receives(super().get_fwd_recv_ops(fwd_chunk_id))

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
            return self.meter.receives(super().get_bwd_recv_ops(bwd_chunk_id))

        # torch 2.13's schedule.eval() keeps a V schedule's (zbv, dualpipev) backward actions and skips their
        # compute, but still hands the skipped input gradient from a stage to its neighbour on the same rank,
        # which asserts ("can't steal_bwd_input if this stage doesn't have backward"): a forward-only pass has
        # no gradient to hand over.
        def get_local_bwd_output(self, mb_index: int) -> Any:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        # torch infers the stages' shapes by running one forward (and backward) of the first microbatch per stage
        # before the first step (private hooks of torch 2.13's PipelineStage). Run it in eval mode, so stateful
        # modules do not count it (MoE load counters, BatchNorm statistics), on zeros rather than uninitialised
        # memory where a stage only has the shape of its input.
        def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
            modes = [(m, m.training) for m in module.modules()]
            module.eval()
            try:
                return module(*args, **kwargs)
            finally:
                for m, mode in modes:
                    m.training = mode

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and t.is_floating_point() and not isinstance(t, DTensor):
                with torch.no_grad():
                    t.zero_()
            return t

    return MeasuredStage


class PipelineLoss:
    """The last stage's loss: ``loss_fn(output, target)`` (a mean over the microbatch) × the microbatch's share of
    the batch's rows × ``weight``. With torch's gradient scaling off (``scale_grads=False``) the microbatch losses
    then sum to the batch's mean loss and their gradients to its gradient, exactly as one process computing
    ``loss_fn`` over the whole batch (for a per-row mean loss; ``lm_loss`` with equal-length rows is one)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], meter: _StepMeter) -> None:
        self.loss_fn, self.meter = loss_fn, meter
        self.rows, self.weight = 1, 1.0

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        interval = timing.Interval(target.device).start()  # comm.timing: CUDA events on a GPU
        try:
            return self.loss_fn(output, target) * (target.shape[0] / self.rows * self.weight)
        finally:
            self.meter.intervals.append(interval.stop())


def _default_loss() -> Callable[[Any, Any], torch.Tensor]:
    from ..models import lm_loss  # the trainer's own loss

    return lm_loss


# ------------------------------------------------------------------------------------------------ AsyncPipeline
class AsyncPipeline:
    """One rank's part of a pipeline: its stage modules, run by a ``torch.distributed.pipelining`` schedule.

    ``AsyncPipeline(stages, microbatch_size, overlap_communication=True, schedule="1f1b")``:

    * ``stages``: this rank's stage modules (from ``build_stage_modules``), ascending by stage index; or an int,
      the total number of stages, and the modules come later from ``partition_model(model)``.
    * ``microbatch_size``: rows per microbatch (the batch must divide into them), or ``microbatches=M`` (the
      batch must divide by M). One ``step`` = M microbatches = one optimizer step's gradients.
    * ``overlap_communication`` (True): torch's schedules as they are — sends are asynchronous and stay in flight
      while the stage computes the next microbatch (1F1B waits for them where it pairs a send with the next
      receive), and the multi-stage schedules post each receive as early as the schedule allows, so it arrives
      while the rank computes. False: no point-to-point operation of this rank is in flight while its stages
      compute — each send completes before the next compute starts, each receive is waited for where the schedule
      posts it. (torch's ``defer_pp_recv`` was tried for the receives: combined with completed sends it
      deadlocks interleaved-1f1b on gloo.) The difference shows in ``last_bubble``.
    * ``loss_fn(output, target)``: a mean over the microbatch (default: the trainer's ``lm_loss``).
    * ``group``: the pipeline's process group (default: the world); its size is pp, and this rank's stages are
      ``stage_ids_for_rank(rank in group, ...)`` unless ``stage_ids`` is given.
    * ``broadcast_loss`` (True): after each step the last stage's loss is broadcast over the pipeline group (one
      4-byte collective), so every pp rank returns and logs the same loss; False: ranks without the last stage
      return None.

    After each ``step``: ``last_bubble`` — 1 − (this rank's stage compute time / the step's wall time), where
    compute is the stages' forward, backward (input and weight) and loss calls, timed around torch's
    ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``; the rest is waiting on
    neighbours and the schedule's own work (the first step after a (re)build also includes torch's P2P warm-up
    and shape inference). ``last_p2p_bytes`` — bytes this rank's stages sent to other ranks: the activations
    (forward) and input gradients (backward) of every send op, counted from the tensors themselves (stages of a
    V on one rank hand tensors over without sending; the shape-inference messages and the loss broadcast, a few
    bytes, are not counted). ``stats``: where the batched sends are counted too (``p2p_stats``; a run's
    ``ledger.pp``).
    """

    def __init__(self, stages: "Sequence[nn.Module] | int", microbatch_size: Optional[int] = None,
                 overlap_communication: bool = True, *, schedule: str = "1f1b",
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, group: Any = None,
                 microbatches: Optional[int] = None, stage_ids: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None, broadcast_loss: bool = True,
                 stats: Optional[comm_ops.CommStats] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise SyncwiseError("AsyncPipeline needs an initialised process group (torch.distributed), one rank "
                                "per pipeline stage group member")
        if (microbatch_size is None) == (microbatches is None):
            raise ConfigError("parallel.microbatches", microbatches, "exactly one of microbatch_size (rows per "
                              "microbatch) and microbatches (microbatches per step)")
        if microbatch_size is not None:
            count("parallel.microbatch_size", microbatch_size)
        if microbatches is not None:
            count("parallel.microbatches", microbatches)
        self.group = group
        self.pp = dist.get_world_size(group)
        self.pp_rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self.schedule_name = schedule
        self.spec = _schedule_spec(schedule, self.pp, self.backend)
        self.microbatch_size, self.microbatches = microbatch_size, microbatches
        self.overlap_communication = bool(overlap_communication)
        self.broadcast_loss = broadcast_loss
        self.device = device
        # the sends batched without overlap (a run's ledger.pp; default: the pipeline's own)
        self.p2p_stats = stats if stats is not None else comm_ops.CommStats()
        self._meter = _StepMeter(self.overlap_communication, self.p2p_stats)
        self._loss = PipelineLoss(loss_fn or _default_loss(), self._meter)
        self._schedule: Any = None
        self._key: Any = None
        self.n_microbatches: Optional[int] = microbatches   # of the last step
        self.last_bubble: Optional[float] = None
        self.last_p2p_bytes: Optional[int] = None
        self.last_step_s: Optional[float] = None
        self.last_compute_s: Optional[float] = None
        self.stage_modules: list[nn.Module] = []
        self._module: Optional[nn.Module] = None
        if isinstance(stages, int) and not isinstance(stages, bool):
            self.n_stages = count("parallel.pp", stages)
            if self.n_stages % self.pp:
                raise ConfigError("parallel.stages_per_rank", self.n_stages, f"a number of stages divisible by pp "
                                  f"({self.pp})")
            self._set_ids(stage_ids, self.n_stages // self.pp)
        else:
            self._set_stages(list(stages), stage_ids)

    # ---- the stages -----------------------------------------------------------------------------------------
    def _set_ids(self, stage_ids: Optional[Sequence[int]], per_rank: int) -> None:
        # The microbatch rule waits for the first batch when only microbatch_size is known.
        if self.pp > 1:
            self.spec.check_stages_per_rank(per_rank)
        if self.microbatches is not None and self.spec.microbatch_error(self.pp, self.microbatches):
            raise ConfigError("parallel.microbatches", self.microbatches,
                              self.spec.microbatch_error(self.pp, self.microbatches) or "")
        self.n_stages = self.pp * per_rank
        self.stage_ids = list(stage_ids) if stage_ids is not None else \
            stage_ids_for_rank(self.pp_rank, self.pp, per_rank, self.schedule_name)
        if len(self.stage_ids) != per_rank:
            raise ConfigError("parallel.stages_per_rank", per_rank, f"one stage index per stage module; got "
                              f"{self.stage_ids}")
        self.last_rank = stage_rank(self.n_stages - 1, self.pp, self.n_stages, self.schedule_name)

    def _set_stages(self, modules: list[nn.Module], stage_ids: Optional[Sequence[int]]) -> None:
        if not modules:
            raise ConfigError("parallel.stages_per_rank", 0, "at least one stage module per rank")
        self._set_ids(stage_ids, len(modules))
        self.stage_modules = modules
        self._schedule = self._key = self._module = None

    def partition_model(self, model: nn.Module,
                        split_fn: Optional[Callable[[nn.Module, int, int], nn.Module]] = None) -> list[nn.Module]:
        """Cut ``model`` into this rank's stage modules (``build_stage_modules``) and run them from now on."""
        self._set_stages(build_stage_modules(model, self.n_stages, self.stage_ids, split_fn), self.stage_ids)
        return self.stage_modules

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    @property
    def module(self) -> nn.Module:
        """This rank's stages as one module with the full model's parameter names (``merge_stage_modules``): what
        to checkpoint, build the optimizer over, clip and update router biases on — not to run."""
        if not self.stage_modules:
            raise SyncwiseError("AsyncPipeline has no stage modules yet: pass them, or call partition_model(model)")
        if self._module is None:
            self._module = merge_stage_modules(self.stage_modules)
        return self._module

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (every stage's, each once): what its optimizer steps."""
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) for this rank's stages."""
        return list(self.module.named_parameters())

    # ---- the schedule ---------------------------------------------------------------------------------------
    def _n_microbatches(self, rows: int) -> int:
        if self.microbatches is not None:
            if rows % self.microbatches:
                raise ConfigError("parallel.microbatches", self.microbatches, f"a divisor of the batch's {rows} "
                                  "rows (every microbatch must have the same shape)")
            n = self.microbatches
        else:
            if rows % self.microbatch_size:
                raise ConfigError("parallel.microbatch_size", self.microbatch_size, f"a divisor of the batch's "
                                  f"{rows} rows (every microbatch must have the same shape)")
            n = rows // self.microbatch_size
        why = self.spec.microbatch_error(self.pp, n)
        if why:
            raise ConfigError("parallel.microbatches", n, why)
        return n

    def _build(self, n_microbatches: int) -> None:
        """New PipelineStages and schedule for this microbatch count and shape (torch sizes its receive buffers
        from the first microbatch)."""
        stage_cls = _stage_class()
        device = self.device or next((p.device for m in self.stage_modules for p in m.parameters()),
                                     torch.device("cpu"))
        self._device = device   # the loss broadcast's (NCCL needs it on the GPU)
        stages = []
        for module, index in zip(self.stage_modules, self.stage_ids):
            stage = stage_cls(module, index, self.n_stages, device, group=self.group)
            stage.meter = self._meter
            stages.append(stage)
        cls = torch_schedules()[self.schedule_name]
        kwargs: dict[str, Any] = {"loss_fn": self._loss, "scale_grads": False}
        if self.spec.multi_stage:
            self._schedule = cls(stages, n_microbatches, **kwargs)
        else:
            self._schedule = cls(stages[0], n_microbatches, **kwargs)
        self._stages = stages

    def _prepare(self, inputs: torch.Tensor) -> None:
        if not self.stage_modules:
            raise SyncwiseError("AsyncPipeline has no stage modules yet: pass them, or call partition_model(model)")
        n = self.n_microbatches = self._n_microbatches(inputs.shape[0])
        key = (n, tuple(inputs.shape), inputs.dtype)
        if key != self._key:
            self._build(n)
            self._key = key

    def _run(self, inputs: torch.Tensor, targets: Optional[torch.Tensor], train: bool, weight: float
             ) -> Optional[torch.Tensor]:
        self._prepare(inputs)
        if self.has_last and targets is None:
            raise SyncwiseError("the rank holding the last pipeline stage needs the targets")
        self._loss.rows, self._loss.weight = inputs.shape[0], weight
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        losses: list[torch.Tensor] = []
        self._meter.reset()
        # comm.timing: CUDA events on a GPU (host clocks would count launches: pp_bubble near 1 - launch/wall);
        # read at the end of the step, which waits for its last kernel on CUDA (one sync per pipeline step)
        step_interval = timing.Interval(self._device).start()
        if train:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            self._schedule.eval(*args, target=target, losses=losses)
        self._meter.drain()
        self.last_step_s = step_interval.stop().seconds()
        self.last_compute_s = self._meter.settle()
        self.last_bubble = max(0.0, 1.0 - self.last_compute_s / self.last_step_s) if self.last_step_s > 0 else 0.0
        self.last_p2p_bytes = self._meter.bytes
        loss = torch.stack([l.detach().float() for l in losses]).sum() if self.has_last and losses else None
        if not self.broadcast_loss:
            return loss
        buf = loss.reshape(1).clone() if loss is not None else torch.full((1,), math.nan, device=self._device)
        comm_ops.broadcast_from(buf, self.last_rank, group=self.group, stats=None)  # control: not counted
        return buf[0]

    def step(self, inputs: Any, targets: Optional[torch.Tensor] = None, *, weight: float = 1.0
             ) -> Optional[torch.Tensor]:
        """Forward and backward of one batch (``inputs``, ``targets``: the same on every rank of the pipeline
        group; only the first stage reads the inputs, only the last the targets, but every rank needs the inputs'
        shape) split into the microbatches; gradients accumulate into this rank's stage parameters as one process
        computing ``loss_fn`` over the whole batch would (times ``weight``). ``step((inputs, targets))`` works too.

        Returns the batch's mean loss × ``weight`` (a detached 0-dim tensor) on every rank with
        ``broadcast_loss``, else on the last stage's rank only (None elsewhere). The optimizer step is the
        caller's, over this rank's parameters (``module.parameters()``); so is ``zero_grad``."""
        if targets is None and isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            inputs, targets = inputs
        return self._run(inputs, targets, True, weight)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward only (torch's ``schedule.eval``): the batch's mean loss, as ``step`` returns it. Switching
        between training and evaluation re-runs torch's stage set-up on the next call of the other kind."""
        return self._run(inputs, targets, False, 1.0)
