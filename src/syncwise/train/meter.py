"""The step meter: everything one optimizer step measures, behind one object the loop calls at fixed points.

    meter.begin(step)                  # the step clock starts; the byte counters are marked
    with meter.data_wait(): ...        # the loader's time (host clock: the loader is host work)
    meter.phase = "..."                # what the step is doing, for the watchdog's hang report
    meter.backward_done(loss)          # the layout's reader of the exposed gradient sync (CUDA events on a GPU);
                                       # the logged loss's mean over ranks starts (control traffic)
    meter.waited(seconds)              # host-timed waits of a reduced-sync strategy
    pending = meter.end(...)           # a PendingStep; the loop settles it ``log_lag`` steps later

Timers are :class:`syncwise.comm.timing.Interval`. The step and data-wait intervals use the host clock on purpose:
the loader is host work, and the checkpoint cadence needs the step time as soon as the step is queued, without
waiting for the device. The exposed communication is the layout's own reader (``Parallelized.take_exposed``:
CUDA events of DDP's bucket timer on a GPU), read only when the row is settled; compute is what remains.

Bytes per parallel dimension (:class:`StepBytes`) are attributed here, in one place: which process-wide counter
feeds which dimension, and which collectives are not a step's traffic (:data:`CONTROL_STATS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..comm import ops
from ..comm.stats import STATS, CommStats
from ..comm.timing import Interval
from ..metrics.ranklog import StepProbe

# Collectives that are not a step's traffic (loss averaging, validation, router-load sums, the workers' agreement
# on a resume step) are counted here, so the per-step ``comm_bytes`` is exactly the gradient traffic.
CONTROL_STATS = CommStats()


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


class StepBytes:
    """Bytes this rank sent in one step, per parallel dimension: the one place that knows which counter feeds which
    dimension.

    * ``dp``: syncwise's own collectives (``syncwise.comm.STATS``: DDP's hook, compressors, sync strategies, a
      pipeline stage's replicas) plus FSDP2's collectives, which bypass syncwise.comm and are counted by the
      layout's dispatch counter; None when the gradient traffic is not seen at all (torch's own comm hooks);
    * ``tp``: DTensor's collectives (the layout's dispatch counter);
    * ``pp``: the activations and their gradients sent to the neighbouring stages;
    * ``ep``: the expert all-to-alls, counted where they are issued (``parallel.expert_parallel.EP_STATS``).

    Not a step's traffic, and so in none of them: :data:`CONTROL_STATS` (the loss's mean, validation, router loads),
    the gradient norm's combination across stages (``tensor_parallel.NORM_STATS``), the preemption flag. The
    counters stay process-wide because they are fed deep below the trainer (DDP's comm hook on its worker thread,
    the expert dispatch's autograd functions, ``comm.ops`` defaults); the meter reads them as marks and differences.
    """

    def __init__(self, par: Any):
        self.par = par
        self.ep_stats: Optional[CommStats] = None
        if par.spec.ep > 1:
            from ..parallel.expert_parallel import EP_STATS
            self.ep_stats = EP_STATS
        self._marks = (0, 0)

    def begin(self) -> None:
        """Mark the counters: collectives between steps (checkpoint agreement, resume) are not the step's."""
        self._marks = (STATS.total_bytes, self.ep_stats.total_bytes if self.ep_stats is not None else 0)
        self.par.begin_step()  # arms the layout's dispatch counter (FSDP2 / DTensor) for this step

    def end(self) -> dict[str, Optional[int]]:
        """The step's bytes per dimension since :meth:`begin` (None: not counted)."""
        counted = self.par.counted_bytes()
        out: dict[str, Optional[int]] = {
            "dp": STATS.total_bytes - self._marks[0] + counted.get("dp", 0) if self.par.dp.bytes_counted else None}
        out.update({dim: n for dim, n in counted.items() if dim != "dp"})
        if self.ep_stats is not None:
            out["ep"] = self.ep_stats.total_bytes - self._marks[1]
        return out


class StepMeter:
    """The timers, byte counters, per-step extras and the watchdog's phase of the train step (see the module doc)."""

    def __init__(self, model: Any, par: Any, lockstep: bool = False, batcher: Any = None):
        self.par, self.lockstep, self.batcher = par, lockstep, batcher
        self.bytes = StepBytes(par)
        self.probe = StepProbe(model, par)  # per-step extras for `syncwise doctor` (no collectives)
        self.watchdog: Any = None  # syncwise.comm.watchdog.Watchdog during a distributed train(); None otherwise
        self.step = 1  # the step in progress (or the next one between steps): what the phase is reported for
        self._phase = "start"
        self._clock = Interval()
        self._data = 0.0
        self._waited = 0.0
        self._exposed: Callable[[], float] = lambda: 0.0
        self._loss_work: Any = None

    # ---- the watchdog's phase ----------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """What the step is doing: the hang report names it (and the watchdog's heartbeat file)."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.watchdog is not None:
            self.watchdog.at(self.step, value)

    def watch(self, rank_log: Any) -> None:
        """Have this rank's log report the run's control traffic and expert all-to-alls next to its gradient sync."""
        rank_log.watch(CONTROL_STATS, self.bytes.ep_stats)

    # ---- the fixed points of a step ----------------------------------------------------------------------
    def begin(self, step: int) -> "StepMeter":
        """Start step ``step``: its clock and byte counters."""
        self.step = step
        self._clock = Interval().start()
        self._data, self._waited, self._loss_work = 0.0, 0.0, None
        self._exposed = lambda: 0.0
        self.bytes.begin()
        return self

    def data_wait(self) -> "_DataWait":
        """``with meter.data_wait(): ...`` around the wait for the step's batches (phase 'data loading')."""
        return _DataWait(self)

    def backward_done(self, loss: torch.Tensor) -> None:
        """After the step's last backward: take the layout's reader of the exposed gradient sync (read when the row
        is settled) and start the mean of the logged ``loss`` over ranks (a tiny all-reduce, control traffic, that
        runs while the optimizer steps; ranks not in lockstep (replicas that diverge) log their own: a per-step
        collective would hold them together). The optimizer step follows."""
        self._exposed = self.par.take_exposed()
        if self.lockstep:
            self._loss_work = ops.all_reduce(loss, "avg", async_op=True, stats=CONTROL_STATS)
        self.phase = "optimizer step"

    def waited(self, seconds: float) -> None:
        """Host-timed seconds a sync strategy waited on the network (counted as exposed communication)."""
        self._waited += seconds

    def end(self, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: "bool | torch.Tensor", batches: list,
            lr: float) -> PendingStep:
        """Close the step (its loader ``batches``, the ``lr`` its update used): its bytes, the loss's mean, the
        clock; the numbers the loop settles later."""
        comm_bytes = self.bytes.end()
        if self._loss_work is not None:
            self._loss_work.wait()
        self.step += 1  # phases set between steps belong to the next one
        return PendingStep(step=self.step - 1, loss=loss, grad_norm=grad_norm, skipped=skipped,
                           step_time_s=self._clock.stop().seconds(), data_wait_s=self._data,
                           comm_waited_s=self._waited, exposed_comm=self._exposed, comm_bytes=comm_bytes,
                           tokens=tokens_of(batches) * self.par.dp_size, lr=lr,
                           micro_batch=self.batcher.size if self.batcher is not None else None,
                           parallel_metrics={**self.par.step_metrics(), **self.probe.take()})


class _DataWait:
    """The data-wait timer's context (a plain class: the step pays no generator for it)."""

    __slots__ = ("meter", "interval")

    def __init__(self, meter: StepMeter):
        self.meter, self.interval = meter, Interval()

    def __enter__(self) -> None:
        self.meter.phase = "data loading"
        self.interval.start()

    def __exit__(self, *exc: object) -> None:
        self.meter._data += self.interval.stop().seconds()


def tokens_of(batches: list) -> int:
    """Tokens in a step's loader batches (integer token ids: every element; float inputs: one per row)."""
    return sum(x.numel() if not x.is_floating_point() else x.size(0) for x, _ in batches)

