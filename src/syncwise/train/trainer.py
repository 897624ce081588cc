"""OptimizedTrainer: the training loop for any ``nn.Module``, readable in one sitting.

What one optimizer step does (``_train_step``):
  1. ``grad_accum`` loader batches forward/backward (with a ``DynamicBatcher``, in micro-batches of the size
     that fits, the step redone from the same batches after an out-of-memory); all but the last micro-batch
     under DDP's ``no_sync`` so only the last one communicates (its gradient sync overlaps its backward);
  2. gradients are unscaled (fp16), clipped, checked for NaN/Inf (a bad step is skipped on every rank; under
     local SGD by the replica that saw it, and recorded by every replica at the next average; with fused AdamW
     inside the optimizer, without a host read);
  3. optimizer, LR schedule and model-specific updates (MoE router bias) step;
  4. with ``sync=`` other than every-step, the sync strategy moves the parameters instead: local SGD / DiLoCo
     keep gradients local and average the replicas every H steps; Pipe-SGD applies the previous step's
     averaged gradient while this step's all-reduce runs;
  5. the step meter (``train/meter.py``) returns a ``PendingStep``; the loop reads its numbers (loss, norm, data
     wait / compute / exposed communication, bytes per dimension) ``log_lag`` steps later — on a GPU one step,
     so the host never waits for the device inside the loop.

Faults, the MoE router-bias update, sync strategies and dynamic batching hook in through small named methods and
the ``after_update`` callbacks, not inline. Around the step, ``train()``'s loop calls a list of step callbacks
(train/callbacks.py): live recovery's quorum and commit, the arrivals log, the profiler, validation, preemption, the
checkpoint cadence, the watchdog and a user's, each in the list only when it is on (docs/trainer.md).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import ModelOptimizerState, RNGState, SmartCheckpointer, TrainState
from ..comm import flight, hostread, ops
from ..comm.hostread import HostCopy
from ..comm.arrivals import ArrivalLog
from ..comm.watchdog import Watchdog
from ..data.sharding import position_is_global, shard_loader
from ..errors import ConfigError, SyncwiseError
from ..models import lm_loss
from ..specs import count
from ..metrics import MetricsLogger, detect_peak, mfu, peak_memory_mb, read_jsonl
from ..metrics.ranklog import RankLog, plain
from ..metrics import figures
from ..parallel import TorchHookSpec, describe_layout, parallelize, rebind_optimizer
from . import arguments, batches as batch_shapes, options
from .callbacks import (Arrivals, BatchChanges, CheckpointCadence, HangWatchdog, InjectedKills, Preemption,
                        Profiling, StepCallback, Validation)
from .dynamic_batch import _rows, _slice
from .faults import FaultPlan
from .claim import claim
from .meter import PendingStep, StepMeter, StepResult, hop_fields, job_nodes, per_hop, row_cross, row_hops
from .options import CommOptions, FaultOptions, RunOptions, StepOptions
from .preemption import PreemptionGuard
from .profile import StepProfiler
from ..rundir import RunDir
from ..profiling import parse_steps

__all__ = ["OptimizedTrainer", "CommOptions", "StepOptions", "RunOptions", "FaultOptions", "PendingStep",
           "StepResult", "lm_loss", "warmup_steps", "warmup_figures"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _resolve_compressor(spec: Any):
    """None/False/'none' → plain all-reduce; a spec string, a Compressor or a GradientCompressor otherwise.

    ``torch-fp16`` / ``torch-powersgd:rank=4`` ... select PyTorch's own hooks (for side-by-side benchmarks).
    """
    from ..compress import parse_compress_spec

    if spec is None or spec is False:
        return parse_compress_spec("none")
    if spec is True:
        return parse_compress_spec("powersgd:rank=4")
    if isinstance(spec, str):
        return TorchHookSpec.parse(spec) or parse_compress_spec(spec)
    return getattr(spec, "compressor", spec)


class OptimizedTrainer:
    """Train any ``nn.Module`` data-parallel, with compressed gradient sync, AMP, accumulation and metrics.

    Seed API: ``OptimizedTrainer(model, optimizer, loss_fn, compress_gradients=..., mixed_precision=...)``
    then ``.train(loader, epochs=... or steps=..., checkpoint_dir=..., resume=...)``. ``loader`` yields
    ``(inputs, targets)`` (``loss_fn(model(inputs), targets)`` gives the loss; ``loss_fn`` defaults to ``lm_loss``)
    or a mapping of the model's keyword arguments such as ``{"input_ids", "labels"}`` (``model(**batch)``; the loss
    is ``loss_fn(outputs, batch)``, or with ``loss_fn=None`` the one the model returns: a ``ModelOutput``'s
    ``.loss``, a dict's ``"loss"`` or a scalar tensor). Another shape is refused before the run starts
    (``syncwise.train.batches``).

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) without a process group, the trainer joins the job
    itself (NCCL on CUDA, else gloo) and destroys the group at exit. A map-style ``DataLoader`` with the
    default sampler is sharded by rank (``DistributedSampler``, shuffled per epoch from ``data_seed``),
    one with a ``DistributedSampler`` is kept, an iterable dataset must shard itself (see
    ``syncwise.data.shard_loader``); the loader's position is checkpointed and resumes exactly.

    ``parallel={"dp_shard": 2, "tp": 2}`` (a ``syncwise.parallel.ParallelSpec`` or its fields: also ``pp``,
    ``pp_schedule``, ``microbatches``, ``ep``, ``ep_dispatch``) lays the ranks out as FSDP2 / HSDP / tensor /
    pipeline / expert parallel through ``syncwise.parallel.parallelize`` (default: every rank a DDP replica);
    loaders are then sharded by data-parallel rank. ``tp_plan=`` gives a user model's tensor-parallel plan,
    ``pipeline_split=`` its pipeline split (``split_fn(model, stage_index, n_stages) -> stage module``; syncwise's
    model and ``nn.Sequential`` need none) (docs/parallelism.md). ``dynamic_batch=DynamicBatcher(...)`` runs micro-batches that
    fit in memory at an unchanged global batch (docs/dynamic-batch.md).

    Options come in four typed groups (``syncwise.train``; docs/trainer.md): ``comm=CommOptions(...)`` (layout,
    compression, sync, buckets), ``step=StepOptions(...)`` (precision, accumulation, clipping, dynamic batch,
    compile), ``run=RunOptions(...)`` (device, run directory, validation, progress, checkpointer) and
    ``faults=FaultOptions(...)`` (collective timeout, preemption grace, injected faults). Every field is also a
    keyword of its own here, with the same name and default; ``.options`` holds the four groups the trainer uses.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *, comm: Optional[CommOptions] = None,
                 step: Optional[StepOptions] = None, run: Optional[RunOptions] = None,
                 faults: Optional[FaultOptions] = None, **keywords: Any):
        # the groups' fields, flat (the seed's keywords): their names, defaults and types are the groups'
        # (syncwise.train.options); the signature below lists them
        self.options = options.gather(keywords, comm=comm, step=step, run=run, faults=faults)
        c, s, r, f = self.options.comm, self.options.step, self.options.run, self.options.faults
        self.grad_accum_steps, self.clip_grad_norm, self.lr_scheduler = s.grad_accum_steps, s.clip_grad_norm, \
            s.lr_scheduler
        self.val_loader, self.val_interval, self.log_interval = r.val_loader, r.val_interval, r.log_interval
        self.run_dir, self.show_progress, self.flops_per_token = r.run_dir, r.show_progress, r.flops_per_token
        self.data_seed, self.checkpointer = r.data_seed, r.checkpointer  # data_seed: a sharded loader's shuffle
        self.collective_timeout_s = f.collective_timeout_s
        self.device = r.device or next(model.parameters()).device
        # Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) and no process group yet: join the job, so the
        # ranks train one model together instead of WORLD_SIZE independent copies.
        self.owns_process_group = arguments.join_torchrun(self.device, f.collective_timeout_s)
        self.rank, self.world_size = _world()
        if f.collective_timeout_s:
            ops.set_collective_timeout(f.collective_timeout_s)  # also for the groups the hook creates below
        self.model = model.to(self.device)  # the plain module: evaluation, checkpoints, router updates
        if self.device.type == "cuda" and s.tf32:
            # fp32 matmuls (the parts autocast leaves in fp32, and mixed_precision='none') on tensor cores. The
            # compressors' matmuls stay full fp32 whatever this says (compress.base.full_fp32: replicas agree).
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._set_precision(s.mixed_precision)
        self._lay_out(c, s, optimizer, loss_fn)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self._attach_live_recovery(f.live_recovery)
        self.peak = detect_peak(self.device)  # the part's dense bf16 peak, for MFU (None on a CPU)
        self.faults = FaultPlan(f.inject_faults or [], self.run_dir)
        # SIGTERM / SIGUSR1 during train(): stop after a step every rank agrees on, save, raise Preempted
        # (train/preemption.py); None or 0 leaves the signals alone.
        self.preemption = PreemptionGuard(f.preempt_grace_s or 0.0, self.rank, self.world_size,
                                          stats=self.par.ledger.signals)
        self.batcher = s.dynamic_batch  # micro-batches that fit; None: each loader batch is one micro-batch
        self.step = 0
        self.total_steps = 0
        self.tokens_seen = 0
        self.skipped_steps: list[int] = []
        self.metric_sinks: list[Any] = []  # each gets every metrics.jsonl row: syncwise.metrics.sinks (Prometheus, W&B)
        # a user's step callbacks (train/callbacks.py), called after the trainer's own at each point of the loop
        self.callbacks: list[StepCallback] = []
        self._backward_gates: list[StepCallback] = []  # the run's callbacks that act before a backward (train())
        # Timers, bytes per dimension, per-step extras and the watchdog's phase of every step (train/meter.py)
        # Replicas that diverge (local SGD) skip every per-step collective (the logged loss's mean, the router
        # loads): each would hold the ranks in lockstep, and the step would wait for the slowest one.
        self._lockstep = self.world_size > 1 and not (self.sync is not None and self.sync.replicas_diverge)
        self.meter = StepMeter(self.model, self.par, lockstep=self._lockstep, batcher=self.batcher)
        # The step's callbacks after its update(s), with `skipped` (a bool, or a 0-d tensor skipped on the device)
        self.after_update: list[Callable[[Any], None]] = []
        if hasattr(self.model, "update_router_bias"):
            self.after_update.append(self._update_router_bias)
        # Skip a non-finite step inside the optimizer (no host read of the gradient norm) where it can: fused
        # AdamW takes GradScaler's found_inf flag. fp16 keeps GradScaler's own path; strategies whose replicas
        # diverge (local SGD, DiLoCo) decide per replica on the host (a dropped step rides on the next average).
        self._skips_on_device = (getattr(optimizer, "_step_supports_amp_scaling", False)
                                 and all(g.get("fused") for g in optimizer.param_groups)
                                 and not self.scaler.is_enabled()
                                 and (self.sync is None or not self.sync.replicas_diverge))
        self._unsettled: Optional[tuple[int, HostCopy]] = None  # (step, non-finite flag) not read yet
        self._lr_used = optimizer.param_groups[0]["lr"]
        # Rows (loss, norm, timings) are read this many steps late: on a GPU the host then never waits for
        # the device inside the loop; on a CPU there is nothing to gain.
        self.log_lag = 1 if self.device.type == "cuda" else 0

    def _set_precision(self, given: Any) -> None:
        """The autocast dtype (None: fp32) and the GradScaler (fp16 needs loss scaling; bf16 and fp32 do not).
        Errors echo what the caller wrote ('half'), not its normal form."""
        try:
            self.amp_dtype = self._amp_dtype(arguments.mixed_precision_mode(given))
        except ConfigError as e:
            raise ConfigError(e.field, given, e.accepted) from None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)

    def _lay_out(self, c: CommOptions, s: StepOptions, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        """The compressor and everything parallel, behind one seam (syncwise.parallel.parallelize, in its order)."""
        from ..layout import names_auto

        for name, value in (("compress_gradients", c.compress_gradients), ("sync", c.sync)):
            if names_auto(value):   # the choice needs the cluster and the convergence table: the planner's, above
                raise ConfigError(name, value, "a spec: auto is resolved before workers start by syncwise train / "
                                  "syncwise.config.build_config, or syncwise.plan.strategy.resolve_auto(layout, "
                                  "cloud, model, global_batch) for this API (a trainer has no cluster to price "
                                  "strategies on)")
        try:
            self.compressor = _resolve_compressor(c.compress_gradients)
        except ConfigError as e:  # the spec parser names its own field; here the argument is compress_gradients
            raise ConfigError("compress_gradients", c.compress_gradients, e.accepted) from None
        self.compress_spec = c.compress_gradients if isinstance(c.compress_gradients, str) else (
            getattr(self.compressor, "spec", None) or getattr(self.compressor, "name", "none"))
        self._check_step(c, s)  # before any process group is made (every rank refuses alike)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.par = parallelize(self.model, c.parallel, self.device, compressor=self.compressor,
                               bucket_cap_mb=c.bucket_cap_mb, min_numel=c.min_numel, sync=c.sync,
                               activation_checkpointing=s.activation_checkpointing, compile=s.compile,
                               tp_plan=c.tp_plan, loss_fn=loss_fn, split_fn=c.pipeline_split,
                               # bf16 autocast: FSDP2 gathers bf16 parameters, reduces fp32 (issue 24)
                               param_dtype=torch.bfloat16 if self.amp_dtype == torch.bfloat16 else None)
        self.model = self.par.model  # under pipeline parallel: this rank's stages only
        # FSDP2 / TP put sharded parameters in the model's place; a pipeline stage keeps some of them.
        rebind_optimizer(optimizer, names, self.model, keep_only_present=not self.par.holds_all_layers)
        self.sync = self.par.sync  # the reduced-sync strategy the step drives (None: every-step sync)
        self.sync_spec = self.sync.spec.spec if self.sync is not None else "every-step"

    def _check_step(self, c: CommOptions, s: StepOptions) -> None:
        """The rules between the layout and the step's fields (layout.check_step, the same the command line asks),
        on the layout as given, before parallelize builds any group: a refusal then leaves no rank inside a group
        another rank never joins. A layout that does not parse here is parallelize's to refuse, in its words."""
        from ..layout import Layout, check_step

        try:
            given = c.parallel if isinstance(c.parallel, Layout) else Layout.of(**(c.parallel or {}))
            lay = given if c.sync is None else dataclasses.replace(given, sync=c.sync)
        except (ConfigError, TypeError):
            return
        check_step(lay, dynamic_batch=s.dynamic_batch, grad_accum=s.grad_accum_steps,
                   fp16=self.amp_dtype == torch.float16, names=options.API_STEP_FIELDS,  # the groups keep the
                   given={k: getattr(s if hasattr(s, kw) else c, kw)        # values as given ('half', not 'fp16')
                          for k, kw in options.API_STEP_FIELDS.items()})

    def _attach_live_recovery(self, live: Any) -> None:
        """Live recovery (train/live_recovery.py) drives the step as a sync strategy on the exchange seam: the
        cross-replica average and the commit decision, every step (DDP or FSDP2 inside a replica group: HSDP with
        torchft as the replicate dimension), or once per round around local SGD / DiLoCo (one process per group)."""
        from ..layout import check_live_compress, check_live_layout, check_live_sync

        self.live = live
        self._sync_callbacks: list[StepCallback] = []  # the loop's part of live recovery (its quorum and commit)
        if live is None:
            return
        spec = self.par.spec
        check_live_layout(spec.tp, spec.pp, spec.ep, "parallel")
        if spec.sync is not None:
            self.sync_spec = spec.sync.spec
        check_live_sync(spec.sync, self.sync_spec, self.world_size, spec.dp_shard)
        check_live_compress(self.compress_spec, self.world_size, "compress_gradients")
        live.stats = self.par.ledger.dp  # its cross-replica average is this run's gradient traffic
        self.sync = live.attach(self.model, spec.sync)
        if self.sync is not live:  # local SGD / DiLoCo: its state is checkpointed and healed as the 'sync' component
            self.par.sync = self.sync
        self._sync_callbacks = [live.step_callback()]

    # ----------------------------------------------------------------------------------------- public API
    def train(self, loader: Iterable, epochs: Optional[int] = None, steps: Optional[int] = None,
              checkpoint_dir: Optional[str] = None, resume: Optional[str] = None,
              cloud_config: Any = None) -> dict[str, Any]:
        """Run until ``steps`` optimizer steps (or ``epochs`` passes over ``loader``); return the summary.

        ``checkpoint_dir`` (or a ``checkpointer`` given to the constructor) enables checkpoints; ``resume``
        is 'auto' (newest valid checkpoint there, if any), a checkpoint path, or None. ``cloud_config`` (a
        ``syncwise.plan.CloudConfig``, e.g. ``load_cluster("cluster.toml")``) has the planner predict this layout
        and the best one for this model and batch, and warn when this one is predicted > 1.25× slower (summary
        ``layout_check``; docs/plan.md). ``trainer.callbacks`` takes step callbacks of your own
        (``syncwise.train.callbacks.StepCallback``), called after the trainer's at each point of the loop.
        """
        try:
            return self._train(loader, epochs, steps, checkpoint_dir, resume, cloud_config)
        except BaseException:
            # The run directory's lock ends with the run, however it ends: held on (with the environment variable that
            # says a launcher holds it), a rerun in this process (a notebook's next cell) would skip the claim and
            # overwrite the rows of the run that failed.
            if getattr(self, "_run_dir_lock", None) is not None:
                self._run_dir_lock.release()
            raise

    def _train(self, loader: Iterable, epochs: Optional[int], steps: Optional[int], checkpoint_dir: Optional[str],
               resume: Optional[str], cloud_config: Any) -> dict[str, Any]:
        resume = arguments.resume_mode(resume)
        checkpoint_dir = arguments.as_path("checkpoint_dir", checkpoint_dir)
        # A batch shape the trainer cannot use is refused before the run directory is claimed, where the first batch
        # can be seen without iterating the loader (a list, a map-style DataLoader); otherwise at the first step.
        first = batch_shapes.peek(loader)
        if first is not None:
            batch_shapes.as_pair(first, pipeline=not self.par.accepts_mappings)
        loader = shard_loader(loader, *self._data_shard(), seed=self.data_seed)
        total = self.total_steps = self._total_steps(loader, epochs, steps)
        state, redone = self._open(loader, checkpoint_dir, resume)
        if self.step >= total:
            return self._already_finished(total)
        logger, rank_log = self._start_logs(total, redone)
        # every loader batch as an (inputs, targets) pair; a mapping is (its dict, KWARGS): syncwise.train.batches
        batches = batch_shapes.pairs(_forever(loader), pipeline=not self.par.accepts_mappings)
        batches, layout_check = self._first_batches(batches, logger, cloud_config)
        callbacks = self._step_callbacks(state, logger)
        started = time.perf_counter()
        try:
            for callback in callbacks:
                callback.on_train_start(self)
            while self.step < total:
                for callback in callbacks:
                    callback.on_step_start(self, self.step + 1)
                if self.step >= total:  # a callback moved the step to the end (live recovery: healed from a peer)
                    break
                pending = self._train_step(batches)
                if not all(callback.commits(self, pending) for callback in callbacks):
                    continue  # the update did not commit on every replica: redo this step with the next batch
                self.step += 1
                self.tokens_seen += pending.tokens
                self._unlogged.append(pending)
                for callback in callbacks:
                    callback.on_step_end(self, pending)
                if self.should_stop:  # a preemption: every rank stops after this same step (the save is the final one)
                    break
                self._log_rows(keep=self.log_lag)  # rows are read log_lag steps late (see PendingStep)
            self.flush_rows()
            self._settle_skip()
            for callback in callbacks:
                callback.on_train_end(self)
        except RuntimeError as e:
            raise self._explain_hang(e) from e
        finally:
            self._clean_up(callbacks)
        summary = self._finish(callbacks, time.perf_counter() - started, cloud_config, layout_check)
        logger.finish(summary)
        rank_log.finish(summary)
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()
        return self.preemption.finish(summary)  # raises Preempted (exit code 83) after a stop

    def _data_shard(self) -> tuple[int, int]:
        """This rank's data shard (index, shards) by data-parallel rank; under live recovery one shard per rank of
        every configured replica group, fixed while replicas come and go. A user's DataLoader gets it and a resumable
        position (before len() and the train state see it); loaders that shard and checkpoint themselves
        (TokenBatchLoader) are left as they are."""
        if self.live is None:
            return self.par.dp_rank, self.par.dp_size
        return self.live.data_shard(self.par.dp_rank, self.par.dp_size)

    def _start_logs(self, total: int, redone: Optional[int]) -> tuple[MetricsLogger, RankLog]:
        """metrics.jsonl and the console (rank 0, whenever there is a run directory; show_progress=False only
        silences the console), every rank's own rows, the resume's note; the queue of rows not logged yet."""
        logger = MetricsLogger(self.run_dir, total, enabled=self.rank == 0, show=self.show_progress,
                               start_step=self.step, log_interval=self.log_interval)
        if redone is not None:
            logger.note(f"resumed from step {self.step}; {redone} step(s) after it are redone")
        elif getattr(self, "_resume_note", None) and self.rank == 0 and self.show_progress:
            print(self._resume_note, flush=True)  # one line, unwrapped (a path can be long)
        rank_log = RankLog(self.run_dir, self.rank, self.world_size, start_step=self.step)  # every rank's own rows
        self.meter.watch(rank_log)
        self._logs = (logger, rank_log)
        self._unlogged: collections.deque = collections.deque()  # PendingSteps whose rows are not logged yet
        self._history: list[StepResult] = []  # this invocation's settled steps (the summary's)
        self.val_loss: Optional[float] = None  # the last validation's loss
        self.should_stop = False  # set by a callback: the run stops after this step (a preemption)
        return logger, rank_log

    def _first_batches(self, batches: Iterator, logger: MetricsLogger, cloud_config: Any) -> tuple[Iterator, Any]:
        """Before the first step: injected faults attached, the DynamicBatcher's probe, the planner's layout check
        (``cloud_config``); the batches, none consumed, and the check's verdict (None without a cloud_config)."""
        if self.step == 0:
            self.faults.skew_router(self.model)
        self.faults.attach(self.model)
        if self.batcher is not None and not self.batcher.found:
            batches = self._find_micro_batch(batches, logger)
        if cloud_config is None:
            return batches, None
        return self._check_layout(cloud_config, batches, logger)

    def _step_callbacks(self, state: TrainState, logger: MetricsLogger) -> list[StepCallback]:
        """The loop's collaborators for this run, in the order the loop calls them (train/callbacks.py): each is in
        the list only when its feature is on; the sync strategy's (live recovery's quorum) first, a user's last."""
        callbacks: list[StepCallback] = [InjectedKills(self.faults)] if self.faults.has("kill", "hang") else []
        callbacks += self._sync_callbacks
        if self.world_size > 1:
            callbacks.append(Arrivals(ArrivalLog(self.run_dir, self.rank, start_step=self.step)))
        r = self.options.run
        profiler = StepProfiler(self.run_dir, self.rank, self.world_size, self.device.type,
                                parse_steps(r.profile_steps), r.profile_every, start_step=self.step)
        callbacks += [Profiling(profiler)] if profiler.enabled else []
        callbacks += [BatchChanges(self.batcher, logger)] if self.batcher is not None else []
        callbacks += [Validation(self.val_interval)] if self.val_loader is not None else []
        callbacks.append(Preemption(self.preemption))
        if self.checkpointer is not None:
            callbacks.append(CheckpointCadence(self.checkpointer, state, self._saves_checkpoints))
        if self.world_size > 1 and self.collective_timeout_s:
            callbacks.append(HangWatchdog(self.collective_timeout_s))
        self._callbacks = callbacks + list(self.callbacks)
        # those that act before a backward (asked inside the step: the list is empty unless a feature needs it)
        self._backward_gates = [c for c in self._callbacks
                                if type(c).before_backward is not StepCallback.before_backward]
        return self._callbacks

    def flush_rows(self) -> None:
        """Log every counted step's row now (a callback that needs this step's row: validation, a checkpoint)."""
        self._log_rows(keep=0)

    def _clean_up(self, callbacks: list[StepCallback]) -> None:
        """The loop's cleanup, every part of it run: the callbacks' ``close`` (in reverse order), the layout's. While
        an error is ending the run, a cleanup's own error (a full disk under a log's last flush) is printed, never
        raised over it: the user must see what ended the run. Without one, the first cleanup error is raised after
        the rest have run."""
        parts = [functools.partial(callback.close, self) for callback in reversed(callbacks)] + [self.par.close]
        ending = sys.exc_info()[1]
        first: Optional[BaseException] = None
        for part in parts:
            try:
                part()
            except Exception as e:  # noqa: BLE001 — every part runs; see the docstring for which error is raised
                if ending is not None:
                    what = getattr(getattr(part, "func", part), "__qualname__", part)
                    print(f"syncwise: rank {self.rank}: while ending on {type(ending).__name__}, cleanup "
                          f"{what} failed too: {e}", file=sys.stderr, flush=True)
                elif first is None:
                    first = e
        if first is not None:
            raise first

    def _open(self, loader: Any, checkpoint_dir: Optional[str], resume: Optional[str]) -> tuple[TrainState, Any]:
        """The checkpointer, the run directory's claim, the train state, and the resume: (state, steps redone;
        None for a fresh run)."""
        if checkpoint_dir is not None and self.checkpointer is None:
            # (live recovery: the replica groups share it; a replacement must not remove another group's save)
            self.checkpointer = SmartCheckpointer(checkpoint_dir, shared=self.live is not None)
        if resume is not None and self.checkpointer is None:
            raise ConfigError("resume", resume, "None/False unless checkpoint_dir= is given to train() (or a "
                              "SmartCheckpointer to OptimizedTrainer): there is nothing to resume from")
        # The run directory's lock, and no fresh run over an earlier one's files (as `syncwise train`): train/claim.py
        # (live recovery: the replica groups share the launcher's checkpoint directory, which it checked itself)
        shared = self.checkpointer.directory if self.checkpointer and self.live is None else None
        self._run_dir_lock = claim(self.run_dir, shared, resume,
                                   self.step > 0, self.rank, self.world_size, getattr(self, "_run_dir_lock", None))
        state = self.train_state(loader)
        redone = self._resume(resume, state)
        if self.live is not None:
            # The first quorum: a replacement heals from a live peer; with every replica lost (all at step 0 in
            # the quorum), the newest checkpoint is the fallback.
            self.phase = "live recovery join"
            self.live.join(self, state, lambda: self.checkpointer.load("auto", state) if self.checkpointer else None)
        self._start_step = self.step  # > 0: resumed; the summary then covers the earlier steps too (_earlier_steps)
        self.meter.step = self.step + 1
        return state, redone

    def _finish(self, callbacks: list[StepCallback], wall: float, cloud_config: Any,
                layout_check: Any) -> dict[str, Any]:
        """The run's summary: the steps' figures, the layout check, the callbacks' keys (checkpoint saves, a
        preemption, live recovery)."""
        summary = self._summary(self._history, self.val_loss, wall)
        summary.update(self._job_bytes(summary))
        if cloud_config is not None:
            summary["cloud_config"] = repr(cloud_config)
            summary["layout_check"] = layout_check
        for callback in callbacks:
            summary.update(callback.summary(self))
        return summary

    def _log_rows(self, keep: int) -> None:
        """Settle the queued steps until ``keep`` are left (see PendingStep); each row goes through the callbacks'
        ``on_row`` (validation, checkpoint columns), then to the logs (metrics.jsonl, the rank's own) and the metric
        sinks."""
        while len(self._unlogged) > keep:
            queued = self._unlogged.popleft()
            result = queued.settle()
            self._history.append(result)
            row = self._row(result, queued)
            for callback in self._callbacks:
                callback.on_row(self, row)
            for sink in (*self._logs, *self.metric_sinks):
                sink.log_step(row)

    def _check_layout(self, cloud_config: Any, batches: Iterator, logger: MetricsLogger) -> tuple[Iterator, dict]:
        """The planner's verdict on this layout (it warns when > 1.25× the best); the first batch is not consumed."""
        first = next(batches)
        # plan sits above train (DESIGN.md §3): the CloudConfig the caller hands in runs the check itself
        check = getattr(cloud_config, "check_training_run", None)
        view = first if first[1] is not batch_shapes.KWARGS else (first[0].get("input_ids"), None)  # a mapping's ids
        verdict = check(self, view) if check else {"skipped": "cloud_config is not a syncwise.plan.CloudConfig "
                                                    "(load a TOML with syncwise.plan.load_cluster)"}
        if verdict.get("warning"):
            logger.note(verdict["warning"])
        return itertools.chain([first], batches), verdict

    def _find_micro_batch(self, batches: Iterator, logger: MetricsLogger) -> Iterator:
        """Probe the largest micro-batch on the first loader batch (on the plain module: no collectives, so
        ranks may probe different sizes); the ranks then agree on the smallest. The batch is not consumed."""
        first = next(batches)
        inputs, targets = first
        rows = _rows(inputs)

        def probe(n: int) -> None:
            with self._autocast():
                loss = self._loss(self.model, _slice(inputs, 0, n), _slice(targets, 0, n))
            self.scaler.scale(loss).backward()

        def agree(n: int) -> int:
            if self.world_size == 1:
                return n
            t = torch.tensor([n], device=self.device)
            ops.all_reduce(t, "min", stats=self.par.ledger.control)
            return int(t.item())

        self.phase = "dynamic batch probe"
        size = self.batcher.find(probe, batch_size=rows, agree=agree,
                                 zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True))
        self.optimizer.zero_grad(set_to_none=True)
        logger.note(f"dynamic batch: micro-batches of {size} row(s) (batch {rows}; "
                    f"{self.batcher.history[-1].reason})")
        return itertools.chain([first], batches)

    def _already_finished(self, total: int) -> dict[str, Any]:
        """Resumed at or past ``total``: train nothing and keep the run's files (its summary.json) as they are."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()
        if self.rank == 0 and self.show_progress:
            print(f"syncwise: the run already finished at step {self.step} (steps={total}); nothing to train. "
                  "Pass a larger step count to train it further.", flush=True)
        path = RunDir(self.run_dir).summary if self.run_dir else None
        try:
            return json.loads(path.read_text()) if path is not None else {"steps": self.step}
        except (OSError, ValueError):
            return {"steps": self.step}

    def train_state(self, loader: Any = None) -> TrainState:
        """Everything a checkpoint must hold to resume this run exactly (components register by name)."""
        state = TrainState()
        state.register("model", ModelOptimizerState(self.model, self.optimizer))
        if self.lr_scheduler is not None:
            state.register("scheduler", self.lr_scheduler)
        if self.scaler.is_enabled():
            state.register("scaler", self.scaler)
        state.register("trainer", self)
        state.register("rng", RNGState(), per_rank=True)
        if loader is not None and hasattr(loader, "state_dict"):
            state.register("data", loader, per_rank=True, portable=position_is_global(loader))  # -> a new layout
        if self.batcher is not None:  # the micro size found (resume does not probe again); ranks may differ
            state.register("batcher", self.batcher, per_rank=True)
        if self.sync is not None and self.sync.replicas_diverge:  # each rank keeps its own model and optimizer
            state.register("replica", ModelOptimizerState(self.model, self.optimizer), per_rank=True)
        for name, (component, per_rank) in self.par.state_components().items():
            state.register(name, component, per_rank=per_rank)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Counters of the loop (the trainer is itself a checkpointed component)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = [int(s) for s in state.get("skipped_steps", [])]

    def _resume(self, resume: Optional[str], state: TrainState) -> Optional[int]:
        """Load the checkpoint ``resume`` names; returns how many logged steps will be redone (None: fresh)."""
        self._resume_note = None
        if resume is None or self.checkpointer is None:  # train() refused resume without a checkpointer
            return None
        step = self.checkpointer.load(resume, state)
        if self.sync is not None and step:
            # per-rank state is skipped when the world size changed: the strategy must then start afresh
            self.sync.resumed()
        if resume == "auto" and step == 0:
            # said in one line at start-up (train()), in both doors: a typo'd directory must not pass unnoticed
            self._resume_note = (f"syncwise: resume auto found no checkpoint in {self.checkpointer.directory}; "
                                 "starting a fresh run from step 0")
            return None
        logged = read_jsonl(RunDir(self.run_dir).metrics) if self.run_dir and self.rank == 0 else []
        return max(0, max((r.get("step", 0) for r in logged), default=step) - step)

    @property
    def phase(self) -> str:
        """What the loop is doing (the step meter's phase: the hang report and the watchdog's heartbeat name it)."""
        return self.meter.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.meter.phase = value

    @property
    def watchdog(self) -> Optional[Watchdog]:
        """The hang watchdog while a distributed ``train()`` with a collective timeout runs (else None)."""
        return self.meter.watchdog

    @watchdog.setter
    def watchdog(self, value: Optional[Watchdog]) -> None:
        self.meter.watchdog = value

    def _explain_hang(self, e: RuntimeError) -> Exception:
        lost = ops.peer_lost(e)  # a peer died mid-collective: gloo's socket closed, NCCL's communicator aborted
        if not (lost or ops.timed_out(e)):  # (also as the cause of a wrapper: the pipeline's "failed to run forward")
            return e
        failed = ops.last_failed(e)
        what = failed.describe() if failed is not None else (
            "DDP's gradient all-reduce on process group 'default'" if "gradient sync" in self.phase else None)
        if lost:
            error = SyncwiseError(
                f"{what or 'a collective'} during {self.phase} of step {self.step + 1} failed: a peer left the group "
                f"({str(e).strip().splitlines()[0][:160]}) — another rank died; its log says why.")
        elif self.watchdog is not None:
            error = SyncwiseError(self.watchdog.report(failed, what))
        else:
            error = SyncwiseError(
                f"{what or 'a collective'} during {self.phase} of step {self.step + 1} did not "
                f"complete within the {self.collective_timeout_s or 'configured'} s timeout — another rank probably "
                "died or hangs. Check the other workers' logs; raise --dist.timeout_s if steps are legitimately slow.")
        # this rank's flight recorder, with the report, for `syncwise doctor` to align the ranks' (comm/flight.py)
        flight.dump(RunDir(self.run_dir).flight_dump(self.rank) if self.run_dir else None, self.rank,
                    self.world_size, str(error))
        return error

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``val_loader``, averaged across ranks."""
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for inputs, targets in batch_shapes.pairs(self.val_loader, pipeline=not self.par.accepts_mappings):
            with self._autocast():
                inputs, targets = self._to_device(inputs), self._to_device(targets)
                total += self.par.eval_loss(inputs, targets, self._loss).float()  # a pipeline's: its last stage's
            count += 1
        self.model.train()
        return self._mean_across_ranks(total / max(count, 1))

    # ----------------------------------------------------------------------------------------- one step
    def _train_step(self, batches: Iterator) -> PendingStep:
        """One optimizer step: get batch → forward/backward (accumulating) → sync → update → meter."""
        with hostread.step_region():  # SYNCWISE_STRICT_SYNCS=1: no host read of a step value outside HostCopy
            return self._train_step_in(batches)

    def _train_step_in(self, batches: Iterator) -> PendingStep:
        step, last = self.step + 1, self.step + 1 >= self.total_steps
        meter = self.meter.begin(step)
        self.optimizer.zero_grad(set_to_none=True)
        loaded = self._next_batches(batches, step)
        syncing = self.par.syncs_gradients(step)  # local SGD: gradients stay on this replica after its warm-up
        loss = self._forward_backward(loaded, syncing, step)
        meter.backward_done(loss)
        updates = self._sync_exchange(step, last)
        grad_norm, skipped = self._update(step, updates)
        self._sync_after_step(step, last)
        return meter.end(loss, grad_norm, skipped, loaded, self._lr_used)

    def _next_batches(self, batches: Iterator, step: int) -> list:
        """The step's ``grad_accum_steps`` loader batches; the meter times the wait for them."""
        with self.meter.data_wait():
            loaded = [next(batches) for _ in range(self.grad_accum_steps)]
            self.faults.delay_data(step, self.rank)  # slowdata: a starved loader (injected)
        return loaded

    def _forward_backward(self, loaded: list, syncing: bool, step: int) -> torch.Tensor:
        """The step's loader batches forward and backward, gradients accumulating; only the last micro-batch syncs
        (when ``syncing``). With a DynamicBatcher: in micro-batches of the size that fits, the step redone from
        ``loaded`` after an out-of-memory. Returns the summed (weighted) loss."""
        poison = self.faults.poison_loss(step, self.rank)  # nan: this step's loss is NaN (injected)

        def micro(inputs: Any, targets: Any, weight: float, last: bool) -> torch.Tensor:
            return self._micro_batch(inputs, targets, weight, syncing=last and syncing, poison=poison)

        with self.faults.straggling(step, self.rank):  # slow: a straggler (injected)
            if self.batcher is not None:
                return self.batcher.accumulate(loaded, micro, lambda: self.optimizer.zero_grad(set_to_none=True),
                                               syncs=syncing, step=step)
            n = len(loaded)
            return sum(micro(x, y, 1 / n, i == n - 1) for i, (x, y) in enumerate(loaded))

    def _micro_batch(self, inputs: Any, targets: Any, weight: float, syncing: bool, poison: bool) -> torch.Tensor:
        """Forward/backward one micro-batch, its loss scaled by ``weight`` (its share of the step); its backward
        syncs gradients when ``syncing``. A ``poison``ed micro-batch's loss is NaN."""
        inputs, targets = self._to_device(inputs), self._to_device(targets)
        weight = weight * (math.nan if poison else 1.0)
        with self.par.micro_batch(syncing=syncing):
            if self.par.pipeline is not None:  # the schedule runs every microbatch's forward and backward
                self.phase = "pipeline schedule"
                with self._autocast():
                    loss = self.par.pipeline.step(inputs, targets, weight=weight)
                if poison and not self.par.pipeline.has_last:  # (the weight reaches only the last stage's loss)
                    self.faults.poison_stage(self.model)
                return loss
            self.phase = "forward/backward (gradient sync)"
            with self._autocast():
                loss = self._loss(self.par.module, inputs, targets) * weight
            for callback in self._backward_gates:  # (live recovery: the gradient sync's state is about to change)
                callback.before_backward(self, self.step + 1)
            self.scaler.scale(loss).backward()
        return loss.detach()

    def _to_device(self, x: Any) -> Any:
        """A batch's tensors (a tensor, or dicts/tuples/lists of them) on the trainer's device."""
        return x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else \
            batch_shapes.to_device(x, self.device)

    def _loss(self, model: Any, inputs: Any, targets: Any) -> torch.Tensor:
        """One micro-batch's forward and loss, for either batch shape (syncwise.train.batches)."""
        return batch_shapes.forward_loss(model, self.loss_fn, inputs, targets, lm_loss)

    def _update(self, step: int, updates: list) -> "tuple[torch.Tensor, bool | torch.Tensor]":
        """Apply the step's updates (``_apply_update``; none, one, or Pipe-SGD's two on the last step), then the
        ``after_update`` callbacks (the MoE router bias) with whether the step was skipped: (grad norm, skipped)."""
        grad_norm, skipped = torch.zeros(()), False
        for grads in updates:
            grad_norm, skipped = self._apply_update(step, grads)
        for callback in self.after_update if updates else ():
            callback(skipped)
        return grad_norm, skipped

    def _sync_exchange(self, step: int, last: bool) -> list:
        """The updates this step applies: ``[None]`` (the gradients in ``.grad``: synced by DDP, or local under
        local SGD), or a sync strategy's gradients (Pipe-SGD: none on step 1, two on the last)."""
        if self.sync is None:
            return [None]
        updates, waited = self.sync.exchange(step, last)
        self.meter.waited(waited)
        return updates

    def _sync_after_step(self, step: int, last: bool) -> None:
        """A sync strategy's work after the update (local SGD / DiLoCo: the replicas' average every H steps)."""
        if self.sync is not None:
            self.phase = f"{self.sync_spec} sync"
            self.meter.waited(self.sync.after_step(step, last))
            # local SGD: the steps a replica dropped, learnt by every replica at the average (SyncStrategy.skip)
            self.skipped_steps = sorted(set(self.skipped_steps).union(self.sync.take_skips()))

    def _update_router_bias(self, skipped: "bool | torch.Tensor") -> None:
        """After-update callback of an MoE model: aux-loss-free balancing nudges the router biases (not on a
        skipped step). Under local SGD each replica balances its own experts; the biases are averaged with the rest."""
        reduce = self._sum_across_ranks if self._lockstep else None
        if isinstance(skipped, torch.Tensor):  # skipped on the device: so is the bias update, unread
            self.model.update_router_bias(reduce, apply=~skipped)
        else:  # a skipped step's load counts go with it (no update; see MoE.update_bias)
            self.model.update_router_bias(reduce, apply=torch.tensor(not skipped))

    def _apply_update(self, step: int, grads: Optional[list] = None) -> "tuple[torch.Tensor, bool | torch.Tensor]":
        """Unscale, clip, skip a non-finite step (on every rank), optimizer and LR step: (grad norm, skipped).
        ``grads``: a sync strategy's gradients to apply instead of those in ``.grad`` (None: those).

        With an optimizer that can skip on the device (fused AdamW: GradScaler's ``found_inf`` protocol), the
        host never waits for the gradient norm: the optimizer gets the non-finite flag as a tensor, and the
        LR schedule and the skipped-step list follow when the flag is read, before the next update
        (``_settle_skip``). Otherwise the norm is read here.
        """
        if grads is not None:
            for p, g in zip(self.sync.params, grads):
                p.grad = g
        self._settle_skip()
        self._lr_used = self.optimizer.param_groups[0]["lr"]
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.par.clip_grad_norm(self.clip_grad_norm if self.clip_grad_norm > 0 else math.inf)
        # Synced gradients are identical on every rank, so every rank decides alike; under local SGD each
        # replica skips its own bad step (the others' gradients are fine, and the next average mixes them and
        # tells every replica which steps were dropped: SyncStrategy.skip).
        if self._skips_on_device:
            nonfinite = ~torch.isfinite(grad_norm)
            self.optimizer.found_inf, self.optimizer.grad_scale = nonfinite.float(), None
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale
            self._unsettled = (step, HostCopy({"nonfinite": nonfinite}))  # read a step later: no queue drain
            return grad_norm, nonfinite
        with hostread.designed("skip decided on the host (non-fused optimizer, fp16, local SGD / DiLoCo)"):
            skipped = not torch.isfinite(grad_norm).item()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps.append(step)
            self.scaler.update()
            # Local SGD: this replica alone drops the step (the others learn it at the next average); the LR
            # schedule is the run's and keeps pace with theirs.
            if self.sync is not None and self.sync.skip(step) and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            return grad_norm, True
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return grad_norm, False

    def _settle_skip(self) -> None:
        """Read the device-side skip flag of the last update (if not read yet): record a skipped step, or step
        the LR schedule."""
        if self._unsettled is not None:
            step, nonfinite = self._unsettled
            self._unsettled = None
            if nonfinite.read()["nonfinite"]:
                self.skipped_steps.append(step)
                # local SGD: this replica alone dropped the step (carried on the next average); the LR keeps pace
                if self.sync is not None and self.sync.skip(step) and self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()

    # ----------------------------------------------------------------------------------------- helpers
    def _row(self, r: StepResult, queued: PendingStep) -> dict[str, Any]:
        tps = r.tokens / r.step_time_s if r.step_time_s > 0 else 0.0
        row = {"step": queued.step, "loss": r.loss if math.isfinite(r.loss) else None, "lr": queued.lr,
               "tokens_per_s": tps,
               "step_time_s": r.step_time_s,
               "compute_s": r.compute_s, "comm_exposed_s": r.comm_exposed_s, "data_wait_s": r.data_wait_s,
               "comm_bytes": r.comm_bytes_total, "grad_norm": r.grad_norm,
               "peak_mem_mb": peak_memory_mb(self.device)}
        # per parallel dimension (dp, fsdp, tp, pp, ep): bytes, seconds, exposed seconds (train.meter.StepBytes)
        for dim, n in (r.comm_bytes_by_dim or {}).items():
            row[f"comm_bytes_{dim}"] = n
        for dim, t in (r.comm_s_by_dim or {}).items():
            row[f"comm_s_{dim}"] = t
        for dim, t in (r.comm_exposed_by_dim or {}).items():
            row[f"comm_exposed_s_{dim}"] = t
        row.update(hop_fields(r))  # the same bytes per hop: intra-node, cross-node
        util = mfu(self.flops_per_token, tps / self.world_size, self.peak.flops)
        if util is not None:
            row["mfu"] = util
        if queued.micro_batch is not None:
            row["micro_batch"] = queued.micro_batch
        # the pipeline's measured bubble (pp_bubble); compression compute, expert all-to-all time and load imbalance
        row.update({k: plain(v) for k, v in queued.parallel_metrics.items()})
        if r.skipped:
            row["skipped"] = True
        return row

    def _saves_checkpoints(self) -> bool:
        """Whether this rank's replica writes checkpoints (live recovery: only the replica of participating rank 0)."""
        return self.live is None or self.live.saves_checkpoints()

    def _earlier_steps(self) -> list[StepResult]:
        """After a resume, rank 0's steps before it as its metrics.jsonl recorded them: a summary covers the run."""
        start = getattr(self, "_start_step", 0)
        if not start or self.rank != 0 or not self.run_dir:
            return []
        rows = [r for r in read_jsonl(RunDir(self.run_dir).metrics) if r.get("step", 0) <= start]
        return [StepResult(loss=r["loss"] if r.get("loss") is not None else math.nan,
                           step_time_s=r.get("step_time_s") or 0.0, compute_s=r.get("compute_s") or 0.0,
                           comm_exposed_s=r.get("comm_exposed_s") or 0.0, data_wait_s=r.get("data_wait_s") or 0.0,
                           comm_bytes=r.get("comm_bytes"),
                           comm_bytes_by_dim=_by_dim(r, "comm_bytes_"), comm_s_by_dim=_by_dim(r, "comm_s_"),
                           comm_exposed_by_dim=_by_dim(r, "comm_exposed_s_"), comm_bytes_by_hop=row_hops(r),
                           comm_cross_by_dim=row_cross(r),
                           tokens=round((r.get("tokens_per_s") or 0.0) * (r.get("step_time_s") or 0.0)),
                           grad_norm=r.get("grad_norm") or 0.0, skipped=bool(r.get("skipped")))
                for r in sorted(rows, key=lambda r: r["step"])]

    def _summary(self, history: list[StepResult], val_loss: Optional[float], wall: float) -> dict[str, Any]:
        # A resumed run's summary covers every step of the run, not only this invocation's (rank 0: metrics.jsonl).
        history = self._earlier_steps() + history
        # The first steps include one-off costs (allocator warm-up, DDP bucket rebuild): leave them out of rates.
        # So are the compressor's / sync strategy's warm-up steps (PowerSGD's start_iter: full gradients): their
        # figures are reported apart, and a run that never left its warm-up says so.
        # the steady steps, tokens/s and train time by the one rule `syncwise report` uses too (metrics.figures)
        first_step = self.step - len(history) + 1
        warm = warmup_steps(self.compressor, self.sync)
        kept, warm_idx, never_left = figures.steady_steps(len(history), first_step, warm)
        steady, in_warmup = [history[i] for i in kept], [history[i] for i in warm_idx]
        n = max(len(steady), 1)
        step_time = sum(r.step_time_s for r in steady) / n
        parts = {k: sum(getattr(r, k) for r in steady) / n for k in ("compute_s", "comm_exposed_s", "data_wait_s")}
        return {
            "steps": self.step, "world_size": self.world_size,
            "final_loss": history[-1].loss if history else None, "final_val_loss": val_loss,
            "mean_step_time_s": step_time,
            "tokens_per_s": figures.tokens_per_s([r.tokens for r in steady], [r.step_time_s for r in steady]),
            "train_time_s": figures.train_time_s([r.step_time_s for r in history]),
            "compute_share": parts["compute_s"] / max(step_time, 1e-9),
            "comm_exposed_share": parts["comm_exposed_s"] / max(step_time, 1e-9),
            "data_wait_share": parts["data_wait_s"] / max(step_time, 1e-9),
            "comm_bytes_per_step": (sum(r.comm_bytes_total for r in steady) / n)
            if steady and all(r.comm_bytes_total is not None for r in steady) else None,
            **per_dimension(steady, step_time), **per_hop(steady, job_nodes(self.world_size)),
            "layout": describe_layout(self.par),
            "compressor": self.compress_spec, "sync": self.sync_spec,
            "sync_rounds": getattr(self.sync, "syncs", None),
            "skipped_steps": self.skipped_steps, "peak_mem_mb": peak_memory_mb(self.device), "wall_time_s": wall,
            "device": str(self.device), "accelerator": self.peak.part,
            "mfu_peak_tflops": self.peak.flops / 1e12 if self.peak.flops else None,
            **warmup_figures(warm, in_warmup, never_left, self.step, self.compress_spec
                             if warmup_steps(self.compressor, None) == warm else self.sync_spec),
        }

    def _job_bytes(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The whole job's bytes per step, in total and per parallel dimension (``job_comm_bytes_per_step[_<dim>]``):
        every rank's steady-state figures summed (one small all-reduce at the end of the run, control traffic).
        Rank 0's own figures show one rank; a pipeline's stages and expert-parallel ranks send different amounts.
        A dimension that some rank does not count (None) sums to None."""
        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return {}
        keys = ["comm_bytes_per_step"] + [f"comm_bytes_per_step_{d}" for d in DIMENSIONS]
        # absent: this rank sent nothing in that dimension (0); present but None: not counted (NaN sums to NaN)
        values = torch.tensor([0.0 if k not in summary else math.nan if summary[k] is None else float(summary[k])
                               for k in keys], dtype=torch.float64, device=self.device)
        ops.all_reduce(values, "sum", stats=self.par.ledger.control)
        out: dict[str, Any] = {}
        for k, v in zip(keys, values.tolist()):
            if k == keys[0] or v != 0.0:
                out["job_" + k] = v if math.isfinite(v) else None
        return out

    def _total_steps(self, loader: Iterable, epochs: Optional[int], steps: Optional[int]) -> int:
        if (epochs is None) == (steps is None):
            raise ConfigError("epochs/steps", {"epochs": epochs, "steps": steps}, "exactly one of them")
        if steps is not None:
            return count("steps", steps)
        count("epochs", epochs)
        try:
            batches = len(loader)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError("epochs", epochs, "steps= instead, for a loader without len() (an iterable "
                              "dataset)") from None
        return max(1, epochs * batches // self.grad_accum_steps)

    def _amp_dtype(self, mode: str) -> Optional[torch.dtype]:
        if mode == "auto":
            cuda_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            return torch.bfloat16 if cuda_bf16 else None
        if mode == "fp16" and self.device.type != "cuda":
            raise ConfigError("mixed_precision", "fp16", "none, bf16 or auto off a GPU (fp16 needs CUDA and a "
                              "GradScaler)")
        return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _mean_across_ranks(self, value: torch.Tensor) -> float:
        if self.world_size > 1:
            value = value.detach().float().clone()
            ops.all_reduce(value, "avg", stats=self.par.ledger.control)
        return float(value)

    def _sum_across_ranks(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks that hold the same layers (a pipeline stage's data-parallel ranks; every rank
        otherwise): the MoE load counts, whose layers differ between stages."""
        ops.all_reduce(tensor, "sum", group=self.par.dp_group, stats=self.par.ledger.control)


DIMENSIONS = ("dp", "fsdp", "tp", "pp", "ep")


OptimizedTrainer.__init__.__signature__ = options.signature(OptimizedTrainer.__init__)


def _by_dim(row: dict, prefix: str) -> Optional[dict]:
    """A metrics.jsonl row's per-dimension values under ``prefix`` (``comm_bytes_`` → {'dp': ..., 'tp': ...})."""
    out = {d: row[prefix + d] for d in DIMENSIONS if prefix + d in row}
    return out or None


def per_dimension(steady: list, step_time: float) -> dict[str, Any]:
    """Summary keys per parallel dimension over the steady steps: ``comm_bytes_per_step_<dim>``,
    ``comm_s_per_step_<dim>`` (seconds in its collectives), ``comm_exposed_share_<dim>`` (its exposed seconds / the
    step; None where not measured, e.g. FSDP2's on a GPU)."""
    out: dict[str, Any] = {}
    n = max(len(steady), 1)
    for dim in DIMENSIONS:
        rows = [r for r in steady if dim in (r.comm_bytes_by_dim or {}) or dim in (r.comm_s_by_dim or {})]
        if not rows or len(rows) != len(steady) or not any((r.comm_bytes_by_dim or {}).get(dim) or
                                                           (r.comm_s_by_dim or {}).get(dim) for r in rows):
            continue  # absent, or a dimension of one rank (nothing sent)
        sent = [(r.comm_bytes_by_dim or {}).get(dim) for r in rows]
        out[f"comm_bytes_per_step_{dim}"] = sum(sent) / n if all(b is not None for b in sent) else None
        took = [(r.comm_s_by_dim or {}).get(dim) for r in rows]
        out[f"comm_s_per_step_{dim}"] = sum(took) / n if all(t is not None for t in took) else None
        exposed = [(r.comm_exposed_by_dim or {}).get(dim) for r in rows]
        out[f"comm_exposed_share_{dim}"] = (sum(exposed) / n / max(step_time, 1e-9)
                                            if all(e is not None for e in exposed) else None)
    return out


def warmup_steps(compressor: Any, sync: Any) -> int:
    """The steps a compressor or sync strategy runs uncompressed / every step before it starts (0: none):
    syncwise's and PyTorch's PowerSGD (start_iter; torch's hook defaults to 10), local SGD's warmup."""
    config = getattr(compressor, "config", None)
    warm = int(getattr(config, "start_iter", 0) or 0)
    if isinstance(compressor, TorchHookSpec) and compressor.name == "powersgd":
        warm = int(compressor.options.get("start_iter", 10))
    spec = getattr(sync, "spec", None)
    return max(warm, int(getattr(spec, "warmup", 0) or 0))


def warmup_figures(warm: int, in_warmup: list, never_left: bool, steps: int, what: Any) -> dict:
    """Summary keys for the warm-up: its length, its bytes per step apart from the steady state's, a warning."""
    if not warm:
        return {}
    counted = [r.comm_bytes for r in in_warmup if r.comm_bytes is not None]
    out: dict[str, Any] = {"warmup_steps": warm,
                           "warmup_comm_bytes_per_step": sum(counted) / len(counted) if counted and
                           len(counted) == len(in_warmup) else None}
    if never_left:
        out["warning"] = (f"the run never left the warm-up of {what} ({warm} steps of full gradient traffic; the "
                          f"run has {steps}): its bytes and times are the warm-up's, not the steady state's. "
                          f"Run more than {warm} steps.")
    return out


def _forever(loader: Iterable) -> Iterator:
    """Iterate ``loader`` again and again (finite loaders are re-entered each epoch)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training loader yielded no batches")
