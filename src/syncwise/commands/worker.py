"""The worker side of `syncwise train`: build model, data and optimizer from a RunConfig and train.

This is the composition root of a worker: the one place that turns a validated ``RunConfig`` into a corpus,
a model, an optimizer, a checkpointer and an ``OptimizedTrainer``. It lives in the command layer because it
reads the configuration; the layers it assembles (train, checkpoint, parallel, ...) never import ``config``
(docs/architecture.md).

Runs in every worker process — started by `syncwise train` through torchrun's elastic API, or by plain
``torchrun ... -m syncwise.commands.worker --config FILE`` on a multi-node cluster (``-m syncwise.train``
is the same entry point, kept as an alias for existing command lines).
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import devices, live_env
from ..checkpoint import SmartCheckpointer
from ..comm import ops
from ..config import RunConfig, config_from_argv, model_overrides
from ..errors import SyncwiseError
from ..data import SmartPrefetcher, TokenBatchLoader, evaluation_batches, load_corpus
from ..metrics.sinks import close_sinks, open_sinks
from ..models import build_model, count_params, flops_per_token, lm_loss
from ..rundir import RunDir, RunDirLock, held_by_launcher
from ..train.arguments import join_torchrun
from ..train.dynamic_batch import DynamicBatcher
from ..train.options import shared_keywords
from ..train.preemption import Preempted
from ..train.schedule import adamw, warmup_cosine
from ..train.trainer import OptimizedTrainer


def init_distributed(cfg: RunConfig) -> torch.device:
    """Join the process group torchrun describes in the environment (if any); pick this worker's device.

    Device and backend come from ``syncwise.devices`` (dist.device, dist.backend): local rank r computes on
    ``cuda:(r mod GPUs)`` or the CPU; NCCL only when every local worker has a GPU of its own, else gloo. When
    'auto' made workers share a GPU, rank 0 says so in one line."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    local_rank, local_world = devices.local_env()
    placement = devices.plan_here(cfg.dist.device, cfg.dist.backend, local_world, lab=cfg.dist.lab)
    device = placement.device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if placement.note and os.environ.get("RANK", "0") == "0":
        print(f"syncwise: {placement.note}", flush=True)
    ops.set_collective_timeout(cfg.dist.timeout_s)  # every group syncwise creates gets the job's timeout
    join_torchrun(device, cfg.dist.timeout_s, backend=placement.backend)
    return device


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Same seed on every rank: identical model init; data order differs by rank through the sampler."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _build_model(cfg: RunConfig, vocab_size: int, sharded: bool = False) -> torch.nn.Module:
    """The run's model: a syncwise preset with the run's overrides, or ``hf:FOLDER`` built by transformers (its
    config.json and, when present, its safetensors weights; models/hf_model.py). ``sharded``: FSDP2 will shard the
    whole model over every rank (:func:`_shards_whole_model`): a Hugging Face model is then built on the meta device
    and materialised per shard (build_hf_model's ``sharded``)."""
    from ..models.hf import is_hf

    if is_hf(cfg.model.preset):
        from ..config import hf_model_spec
        from ..models.hf_model import build_hf_model
        model = build_hf_model(cfg.model.preset, seq_len=cfg.data.seq_len, sharded=sharded)
        model.flops_per_token_value = hf_model_spec(model.info, cfg.data.seq_len).flops_per_token()
        return model
    return build_model(cfg.model.preset, **model_overrides(cfg, vocab_size))


def _shards_whole_model(cfg: RunConfig, parallel: Any, world: int) -> bool:
    """Whether FSDP2 shards the whole model over the ranks (dp_shard > 1; no tensor, pipeline or expert parallel,
    which place or split the model first; not a live-recovery replica group), so no rank needs it whole."""
    return (world > 1 and dist.is_initialized() and parallel.sharded and parallel.tp == 1 and parallel.pp == 1
            and parallel.ep == 1 and not cfg.ft.replicas)


def _tp_plan(model: torch.nn.Module, parallel: Any) -> Any:
    """A Hugging Face model's own tensor-parallel plan (None: syncwise's model, whose plan is built in)."""
    if parallel.tp == 1 or not hasattr(model, "hf"):
        return None
    from ..models.hf_model import hf_tp_plan
    return hf_tp_plan(model)


def _loss_fn(model: torch.nn.Module) -> Any:
    """The training loss: next-token cross-entropy, plus a Hugging Face MoE model's router load-balancing loss when
    its config enables it (models/hf_model.py: hf_loss_fn)."""
    if not hasattr(model, "hf"):
        return lm_loss
    from ..models.hf_model import hf_loss_fn
    return hf_loss_fn(model)


def model_flops_per_token(model: torch.nn.Module) -> float:
    """Training FLOPs per token for MFU: the model's own count (a Hugging Face model's) or its config's."""
    own = getattr(model, "flops_per_token", None)
    return own() if callable(own) else flops_per_token(model.config)


