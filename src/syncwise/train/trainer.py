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
  5. the step returns a ``PendingStep``; the loop reads its numbers (loss, norm, data wait / compute /
     exposed communication, bytes) ``log_lag`` steps later — on a GPU one step, so the host never waits for
     the device inside the loop.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import ModelOptimizerState, RNGState, SmartCheckpointer, TrainState
from ..comm import ops
from ..comm.stats import CommStats
from ..comm.watchdog import Watchdog
from ..data.sharding import position_is_global, shard_loader
from ..errors import ConfigError, SyncwiseError
from ..models import lm_loss
from ..specs import count
from ..metrics import MetricsLogger, detect_peak, mfu, peak_memory_mb, read_jsonl
from ..metrics.ranklog import RankLog, StepProbe, plain
from ..parallel import ParallelSpec, TorchHookSpec, describe_layout, parallelize, rebind_optimizer
from . import arguments
from .dynamic_batch import DynamicBatcher
from .faults import FaultPlan
from .claim import claim
from .preemption import DEFAULT_GRACE_S, PreemptionGuard

# Collectives that are not gradient sync (loss averaging, validation, router-load sums) are counted here, so
# the per-step ``comm_bytes`` is exactly the gradient traffic.
CONTROL_STATS = CommStats()


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


@dataclass
class StepResult:
    """What one optimizer step measured."""

    loss: float
    step_time_s: float
    compute_s: float
    comm_exposed_s: float
    data_wait_s: float
    comm_bytes: Optional[int]  # data-parallel bytes; None when they bypass syncwise.comm (torch's PowerSGD, FSDP2)
    tokens: int
    grad_norm: float
    skipped: bool
    comm_bytes_by_dim: Optional[dict] = None  # per parallel dimension ('dp', 'tp'); None where not counted


@dataclass
class PendingStep:
    """A step the host has queued; its device-side numbers are read by ``settle()`` when its row is logged.

    On a GPU the host runs ahead of the device: reading the loss or the gradient norm at once would make it
    wait for every queued kernel each step. The loop settles a step one step later (as torchtitan logs), by
    which time its kernels have long finished, so the read costs nothing and the GPU queue never drains.
    """

    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: "bool | torch.Tensor"  # a 0-d bool tensor when the optimizer skipped on the device
    step_time_s: float
    data_wait_s: float
    comm_waited_s: float  # host-timed waits of a sync strategy
    exposed_comm: Callable[[], float]  # reads the DDP timer's events
    comm_bytes: dict  # per parallel dimension: bytes this rank sent (None where not counted)
    tokens: int
    lr: float  # the learning rate this step's update used
    micro_batch: Optional[int] = None  # DynamicBatcher's micro size after this step
    parallel_metrics: dict = field(default_factory=dict)  # what the layout measured (the pipeline's bubble)
    _settled: Optional[StepResult] = None

    def settle(self) -> StepResult:
        if self._settled is None:
            comm = self.comm_waited_s + self.exposed_comm()
            self._settled = StepResult(
                loss=float(self.loss), step_time_s=self.step_time_s,
                compute_s=max(0.0, self.step_time_s - self.data_wait_s - comm), comm_exposed_s=comm,
                data_wait_s=self.data_wait_s, comm_bytes=self.comm_bytes.get("dp"), tokens=self.tokens,
                comm_bytes_by_dim=self.comm_bytes,
                grad_norm=float(self.grad_norm), skipped=bool(self.skipped))
        return self._settled


