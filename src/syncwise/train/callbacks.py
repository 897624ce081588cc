"""Step callbacks: the optional collaborators of ``OptimizedTrainer.train()`` (docs/trainer.md).

The loop calls every callback of its list at fixed points, in list order; a feature that is off is not in the
list, so the loop holds no branch for it (Lightning's callbacks, torchtitan's optional components). A callback
overrides the hooks it needs; each is a no-op here:

=================================  ===================================================================================
``on_train_start(trainer)``        after the resume, before the first step (inside the loop's ``try``: ``close`` runs)
``on_step_start(trainer, step)``   before the batch of step ``step`` (``trainer.step + 1``); may move ``trainer.step``
                                   (live recovery: a replica behind heals from a live peer)
``before_backward(trainer, step)`` before each backward of the step (its batch drawn, its forward run): the last
                                   moment the gradient sync's state is still the step's start (live recovery)
``commits(trainer, pending)``      after the step's update: False, and the step does not count; it is redone with
                                   the next batch (live recovery: the update did not commit on every replica, and
                                   its sync strategy applied none; what an update did stays). The first False ends
                                   the asking
``on_step_end(trainer, pending)``  after the step counted (``trainer.step`` is its number); may ask for the rows now
                                   (``trainer.flush_rows()``: validation, a checkpoint) or stop the run after this
                                   step (``trainer.should_stop = True``: a preemption)
``on_row(trainer, row)``           a metrics row (``pending`` settled, ``log_lag`` steps late) before it is logged:
                                   add columns
``on_train_end(trainer)``          the loop ended without an error, every row logged (the final checkpoint)
``close(trainer)``                 always, in reverse list order (what ``on_train_start`` took, given back)
``summary(trainer)``               keys for the run's summary
=================================  ===================================================================================

The trainer's own (built by ``OptimizedTrainer._step_callbacks`` when their feature is on) are below; live recovery's
(``LiveQuorum``) sits with the rest of live recovery; a user's go in ``trainer.callbacks`` (called after them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from ..comm.watchdog import Watchdog
from ..rundir import RunDir

if TYPE_CHECKING:
    from ..checkpoint import SmartCheckpointer, TrainState
    from ..comm.arrivals import ArrivalLog
    from ..metrics import MetricsLogger
    from .dynamic_batch import DynamicBatcher
    from .faults import FaultPlan
    from .meter import PendingStep
    from .preemption import PreemptionGuard
    from .profile import StepProfiler

# the trainer that calls the hooks (syncwise.train.trainer.OptimizedTrainer; not imported: it imports this module)
Trainer = Any


class StepCallback:
    """A collaborator of the training loop (see the module doc); every hook does nothing unless overridden."""

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        pass

    def before_backward(self, trainer: Trainer, step: int) -> None:
        pass

    def commits(self, trainer: Trainer, pending: "PendingStep") -> bool:
        return True

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        pass

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        pass

    def close(self, trainer: Trainer) -> None:
        pass

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        return {}


class InjectedKills(StepCallback):
    """``kill`` and ``hang`` faults (train/faults.py): the process exits abruptly, or stops for good, before the step
    its fault names."""

    def __init__(self, faults: "FaultPlan"):
        self.faults = faults

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.faults.maybe_kill(step, trainer.rank)


class Arrivals(StepCallback):
    """When this rank arrived at each collective of each step (torch's flight recorder, read every few seconds):
    ``syncwise doctor``'s straggler attribution by arrival order (syncwise.comm.arrivals)."""

    def __init__(self, log: "ArrivalLog"):
        self.log = log

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.log.begin()

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        self.log.end(trainer.step)

    def close(self, trainer: Trainer) -> None:
        self.log.finish()


class Profiling(StepCallback):
    """torch profiler traces of the steps ``profile_steps`` / ``profile_every`` chose (train/profile.py)."""

    def __init__(self, profiler: "StepProfiler"):
        self.profiler = profiler

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        self.profiler.step_done(trainer.step)

    def close(self, trainer: Trainer) -> None:
        self.profiler.close()


class BatchChanges(StepCallback):
    """The DynamicBatcher's micro-batch changes of each step, as notes in the log."""

    def __init__(self, batcher: "DynamicBatcher", logger: "MetricsLogger"):
        self.batcher, self.logger = batcher, logger
        self.seen = len(batcher.history)  # (the first probe's size is noted where it is found)

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        for change in self.batcher.history[self.seen:]:
            self.logger.note(f"dynamic batch: step {change.step}: micro-batch {change.old} → {change.new} "
                             f"({change.reason})")
        self.seen = len(self.batcher.history)


class Validation(StepCallback):
    """``evaluate()`` every ``val_interval`` steps and at the last step; the loss goes into that step's row
    (``val_loss``) and the summary (``final_val_loss``: ``trainer.val_loss``)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.due: Optional[int] = None

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        step = trainer.step
        if step == trainer.total_steps or (self.interval and step % self.interval == 0):
            self.due = step
            trainer.flush_rows()  # this step's row now, with its val_loss

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        if row["step"] == self.due:
            trainer.phase = "validation"
            trainer.val_loss = row["val_loss"] = trainer.evaluate()


class Preemption(StepCallback):
    """SIGTERM / SIGUSR1 on any rank: every rank stops after the same step, saves and raises ``Preempted``
    (train/preemption.py). Always in the list: its install clears an earlier attempt's ``preempted.json``."""

    def __init__(self, guard: "PreemptionGuard"):
        self.guard = guard

    def on_train_start(self, trainer: Trainer) -> None:
        checkpoints = trainer.checkpointer.directory if trainer.checkpointer else None
        self.guard.install(trainer.run_dir or checkpoints, checkpoints)

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        # (the run's last step is no stop: it ends anyway, with its final save)
        if trainer.step < trainer.total_steps and self.guard.stop_after(trainer.step):
            trainer.should_stop = True  # the loop's final save is the stop's save

    def close(self, trainer: Trainer) -> None:
        self.guard.uninstall()

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        if self.guard.stopping_step is None:
            return {}
        return {"preempted": self.guard.record(trainer.checkpointer)}  # rank 0 writes RUN_DIR/preempted.json


class CheckpointCadence(StepCallback):
    """Checkpoints at the checkpointer's cadence (``should_save``, asked on every rank after every step but a stop
    or the last), the final one at the end; each row says whether an async save was in flight during its step
    (``ckpt_in_flight``: the benchmarks compare such steps with the others). ``writes()``: whether this rank's
    replica writes them (live recovery: only the replica of participating rank 0)."""

    def __init__(self, checkpointer: "SmartCheckpointer", state: "TrainState", writes: Callable[[], bool]):
        self.checkpointer, self.state, self.writes = checkpointer, state, writes
        self.in_flight: dict[int, bool] = {}  # per step, until its row is logged
        self._starting = False

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self._starting = self.checkpointer.save_in_flight

    def on_step_end(self, trainer: Trainer, pending: "PendingStep") -> None:
        step = trainer.step
        self.in_flight[step] = self._starting
        if trainer.should_stop or step >= trainer.total_steps or not self.writes() or \
                not self.checkpointer.should_save(step, pending.step_time_s):
            return
        trainer.flush_rows()  # metrics.jsonl holds the saved step's row (a resume counts the steps it redoes)
        trainer._settle_skip()  # (the skipped steps and the LR schedule as of this step)
        trainer.phase = "checkpoint save"
        self.checkpointer.save(step, self.state)

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        row["ckpt_in_flight"] = self.in_flight.pop(row["step"], False)

    def on_train_end(self, trainer: Trainer) -> None:
        """The run's last checkpoint (unless the newest one is of this step), then the checkpointer's close."""
        if self.writes():
            trainer.phase = "final checkpoint save"
            last = self.checkpointer.last_save
            if last is None or last.step != trainer.step:
                self.checkpointer.save(trainer.step, self.state)
        self.checkpointer.close()

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        # this rank's save costs (rank 0's total_s runs until the checkpoint is published)
        return {"checkpoint_saves": [{"step": s.step, "blocking_s": s.blocking_s, "total_s": s.total_s,
                                      "bytes": s.bytes} for s in self.checkpointer.history]}


class HangWatchdog(StepCallback):
    """A distributed run with a collective timeout: the watchdog thread writes heartbeats (the step and its phase)
    and names the hang when a collective does not return (syncwise.comm.watchdog); ``trainer.watchdog`` meanwhile."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def on_train_start(self, trainer: Trainer) -> None:
        run = RunDir(trainer.run_dir) if trainer.run_dir else None
        trainer.watchdog = Watchdog(self.timeout_s, trainer.rank, trainer.world_size, run.heartbeats if run else None,
                                    flight_dump=run.flight_dump(trainer.rank) if run else None)

    def close(self, trainer: Trainer) -> None:
        watchdog, trainer.watchdog = trainer.watchdog, None
        if watchdog is not None:
            watchdog.close()