def resume_target(cfg: RunConfig, rank: int) -> str:
    """What to resume from: the configured value, or — after torchrun's agent restarted the group — 'auto'."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Each torchrun agent counts only its own failures: when a worker on another node dies, this node's
        # agent often sees the re-rendezvous first and restarts its workers as a "membership change", with the
        # count unchanged (0). Agree on the max so every rank resumes or none does — a mix pairs one rank's
        # checkpoint-load collectives with another's training collectives and hangs (seen in the 2-node lab).
        # A CPU tensor: an NCCL job's group is devices.NCCL_PROCESS_GROUP ('cuda:nccl,cpu:gloo', made by
        # join_torchrun), whose gloo half takes it (issue 24: on a plain 'nccl' group this failed before step 1).
        agreed = torch.tensor([restarts], dtype=torch.int64)
        ops.all_reduce(agreed, "max", stats=None)  # before any run: no run's ledger counts it
        restarts = int(agreed.item())
    if restarts > 0 and cfg.resume == "none":
        if rank == 0:
            print(f"syncwise: worker group restarted (restart {restarts}); resuming from the newest valid "
                  "checkpoint", flush=True)
        return "auto"
    return cfg.resume


def _live_recovery(cfg: RunConfig, rank: int, world: int, faults: list) -> tuple[Any, Any, list]:
    """With ``ft.replicas`` (a worker of a replica group that ``syncwise.launch.ft`` started): this group's
    LiveRecovery, its attempt's own run directory (RUN_DIR/ft/replica{R}.{attempt}) and the faults aimed at its
    workers (a fault's rank counts over every replica group: replica R's worker r is rank R × nproc + r).
    Otherwise (None, run_dir, faults)."""
    if not cfg.ft.replicas:
        return None, cfg.run_dir, faults
    from ..train.live_recovery import LiveRecovery

    live = LiveRecovery.from_env()
    if live is None:
        raise SyncwiseError("ft.replicas is set but this worker was not started by syncwise's live-recovery "
                            f"launcher ({live_env.REPLICA} is missing): use `syncwise train --ft.replicas=N`, or "
                            "syncwise.launch.ft on each replica group")
    run_dir = live.run_dir(cfg.run_dir) if cfg.run_dir else None
    first = live.replica * world
    mine = [dataclasses.replace(f, rank=f.rank - first) if f.rank is not None else f for f in faults
            if f.rank is None or first <= f.rank < first + world]
    return live, run_dir, mine


def run_worker(cfg: RunConfig) -> dict[str, Any]:
    """Train as one worker of the job; returns the run summary (on every rank).

    A user-facing failure is also printed by the worker itself, at once: torch-elastic relays it only
    through an error file, which a full disk can leave unreadable. Ctrl-C ends a worker quietly (exit 130);
    the launcher says where the run stopped and how to resume.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Ctrl-C reaches the agent and every worker; the agent stops the job and the launcher reports. A
        # KeyboardInterrupt here could land in any thread's callback and print tracebacks: leave at once.
        signal.signal(signal.SIGINT, _quiet_exit)
    try:
        return train_worker(cfg)
    except Preempted as e:  # a SystemExit: this worker ends with EXIT_PREEMPTED (83), the launcher reports it
        # Under `syncwise train` its launcher reports the stop (once); under plain torchrun rank 0 does.
        if os.environ.get("RANK", "0") == "0" and not (cfg.run_dir and held_by_launcher(cfg.run_dir)):
            print(f"syncwise: {e}; exiting with code {e.code} (resume: --resume auto)", flush=True)
        raise
    except SyncwiseError as e:
        sys.stderr.write(f"syncwise: rank {os.environ.get('RANK', 0)}: {e}\n")  # one write: ranks share the console
        sys.stderr.flush()
        raise


def _quiet_exit(signum: int, frame: Any) -> None:
    if sys.stdout.isatty():
        sys.stdout.write("\x1b[?25h\n")  # the progress bar hid the cursor
        sys.stdout.flush()
    os._exit(128 + signum)