class OptimizedTrainer:
    """Train any ``nn.Module`` data-parallel, with compressed gradient sync, AMP, accumulation and metrics.

    Seed API: ``OptimizedTrainer(model, optimizer, loss_fn, compress_gradients=..., mixed_precision=...)``
    then ``.train(loader, epochs=... or steps=..., checkpoint_dir=..., resume=...)``. ``loader`` yields
    ``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` gives the loss.

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
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss, *, compress_gradients: Any = None,
                 mixed_precision: str = "auto", grad_accum_steps: int = 1, clip_grad_norm: float = 1.0,
                 lr_scheduler: Any = None, compile: bool = False, activation_checkpointing: bool = False,
                 bucket_cap_mb: float = 25.0, min_numel: int = 4096, device: Optional[torch.device] = None,
                 val_loader: Optional[Iterable] = None, val_interval: int = 0, run_dir: Optional[str] = None,
                 flops_per_token: Optional[float] = None, show_progress: bool = True,
                 checkpointer: Optional[SmartCheckpointer] = None, inject_faults: Optional[list[str]] = None,
                 collective_timeout_s: Optional[float] = None, sync: Any = None, data_seed: int = 0,
                 tf32: bool = True, dynamic_batch: Optional[DynamicBatcher] = None,
                 parallel: "ParallelSpec | dict | None" = None, tp_plan: Optional[dict] = None,
                 pipeline_split: Optional[Callable[[nn.Module, int, int], nn.Module]] = None,
                 preempt_grace_s: Optional[float] = DEFAULT_GRACE_S, log_interval: int = 10):
        given_precision = mixed_precision  # errors echo what the caller wrote ('half'), not its normal form
        mixed_precision = arguments.mixed_precision_mode(mixed_precision)
        self.grad_accum_steps = count("grad_accum_steps", grad_accum_steps)
        self.clip_grad_norm = arguments.finite("clip_grad_norm", clip_grad_norm)
        self.val_interval = count("val_interval", val_interval, minimum=0)
        self.log_interval = count("log_interval", log_interval)  # plain output: a progress line every N steps
        self.data_seed = count("data_seed", data_seed, minimum=0)  # shuffle order of a sharded loader
        arguments.finite("bucket_cap_mb", bucket_cap_mb, inclusive=False)
        if collective_timeout_s is not None:
            arguments.finite("collective_timeout_s", collective_timeout_s, inclusive=False)
        run_dir = arguments.as_path("run_dir", run_dir)
        self.device = device or next(model.parameters()).device
        # Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) and no process group yet: join the job, so the
        # ranks train one model together instead of WORLD_SIZE independent copies.
        self.owns_process_group = arguments.join_torchrun(self.device, collective_timeout_s)
        self.rank, self.world_size = _world()
        if collective_timeout_s:
            ops.set_collective_timeout(collective_timeout_s)  # also for the groups the hook creates below
        self.model = model.to(self.device)  # the plain module: evaluation, checkpoints, router updates
        if self.device.type == "cuda" and tf32:
            # fp32 matmuls (the parts autocast leaves in fp32, and mixed_precision='none') on tensor cores.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        try:
            self.compressor = _resolve_compressor(compress_gradients)
        except ConfigError as e:  # the spec parser names its own field; here the argument is compress_gradients
            raise ConfigError("compress_gradients", compress_gradients, e.accepted) from None
        self.compress_spec = compress_gradients if isinstance(compress_gradients, str) else (
            getattr(self.compressor, "spec", None) or getattr(self.compressor, "name", "none"))
        try:
            self.amp_dtype = self._amp_dtype(mixed_precision)
        except ConfigError as e:
            raise ConfigError(e.field, given_precision, e.accepted) from None
        # Everything parallel happens behind this one seam (syncwise.parallel.parallelize, in its one order).
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.par = parallelize(self.model, parallel, self.device, compressor=self.compressor,
                               bucket_cap_mb=bucket_cap_mb, min_numel=min_numel, sync=sync,
                               activation_checkpointing=activation_checkpointing, compile=compile, tp_plan=tp_plan,
                               loss_fn=loss_fn, split_fn=pipeline_split,
                               # bf16 autocast: FSDP2 gathers bf16 parameters, reduces fp32 (issue 24)
                               param_dtype=torch.bfloat16 if self.amp_dtype == torch.bfloat16 else None)
        self.model = self.par.model  # under pipeline parallel: this rank's stages only
        # FSDP2 / TP put sharded parameters in the model's place; a pipeline stage keeps some of them.
        rebind_optimizer(optimizer, names, self.model, keep_only_present=self.par.pipeline is not None)
        self.sync = self.par.sync  # the reduced-sync strategy the step drives (None: every-step sync)
        self.sync_spec = self.sync.spec.spec if self.sync is not None else "every-step"
        self.optimizer, self.lr_scheduler, self.loss_fn = optimizer, lr_scheduler, loss_fn
        if self.amp_dtype == torch.float16 and self.par.pipeline is not None:
            raise ConfigError("mixed_precision", given_precision, "bf16 or none with pipeline parallel: fp16 needs "
                              "GradScaler's loss scaling, which cannot wrap the schedule's own backward")
        # fp16 needs loss scaling; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.val_loader, self.run_dir, self.show_progress = val_loader, run_dir, show_progress
        self.flops_per_token = flops_per_token
        self.peak = detect_peak(self.device)  # the part's dense bf16 peak, for MFU (None on a CPU)
        self.checkpointer = checkpointer
        self.faults = FaultPlan(inject_faults or [], run_dir)
        # SIGTERM / SIGUSR1 during train(): stop after a step every rank agrees on, save, raise Preempted
        # (train/preemption.py); None or 0 leaves the signals alone.
        self.preemption = PreemptionGuard(arguments.finite("preempt_grace_s", preempt_grace_s or 0.0),
                                          self.rank, self.world_size)
        self._probe = StepProbe(self.model, self.par)  # per-step extras for `syncwise doctor` (no collectives)
        self.collective_timeout_s = collective_timeout_s
        if dynamic_batch is not None and not isinstance(dynamic_batch, DynamicBatcher):
            raise ConfigError("dynamic_batch", dynamic_batch, "None or a syncwise.train.DynamicBatcher")
        if dynamic_batch is not None and not self.par.spec.replicas_only:
            raise ConfigError("dynamic_batch", dynamic_batch, "None with FSDP2 or tensor parallel: every forward "
                              "there is collective, so one rank cannot probe or redo a micro-batch alone")
        self.batcher = dynamic_batch  # micro-batches that fit; None: each loader batch is one micro-batch
        self.step = 0
        self.total_steps = 0
        self.tokens_seen = 0
        self.skipped_steps: list[int] = []
        self.metric_sinks: list[Any] = []  # each gets every metrics.jsonl row: syncwise.metrics.sinks (Prometheus, W&B)
        self.watchdog: Optional[Watchdog] = None  # hang reports; runs during train() when distributed
        self.phase = "start"  # what the step is doing, for the message when a collective hangs
        # Skip a non-finite step inside the optimizer (no host read of the gradient norm) where it can: fused
        # AdamW takes GradScaler's found_inf flag. fp16 keeps GradScaler's own path; reduced-sync strategies
        # decide per replica on the host.
        self._skips_on_device = (getattr(optimizer, "_step_supports_amp_scaling", False)
                                 and all(g.get("fused") for g in optimizer.param_groups)
                                 and not self.scaler.is_enabled() and self.sync is None)
        self._unsettled: Optional[tuple[int, torch.Tensor]] = None  # (step, non-finite flag) not read yet
        self._lr_used = optimizer.param_groups[0]["lr"]
        # Rows (loss, norm, timings) are read this many steps late: on a GPU the host then never waits for
        # the device inside the loop; on a CPU there is nothing to gain.
        self.log_lag = 1 if self.device.type == "cuda" else 0

    # ----------------------------------------------------------------------------------------- public API
    def train(self, loader: Iterable, epochs: Optional[int] = None, steps: Optional[int] = None,
              checkpoint_dir: Optional[str] = None, resume: Optional[str] = None,
              cloud_config: Any = None) -> dict[str, Any]:
        """Run until ``steps`` optimizer steps (or ``epochs`` passes over ``loader``); return the summary.

        ``checkpoint_dir`` (or a ``checkpointer`` given to the constructor) enables checkpoints; ``resume``
        is 'auto' (newest valid checkpoint there, if any), a checkpoint path, or None. ``cloud_config`` (a
        ``syncwise.plan.CloudConfig``, e.g. ``load_cluster("cluster.toml")``) has the planner predict this layout
        and the best one for this model and batch, and warn when this one is predicted > 1.25× slower (summary
        ``layout_check``; docs/plan.md).
        """
        resume = arguments.resume_mode(resume)
        checkpoint_dir = arguments.as_path("checkpoint_dir", checkpoint_dir)
        # A user's DataLoader gets this rank's shard and a resumable position (before len() and the train
        # state see it); loaders that shard and checkpoint themselves (TokenBatchLoader) are left as they are.
        loader = shard_loader(loader, self.par.dp_rank, self.par.dp_size, seed=self.data_seed)
        total = self.total_steps = self._total_steps(loader, epochs, steps)
        if checkpoint_dir is not None and self.checkpointer is None:
            self.checkpointer = SmartCheckpointer(checkpoint_dir)
        if resume is not None and self.checkpointer is None:
            raise ConfigError("resume", resume, "None/False unless checkpoint_dir= is given to train() (or a "
                              "SmartCheckpointer to OptimizedTrainer): there is nothing to resume from")
        # The run directory's lock, and no fresh run over an earlier one's files (as `syncwise train`): train/claim.py
        self._run_dir_lock = claim(self.run_dir, self.checkpointer.directory if self.checkpointer else None, resume,
                                   self.step > 0, self.rank, self.world_size, getattr(self, "_run_dir_lock", None))
        state = self.train_state(loader)
        redone = self._resume(resume, state)
        self._start_step = self.step  # > 0: resumed; the summary then covers the earlier steps too (_earlier_steps)
        if self.step >= total:
            return self._already_finished(total)
        # Files on rank 0 whenever there is a run directory; show_progress=False only silences the console.
        logger = MetricsLogger(self.run_dir, total, enabled=self.rank == 0, show=self.show_progress,
                               start_step=self.step, log_interval=self.log_interval)
        if redone is not None:
            logger.note(f"resumed from step {self.step}; {redone} step(s) after it are redone")
        rank_log = RankLog(self.run_dir, self.rank, self.world_size, start_step=self.step)  # every rank's own rows
        rank_log.watch(CONTROL_STATS, self._probe.ep_stats)
        if self.step == 0:
            self.faults.skew_router(self.model)
        batches = _forever(loader)
        if self.batcher is not None and not self.batcher.found:
            batches = self._find_micro_batch(batches, logger)
        layout_check = None
        if cloud_config is not None:  # the planner's verdict on this layout (it warns when > 1.25× the best)
            first = next(batches)
            batches = itertools.chain([first], batches)
            # plan sits above train (DESIGN.md §3): the CloudConfig the caller hands in runs the check itself
            check = getattr(cloud_config, "check_training_run", None)
            layout_check = check(self, first) if check else {"skipped": "cloud_config is not a syncwise.plan."
                                                             "CloudConfig (load a TOML with syncwise.plan.load_cluster)"}
            if layout_check.get("warning"):
                logger.note(layout_check["warning"])
        if self.world_size > 1 and self.collective_timeout_s:
            self.watchdog = Watchdog(self.collective_timeout_s, self.rank, self.world_size,
                                     Path(self.run_dir) / "heartbeats" if self.run_dir else None)
        history: list[StepResult] = []
        unlogged: collections.deque = collections.deque()  # (PendingStep, checkpoint save in flight during it)
        changes_seen = len(self.batcher.history) if self.batcher is not None else 0
        val_loss = None
        started = time.perf_counter()
        self.preemption.install(self.run_dir or (self.checkpointer.directory if self.checkpointer else None),
                                self.checkpointer.directory if self.checkpointer else None)
        try:
            while self.step < total:
                self.faults.maybe_kill(self.step + 1, self.rank)
                # Whether an async checkpoint write runs in the background during this step: the benchmarks
                # compare such steps with the others to measure what an in-flight save costs training.
                in_flight = self.checkpointer is not None and self.checkpointer.save_in_flight
                unlogged.append((self._train_step(batches), in_flight))
                self.step += 1
                if self.batcher is not None:
                    for change in self.batcher.history[changes_seen:]:
                        logger.note(f"dynamic batch: step {change.step}: micro-batch {change.old} → {change.new} "
                                    f"({change.reason})")
                    changes_seen = len(self.batcher.history)
                validate = self.val_loader is not None and (self.step == total or (
                    self.val_interval and self.step % self.val_interval == 0))
                # A SIGTERM/SIGUSR1 on any rank: every rank stops after this same step (the save is the final one).
                stop = self.step < total and self.preemption.stop_after(self.step)
                save = not stop and self.checkpointer is not None and self.step < total and \
                    self.checkpointer.should_save(self.step, unlogged[-1][0].step_time_s)
                # Rows are read `log_lag` steps late (see PendingStep), at once when this step's row is needed.
                keep = 0 if validate or save or stop or self.step == total else self.log_lag
                while len(unlogged) > keep:
                    queued, in_flight = unlogged.popleft()
                    result = queued.settle()
                    history.append(result)
                    row = self._row(result, queued)
                    if self.checkpointer is not None:
                        row["ckpt_in_flight"] = in_flight
                    if validate and queued.step == self.step:
                        self.phase = "validation"
                        val_loss = row["val_loss"] = self.evaluate()
                    logger.log_step(row)
                    rank_log.log_step(row)
                    for sink in self.metric_sinks:
                        sink.log_step(row)
                if save:
                    self._settle_skip()
                    self.phase = "checkpoint save"
                    self.checkpointer.save(self.step, state)
                if stop:
                    break
            self._settle_skip()
            if self.checkpointer is not None:
                self.phase = "final checkpoint save"
                if self.checkpointer.last_save is None or self.checkpointer.last_save.step != self.step:
                    self.checkpointer.save(self.step, state)
                self.checkpointer.close()
        except RuntimeError as e:
            raise self._explain_hang(e) from e
        finally:
            self.preemption.uninstall()
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            self.par.close()
        summary = self._summary(history, val_loss, time.perf_counter() - started)
        if self.checkpointer is not None:
            # This rank's save costs (rank 0's total_s runs until the checkpoint is published).
            summary["checkpoint_saves"] = [
                {"step": s.step, "blocking_s": s.blocking_s, "total_s": s.total_s, "bytes": s.bytes}
                for s in self.checkpointer.history]
        if cloud_config is not None:
            summary["cloud_config"] = repr(cloud_config)
            summary["layout_check"] = layout_check
        if self.preemption.stopping_step is not None:  # saved above; rank 0 writes RUN_DIR/preempted.json
            summary["preempted"] = self.preemption.record(self.checkpointer)
        logger.finish(summary)
        rank_log.finish(summary)
        if self._run_dir_lock is not None:
            self._run_dir_lock.release()
        return self.preemption.finish(summary)  # raises Preempted (exit code 83) after a stop

    def _find_micro_batch(self, batches: Iterator, logger: MetricsLogger) -> Iterator:
        """Probe the largest micro-batch on the first loader batch (on the plain module: no collectives, so
        ranks may probe different sizes); the ranks then agree on the smallest. The batch is not consumed."""
        first = next(batches)
        inputs, targets = first

        def probe(n: int) -> None:
            with self._autocast():
                loss = self.loss_fn(self.model(inputs[:n].to(self.device)), targets[:n].to(self.device))
            self.scaler.scale(loss).backward()

        def agree(n: int) -> int:
            if self.world_size == 1:
                return n
            t = torch.tensor([n], device=self.device)
            ops.all_reduce(t, "min", stats=CONTROL_STATS)
            return int(t.item())

        self.phase = "dynamic batch probe"
        size = self.batcher.find(probe, batch_size=len(inputs), agree=agree,
                                 zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True))
        self.optimizer.zero_grad(set_to_none=True)
        logger.note(f"dynamic batch: micro-batches of {size} row(s) (batch {len(inputs)}; "
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
        path = Path(self.run_dir) / "summary.json" if self.run_dir else None
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
        if resume is None or self.checkpointer is None:  # train() refused resume without a checkpointer
            return None
        step = self.checkpointer.load(resume, state)
        if self.sync is not None and step:
            # per-rank state is skipped when the world size changed: the strategy must then start afresh
            self.sync.resumed()
        if resume == "auto" and step == 0:
            return None
        logged = read_jsonl(Path(self.run_dir) / "metrics.jsonl") if self.run_dir and self.rank == 0 else []
        return max(0, max((r.get("step", 0) for r in logged), default=step) - step)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.watchdog is not None:
            self.watchdog.at(self.step + 1, value)

    def _explain_hang(self, e: RuntimeError) -> Exception:
        if not ops.timed_out(e):  # (also as the cause of a wrapper: the pipeline stage's "failed to run forward")
            return e
        failed = ops.last_failed(e)
        what = failed.describe() if failed is not None else (
            "DDP's gradient all-reduce on process group 'default'" if "gradient sync" in self.phase else None)
        if self.watchdog is not None:
            return SyncwiseError(self.watchdog.report(failed, what))
        return SyncwiseError(
            f"{what or 'a collective'} during {self.phase} of step {self.step + 1} did not "
            f"complete within the {self.collective_timeout_s or 'configured'} s timeout — another rank probably "
            "died or hangs. Check the other workers' logs; raise --dist.timeout_s if steps are legitimately slow.")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``val_loader``, averaged across ranks."""
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for inputs, targets in self.val_loader:
            with self._autocast():
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                if self.par.pipeline is not None:  # every stage runs its part; the last one's loss is broadcast
                    total += self.par.pipeline.eval_loss(inputs, targets).float()
                else:
                    total += self.loss_fn(self.model(inputs), targets).float()
            count += 1
        self.model.train()
        return self._mean_across_ranks(total / max(count, 1))

    # ----------------------------------------------------------------------------------------- one step
    def _train_step(self, batches: Iterator) -> PendingStep:
        t_start = time.perf_counter()
        comm_waited = 0.0
        self.par.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        accum = self.grad_accum_steps
        # Local SGD: gradients stay on this replica except during its warm-up.
        sync_grads = self.par.syncs_gradients(self.step + 1)
        poison = self.faults.poison_loss(self.step + 1, self.rank)
        self.phase = "data loading"
        t_data = time.perf_counter()
        loaded = [next(batches) for _ in range(accum)]
        self.faults.delay_data(self.step + 1, self.rank)  # slowdata: a starved loader (injected)
        data_wait = time.perf_counter() - t_data
        tokens = sum(x.numel() if not x.is_floating_point() else x.size(0) for x, _ in loaded)

        def run_micro(inputs: Any, targets: Any, weight: float, last: bool) -> torch.Tensor:
            """Forward/backward one micro-batch; only the last one of the step syncs gradients."""
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            with self.par.micro_batch(syncing=last and sync_grads):
                self.phase = "forward/backward (gradient sync)"
                if self.par.pipeline is not None:  # the schedule runs every microbatch's forward and backward
                    self.phase = "pipeline schedule"
                    with self._autocast():
                        loss = self.par.pipeline.step(inputs, targets, weight=weight * (math.nan if poison else 1.0))
                    if poison and not self.par.pipeline.has_last:  # (the weight reaches only the last stage's loss)
                        next(p for p in self.model.parameters() if p.grad is not None).grad.mul_(math.nan)
                    return loss
                with self._autocast():
                    loss = self.loss_fn(self.par.module(inputs), targets) * weight
                if poison:
                    loss = loss * float("nan")
                self.scaler.scale(loss).backward()
            return loss.detach()

        t_micro = self.faults.stretch(self.step + 1, self.rank)  # slow: a straggler (injected)
        if self.batcher is None:
            loss_sum = sum(run_micro(x, y, 1 / accum, i == accum - 1) for i, (x, y) in enumerate(loaded))
        else:  # micro-batches of the size that fits; an out-of-memory redoes the step from `loaded`
            loss_sum = self.batcher.accumulate(loaded, run_micro, lambda: self.optimizer.zero_grad(set_to_none=True),
                                               syncs=sync_grads, step=self.step + 1)
        self.faults.stretched(time.perf_counter() - t_micro)
        exposed_comm = self.par.take_exposed()
        # The logged loss is the mean over ranks; its tiny all-reduce runs while the optimizer steps. Replicas
        # that diverge (local SGD) skip every per-step collective: each would hold the ranks in lockstep, and
        # the step would wait for the slowest one; rank 0's replica's loss is logged instead.
        in_lockstep = self.world_size > 1 and not (self.sync is not None and self.sync.replicas_diverge)
        loss_work = ops.all_reduce(loss_sum, "avg", async_op=True, stats=CONTROL_STATS) if in_lockstep else None

        self.phase = "optimizer step"
        step, last = self.step + 1, self.step + 1 >= self.total_steps
        updates: list = [None]  # None: apply the gradients in .grad (synced by DDP, or local under local SGD)
        if self.sync is not None:
            updates, waited = self.sync.exchange(step, last)  # Pipe-SGD: 0 updates on step 1, 2 on the last
            comm_waited += waited
        grad_norm, skipped = torch.zeros(()), False
        for grads in updates:
            if grads is not None:
                for p, g in zip(self.sync.params, grads):
                    p.grad = g
            grad_norm, skipped = self._apply_update(step)
        update_bias = getattr(self.model, "update_router_bias", None)
        if updates and update_bias is not None:
            # Under local SGD each replica balances its own experts; the biases are averaged with the rest.
            reduce = self._sum_across_ranks if in_lockstep else None
            if isinstance(skipped, torch.Tensor):  # skipped on the device: so is the bias update, unread
                update_bias(reduce, apply=~skipped)
            else:  # a skipped step's load counts go with it (no update; see MoE.update_bias)
                update_bias(reduce, apply=torch.tensor(not skipped))
        if self.sync is not None:
            self.phase = f"{self.sync_spec} sync"
            comm_waited += self.sync.after_step(step, last)
            self.skipped_steps = sorted(set(self.skipped_steps).union(self.sync.take_skips()))
        comm_bytes = self.par.comm_bytes()
        if loss_work is not None:
            loss_work.wait()
        self.tokens_seen += tokens * self.par.dp_size
        return PendingStep(step=step, loss=loss_sum, grad_norm=grad_norm, skipped=skipped,
                           step_time_s=time.perf_counter() - t_start, data_wait_s=data_wait,
                           comm_waited_s=comm_waited, exposed_comm=exposed_comm,
                           comm_bytes=comm_bytes, tokens=tokens * self.par.dp_size, lr=self._lr_used,
                           micro_batch=self.batcher.size if self.batcher is not None else None,
                           parallel_metrics={**self.par.step_metrics(), **self._probe.take()})

    def _apply_update(self, step: int) -> "tuple[torch.Tensor, bool | torch.Tensor]":
        """Unscale, clip, skip a non-finite step (on every rank), optimizer and LR step: (grad norm, skipped).

        With an optimizer that can skip on the device (fused AdamW: GradScaler's ``found_inf`` protocol), the
        host never waits for the gradient norm: the optimizer gets the non-finite flag as a tensor, and the
        LR schedule and the skipped-step list follow when the flag is read, before the next update
        (``_settle_skip``). Otherwise the norm is read here.
        """
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
            self._unsettled = (step, nonfinite)
            return grad_norm, nonfinite
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
            if bool(nonfinite):
                self.skipped_steps.append(step)
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()

    # ----------------------------------------------------------------------------------------- helpers
    def _row(self, r: StepResult, queued: PendingStep) -> dict[str, Any]:
        tps = r.tokens / r.step_time_s if r.step_time_s > 0 else 0.0
        row = {"step": queued.step, "loss": r.loss if math.isfinite(r.loss) else None, "lr": queued.lr,
               "tokens_per_s": tps,
               "step_time_s": r.step_time_s,
               "compute_s": r.compute_s, "comm_exposed_s": r.comm_exposed_s, "data_wait_s": r.data_wait_s,
               "comm_bytes": r.comm_bytes, "grad_norm": r.grad_norm, "peak_mem_mb": peak_memory_mb(self.device)}
        for dim, n in (r.comm_bytes_by_dim or {}).items():
            row[f"comm_bytes_{dim}"] = n
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

    def _earlier_steps(self) -> list[StepResult]:
        """After a resume, rank 0's steps before it as its metrics.jsonl recorded them: a summary covers the run."""
        start = getattr(self, "_start_step", 0)
        if not start or self.rank != 0 or not self.run_dir:
            return []
        rows = [r for r in read_jsonl(Path(self.run_dir) / "metrics.jsonl") if r.get("step", 0) <= start]
        return [StepResult(loss=r["loss"] if r.get("loss") is not None else math.nan,
                           step_time_s=r.get("step_time_s") or 0.0, compute_s=r.get("compute_s") or 0.0,
                           comm_exposed_s=r.get("comm_exposed_s") or 0.0, data_wait_s=r.get("data_wait_s") or 0.0,
                           comm_bytes=r.get("comm_bytes"),
                           tokens=round((r.get("tokens_per_s") or 0.0) * (r.get("step_time_s") or 0.0)),
                           grad_norm=r.get("grad_norm") or 0.0, skipped=bool(r.get("skipped")))
                for r in sorted(rows, key=lambda r: r["step"])]

    def _summary(self, history: list[StepResult], val_loss: Optional[float], wall: float) -> dict[str, Any]:
        # A resumed run's summary covers every step of the run, not only this invocation's (rank 0: metrics.jsonl).
        history = self._earlier_steps() + history
        # The first steps include one-off costs (allocator warm-up, DDP bucket rebuild): leave them out of rates.
        # So are the compressor's / sync strategy's warm-up steps (PowerSGD's start_iter: full gradients): their
        # figures are reported apart, and a run that never left its warm-up says so.
        first_step = self.step - len(history) + 1
        warm = warmup_steps(self.compressor, self.sync)
        cut = min(len(history) - 1, max(1, len(history) // 10)) if history else 0
        steady = [r for i, r in enumerate(history[cut:], first_step + cut) if i > warm]
        in_warmup = [r for i, r in enumerate(history, first_step) if i <= warm]
        never_left = bool(warm) and bool(history) and not steady
        if never_left:
            steady = history[cut:]
        n = max(len(steady), 1)
        step_time = sum(r.step_time_s for r in steady) / n
        parts = {k: sum(getattr(r, k) for r in steady) / n for k in ("compute_s", "comm_exposed_s", "data_wait_s")}
        return {
            "steps": self.step, "world_size": self.world_size,
            "final_loss": history[-1].loss if history else None, "final_val_loss": val_loss,
            "mean_step_time_s": step_time, "tokens_per_s": (sum(r.tokens for r in steady) / n) / max(step_time, 1e-9),
            "compute_share": parts["compute_s"] / max(step_time, 1e-9),
            "comm_exposed_share": parts["comm_exposed_s"] / max(step_time, 1e-9),
            "data_wait_share": parts["data_wait_s"] / max(step_time, 1e-9),
            "comm_bytes_per_step": (sum(r.comm_bytes for r in steady) / n)
            if steady and all(r.comm_bytes is not None for r in steady) else None,
            "layout": describe_layout(self.par),
            "compressor": self.compress_spec, "sync": self.sync_spec,
            "sync_rounds": getattr(self.sync, "syncs", None),
            "skipped_steps": self.skipped_steps, "peak_mem_mb": peak_memory_mb(self.device), "wall_time_s": wall,
            "device": str(self.device), "accelerator": self.peak.part,
            "mfu_peak_tflops": self.peak.flops / 1e12 if self.peak.flops else None,
            **warmup_figures(warm, in_warmup, never_left, self.step, self.compress_spec
                             if warmup_steps(self.compressor, None) == warm else self.sync_spec),
        }

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
            ops.all_reduce(value, "avg", stats=CONTROL_STATS)
        return float(value)

    def _sum_across_ranks(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks that hold the same layers (a pipeline stage's data-parallel ranks; every rank
        otherwise): the MoE load counts, whose layers differ between stages."""
        ops.all_reduce(tensor, "sum", group=self.par.dp_group, stats=CONTROL_STATS)


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