def train_worker(cfg: RunConfig) -> dict[str, Any]:
    """The worker's work, failures raised to the caller (``syncwise train`` runs a 1-process job so)."""
    device = init_distributed(cfg)
    try:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        corpus = load_corpus(cfg.data.corpus, val_fraction=cfg.data.val_fraction, tokenizer=cfg.data.tokenizer,
                             text_column=cfg.data.text_column)
        specs = cfg.specs()  # parsed once (the layout's compressor and sync specs), typed: a Compressor or
        #                      TorchHookSpec built from the parsed compressor spec, a SyncSpec or None, Faults
        parallel = specs.layout.resolve(world)
        sharded = _shards_whole_model(cfg, parallel, world)
        model = _build_model(cfg, corpus.vocab_size, sharded).to(device)  # on the device first: fused AdamW on GPUs
        # (a model built for sharding stays on the meta device until FSDP2 shards it: fused as its device decides)
        optimizer = adamw(model, cfg.train.lr, cfg.train.weight_decay, fused=device.type == "cuda" if sharded else None)
        scheduler = warmup_cosine(optimizer, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        # Ranks of one tensor-parallel group read the same batch: the loaders shard by data-parallel coordinates.
        dp_rank, dp = parallel.dp_rank(rank), parallel.dp
        live, run_dir, faults = _live_recovery(cfg, rank, world, specs.faults)
        if live is not None:  # one data shard per rank of every configured replica group
            dp_rank, dp = live.data_shard(dp_rank, dp)
        loader = TokenBatchLoader(corpus.train, cfg.data.batch_size, cfg.data.seq_len, dp_rank, dp,
                                  seed=cfg.train.seed)
        batches = SmartPrefetcher(loader, lookahead=cfg.data.prefetch, device=device) if cfg.data.prefetch else loader
        val = evaluation_batches(corpus.val, cfg.data.batch_size, cfg.data.seq_len, cfg.train.val_batches, dp_rank,
                                 dp)
        if rank == 0:
            print(f"syncwise: {world} worker(s) ({parallel.describe}), model {cfg.model.preset} ({count_params(model) / 1e6:.2f}M params), "
                  f"corpus {corpus.name} ({corpus.train.numel():,} train tokens), compress={cfg.compress.method}"
                  + (f", sync={cfg.parallel.sync}" if cfg.parallel.sync != "every-step" else ""),
                  flush=True)
        checkpointer = None
        if cfg.run_dir:
            checkpointer = SmartCheckpointer(
                RunDir(cfg.run_dir).checkpoints, interval=cfg.ckpt.interval,  # 0: only the final checkpoint
                max_checkpoints=cfg.ckpt.keep, compression=cfg.ckpt.compression, async_save=cfg.ckpt.async_save,
                mtbf_s=cfg.ckpt.mtbf_s, layout=parallel.describe, shared=live is not None)
        trainer = OptimizedTrainer(
            model, optimizer, _loss_fn(model), compress_gradients=specs.compress, lr_scheduler=scheduler,
            device=device, val_loader=val, run_dir=run_dir, flops_per_token=model_flops_per_token(model),
            checkpointer=checkpointer, inject_faults=faults, live_recovery=live, sync=specs.sync, parallel=parallel,
            tp_plan=_tp_plan(model, parallel),
            dynamic_batch=DynamicBatcher(1, cfg.data.batch_size, memory_threshold=cfg.train.memory_threshold,
                                         device=device) if cfg.train.dynamic_batch else None,
            # the options behind both doors (grad_accum → grad_accum_steps, dist.timeout_s → collective_timeout_s,
            # ...): each section field that is a group field's syncwise.schema.Option
            **shared_keywords(cfg))
        if live is not None:  # a kill fires once per run, not once per replica-group attempt
            trainer.faults.marker_dir = Path(cfg.run_dir) / "faults" / f"replica{live.replica}"
        trainer.metric_sinks = open_sinks(cfg, rank, checkpointer)  # [metrics]: Prometheus, W&B
        try:
            # (live recovery: a replica loads a checkpoint only when no live peer has trained: LiveRecovery.join)
            summary = trainer.train(batches, steps=cfg.train.steps,
                                    resume=None if live is not None else resume_target(cfg, rank))
        finally:
            close_sinks(trainer.metric_sinks)
        summary["params"] = count_params(model)
        if hasattr(batches, "close"):
            batches.close()
        return summary
    finally:
        # Field notes: DDP processes sometimes abort at interpreter exit unless the group is destroyed first.
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m syncwise.commands.worker [--config FILE] [--section.key=value ...]``: one worker."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_from_argv(argv)
    except SyncwiseError as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return 2
    # Started by plain torchrun (not `syncwise train`, which holds the lock itself): rank 0 owns the run
    # directory for the life of the job.
    lock = None
    if cfg.run_dir and os.environ.get("RANK", "0") == "0" and not held_by_launcher(cfg.run_dir):
        try:
            lock = RunDirLock(cfg.run_dir).acquire()
        except SyncwiseError as e:
            print(f"syncwise: {e}", file=sys.stderr)
            return 2
    try:
        run_worker(cfg)  # prints its own failures
    except SyncwiseError:
        return 2
    finally:
        if lock is not None:
            lock.release()
    return 0


def exit_worker(code: int) -> None:
    """End a torchrun worker process with ``code`` without the interpreter's teardown. FIELD-NOTES: 2 of ~14 DDP
    runs aborted at interpreter exit (``terminate called without an active exception``, SIGABRT) after finishing
    their work, and one did again here after the process group was destroyed (a 2,000-step DeMo run on the lab):
    torchrun then reports the job failed although its summary and checkpoint were written. Everything the run
    keeps is closed by then (the trainer's clean-up, the metric sinks, the run directory's lock); the objects
    still alive (DDP, its process group's C++ threads) are collected here, in order, and the process leaves
    with ``os._exit`` after flushing its standard streams."""
    import gc
    import logging

    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_worker(main())
