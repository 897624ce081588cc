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

Bytes and seconds per parallel dimension (:class:`StepBytes`) are attributed here, in one place: which counter and
which clock feed which dimension (``dp``, ``fsdp``, ``tp``, ``pp``, ``ep``), and which collectives are not a step's
traffic (the run's ``ledger.control``). Per dimension a step has its bytes, its seconds (issue to completion of its
collectives) and its exposed seconds (the part the step waited for); ``comm_exposed_s`` is the exposed time of
``dp``, ``fsdp`` and ``tp``, which ``compute_s`` excludes. The expert all-to-alls' and the pipeline's waits stay in
``compute_s`` as before (``ep_comm_s`` and ``pp_bubble`` are how doctor takes them apart) and are reported by
their own ``comm_exposed_s_ep`` / ``comm_exposed_s_pp``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..comm import ops
from ..comm import hostread
from ..comm.hostread import HostCopy
from ..comm.stats import UNKNOWN_HOP, CommLedger, CommStats
from ..comm.timing import Interval, on_cuda
from ..metrics.ranklog import StepProbe
from .batches import tokens as batch_tokens

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
    comm_s_by_dim: Optional[dict] = None  # seconds in each dimension's collectives (issue to completion; None: untimed)
    comm_exposed_by_dim: Optional[dict] = None  # the part of them the step waited for (None: not measured)
    #: the same bytes per hop: {'intra', 'cross', 'unsplit' (no hop known)} summing to comm_bytes_total; None: the
    #: step's bytes are not all counted (see StepBytes)
    comm_bytes_by_hop: Optional[dict] = None
    #: cross-node bytes per parallel dimension, for the dimensions whose bytes all have a known hop
    comm_cross_by_dim: Optional[dict] = None

    @property
    def comm_bytes_total(self) -> Optional[int]:
        """Bytes this rank sent in the step over every dimension (None when a dimension's are not counted)."""
        by = self.comm_bytes_by_dim
        if not by:
            return self.comm_bytes
        return None if any(v is None for v in by.values()) else sum(by.values())


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
    comm_times: Callable[[], dict]  # reads the step's seconds per dimension: {dim: (seconds, exposed or None)}
    comm_bytes: dict  # per parallel dimension: bytes this rank sent (None where not counted)
    tokens: int
    lr: float  # the learning rate this step's update used
    micro_batch: Optional[int] = None  # DynamicBatcher's micro size after this step
    comm_hops: Optional[dict] = None  # the step's bytes per hop (StepBytes.hops)
    comm_cross: Optional[dict] = None  # cross-node bytes per dimension (StepBytes.cross_by_dim)
    parallel_metrics: dict = field(default_factory=dict)  # what the layout measured (the pipeline's bubble)
    #: the step's device values (loss, norm, skip flag, 0-d tensors among parallel_metrics) copied to pinned memory
    #: behind one event at the step's end (issue 39 N2): settling reads them without draining the queue
    host: Optional[HostCopy] = None
    _settled: Optional[StepResult] = None

    def capture(self) -> "PendingStep":
        """Start the copies of the step's device values to the host (one event); ``settle`` reads them."""
        values = {"loss": self.loss, "grad_norm": self.grad_norm, "skipped": self.skipped}
        values.update({"pm:" + k: v for k, v in self.parallel_metrics.items() if torch.is_tensor(v) and v.numel() == 1})
        self.host = HostCopy(values)
        return self

    def settle(self) -> StepResult:
        with hostread.step_region():  # strict: the row's values come from the reader, never a direct read
            return self._settle()

    def _settle(self) -> StepResult:
        if self._settled is None:
            if self.host is None:
                self.capture()
            values = self.host.read()
            for k, v in values.items():
                if k.startswith("pm:"):
                    self.parallel_metrics[k[3:]] = v
            times = self.comm_times()
            dp_time, dp_exposed = times.get("dp", (0.0, None))
            # the compression hook's clock (host buckets): what its sync took beyond its collectives (codec, queue)
            # joins the dp total, and its exposed part replaces the bucket timer's, so exposed <= total (issue 43)
            synced = self.parallel_metrics.pop("grad_sync", None)
            if not times.pop("dp_unmeasured", False):
                exposed = self.exposed_comm() if synced is None else synced[1]
                if synced is not None and dp_time is not None:
                    dp_time += synced[0]
                times["dp"] = (dp_time, self.comm_waited_s + exposed + (dp_exposed or 0.0))
            comm = sum(times[d][1] or 0.0 for d in ("dp", "fsdp", "tp") if d in times)
            dims = [d for d in self.comm_bytes if d in times or self.comm_bytes[d] is not None]
            self._settled = StepResult(
                loss=float(values["loss"]), step_time_s=self.step_time_s,
                compute_s=max(0.0, self.step_time_s - self.data_wait_s - comm), comm_exposed_s=comm,
                data_wait_s=self.data_wait_s, comm_bytes=self.comm_bytes.get("dp"), tokens=self.tokens,
                comm_bytes_by_dim=self.comm_bytes,
                comm_s_by_dim={d: times.get(d, (0.0, 0.0))[0] for d in dims},
                comm_exposed_by_dim={d: times.get(d, (0.0, 0.0))[1] for d in dims}, comm_bytes_by_hop=self.comm_hops,
                comm_cross_by_dim=self.comm_cross,
                grad_norm=float(values["grad_norm"]), skipped=bool(values["skipped"]))
        return self._settled


class StepBytes:
    """Bytes this rank sent in one step, per parallel dimension: the one place that knows which counter feeds which
    dimension.

    * ``dp``: syncwise's own collectives (the run's ``ledger.dp``: DDP's hook, compressors, sync strategies, a
      pipeline stage's replicas) plus FSDP2's over the replicas (HSDP's all-reduce: the layout's dispatch counter;
      FSDP2 sharded over replicas: its timed comms); None when the gradient traffic is not seen at all (torch's
      own comm hooks). Seconds: ``ledger.dp``'s clock; exposed: DDP's bucket timer (or the stage sync's), the sync
      strategy's host-timed waits, FSDP2's blocking calls;
    * ``fsdp``: FSDP2's all-gathers and reduce-scatters inside a replica group (``dp_shard``): counted and timed
      by its custom comms (``parallel.fsdp.attach_timing``);
    * ``tp``: DTensor's collectives (the layout's dispatch counter, which also times them);
    * ``pp``: the activations and their gradients sent to the neighbouring stages; seconds: the step's time its
      stages did not compute (transfers and bubble);
    * ``ep``: the expert all-to-alls, counted and timed where they are issued (``ledger.ep``; synchronous on the
      CPU: exposed = their time; on a GPU exposed is not measured).

    Not a step's traffic, and so in none of them: ``ledger.control`` (the loss's mean, validation, router loads),
    ``ledger.norm`` (the gradient norm's combination across stages), ``ledger.signals`` (the preemption flag). The
    counters are the run's own (``par.ledger``, made by ``parallelize`` and fed deep below the trainer: DDP's comm
    hook on its worker thread, the expert dispatch's autograd functions); the meter reads them as marks and
    differences, so collectives between steps are not a step's.

    Per hop (:attr:`hops`, after :meth:`end`): the same bytes split by the link they crossed — ``intra`` and
    ``cross`` — and ``unsplit`` for bytes with no known hop (a pipeline's sends; no topology known). Every collective
    is split by its pattern over its group, by one rule (``comm.ops.split_bytes`` / ``cross_share``: a ring's N_g / W
    of the bytes cross, an all-to-all's chunks for other nodes): the ledgers' (syncwise's own collectives, DDP's
    built-in all-reduce) as they were recorded, FSDP2's all-gathers and reduce-scatters and the dispatch counter's
    collectives (HSDP's all-reduce, DTensor's) by ``Parallelized.counted_hops``. None when some dimension's bytes are
    not counted at all.
    """

    def __init__(self, par: Any):
        self.par = par
        self.ledger: CommLedger = par.ledger
        self.dp_stats: CommStats = self.ledger.dp
        self.ep_stats: Optional[CommStats] = self.ledger.ep if par.spec.ep > 1 else None
        self._marks = (0, 0)
        self._time_marks = (0.0, 0.0)
        self._hop_marks: dict[str, dict[str, int]] = {}
        self.hops: Optional[dict[str, int]] = None
        self.cross_by_dim: Optional[dict[str, int]] = None  # cross-node bytes of each dimension whose bytes all have a hop
        params = next(iter(par.model.parameters()), None) if hasattr(par, "model") else None
        self.cuda = params is not None and on_cuda(params.device)

    def begin(self) -> None:
        """Mark the counters: collectives between steps (checkpoint agreement, resume) are not the step's."""
        dp = self.dp_stats
        self._marks = (dp.total_bytes, self.ep_stats.total_bytes if self.ep_stats is not None else 0)
        self._time_marks = (dp.total_time_s, self.ep_stats.total_time_s if self.ep_stats is not None else 0.0)
        self._hop_marks = self._hops_now()
        self.par.begin_step()  # arms the layout's dispatch counter (FSDP2 / DTensor) for this step

    def end(self) -> dict[str, Optional[int]]:
        """The step's bytes per dimension since :meth:`begin` (None: not counted)."""
        counted = self.par.counted_bytes()
        out: dict[str, Optional[int]] = {
            "dp": self.dp_stats.total_bytes - self._marks[0] + counted.get("dp", 0) if self.par.dp.bytes_counted
            else None}
        out.update({dim: n for dim, n in counted.items() if dim != "dp"})
        if self.ep_stats is not None:
            out["ep"] = self.ep_stats.total_bytes - self._marks[1]
        self.hops, self.cross_by_dim = None, None
        counted_all = None not in out.values()
        if counted_all and not any(out.values()) and not getattr(self.par, "counted_hops", None):
            self.hops, self.cross_by_dim = {"intra": 0, "cross": 0, "unsplit": 0}, {}  # (what the split below gives)
        elif counted_all:
            now = self._hops_now()
            # per dimension: the ledgers' (dp, ep) since begin, plus the layout's counters split by their pattern
            by_dim = {d: {h: now[d].get(h, 0) - self._hop_marks.get(d, {}).get(h, 0)
                          for h in ("intra", "cross", UNKNOWN_HOP)} for d in now}
            for d, split in (getattr(self.par, "counted_hops", None) or {}).items():
                mine = by_dim.setdefault(d, {"intra": 0, "cross": 0, UNKNOWN_HOP: 0})
                for h in ("intra", "cross"):
                    mine[h] += split.get(h, 0)
            hops = {h: sum(v[h] for v in by_dim.values()) for h in ("intra", "cross")}
            hops["unsplit"] = sum(v[UNKNOWN_HOP] for v in by_dim.values()) + sum(
                n for dim, n in counted.items() if n) - sum(
                v["intra"] + v["cross"] for d, v in (getattr(self.par, "counted_hops", None) or {}).items())
            self.hops = hops
            # a dimension's cross-node bytes where all of its bytes have a hop
            self.cross_by_dim = {d: by_dim[d]["cross"] for d, n in out.items()
                                 if n and d in by_dim and by_dim[d]["intra"] + by_dim[d]["cross"] == n}
        return out

    def _hops_now(self) -> dict[str, dict[str, int]]:
        """The ledgers' bytes per hop so far, per dimension (dp and, with expert parallelism, ep)."""
        out = {"dp": self.dp_stats.hop_bytes()}
        if self.ep_stats is not None:
            out["ep"] = self.ep_stats.hop_bytes()
        return out

    def times(self) -> Callable[[], dict]:
        """A reader of the step's seconds per dimension since :meth:`begin`: ``{dim: (seconds, exposed seconds or
        None)}``; the layout's clocks (FSDP2, DTensor, the pipeline) plus ``ledger.dp``'s ('dp', its exposed part comes
        from the layout's DDP timer: see ``PendingStep.settle``) and the expert all-to-alls'. Read when the row is
        settled: CUDA events then have long completed."""
        layout = self.par.take_times()
        # the run's clocks are read now, at the step's end (later they would hold the next step's)
        dp_s = self.dp_stats.total_time_s - self._time_marks[0]
        ep_s = self.ep_stats.total_time_s - self._time_marks[1] if self.ep_stats is not None else None
        cuda, untimed = self.cuda, not self.par.dp.sync_timed  # DDP's built-in all-reduce, torch's hooks
        unmeasured = not self.par.replicas_timed  # HSDP's all-reduce: neither its time nor its exposed part

        def read() -> dict:
            out = layout()
            dp = out.get("dp", (0.0, None))
            out["dp"] = (None, None) if unmeasured else (None if untimed else dp[0] + dp_s, dp[1])
            if unmeasured:
                out["dp_unmeasured"] = True
            if ep_s is not None:  # synchronous all-to-alls on the CPU: the step waits for all of it
                out["ep"] = (ep_s, None if cuda else ep_s)
            return out
        return read


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
        rank_log.watch(self.par.ledger.dp, self.par.ledger.control, self.bytes.ep_stats)

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
            self._loss_work = ops.all_reduce(loss, "avg", async_op=True, stats=self.par.ledger.control)
        self.phase = "optimizer step"

    def waited(self, seconds: float) -> None:
        """Host-timed seconds a sync strategy waited on the network (counted as exposed communication)."""
        self._waited += seconds

    def end(self, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: "bool | torch.Tensor", batches: list,
            lr: float) -> PendingStep:
        """Close the step (its loader ``batches``, the ``lr`` its update used): its bytes, the loss's mean, the
        clock; the numbers the loop settles later."""
        comm_bytes = self.bytes.end()
        comm_times = self.bytes.times()
        if self._loss_work is not None:
            self._loss_work.wait()
        self.step += 1  # phases set between steps belong to the next one
        return PendingStep(step=self.step - 1, loss=loss, grad_norm=grad_norm, skipped=skipped,
                           step_time_s=self._clock.stop().seconds(), data_wait_s=self._data,
                           comm_waited_s=self._waited, exposed_comm=self._exposed, comm_times=comm_times,
                           comm_bytes=comm_bytes, comm_hops=self.bytes.hops, comm_cross=self.bytes.cross_by_dim,
                           tokens=tokens_of(batches) * self.par.dp_size, lr=lr,
                           micro_batch=self.batcher.size if self.batcher is not None else None,
                           parallel_metrics={**self.par.step_metrics(), **self.probe.take()}).capture()


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
    """Tokens in a step's loader batches, ``(inputs, targets)`` pairs (a mapping batch: its dict and KWARGS):
    integer token ids count every element (a mapping's ``input_ids``), float inputs one per row."""
    return sum(batch_tokens(x) for x, _ in batches)



def hop_fields(r: StepResult) -> dict[str, int]:
    """A metrics row's bytes per hop: ``hop_bytes_intra``, ``hop_bytes_cross`` and, where some bytes have no known
    hop, ``hop_bytes_unsplit`` (together: ``comm_bytes``); nothing when the step's bytes are not all counted."""
    hops = r.comm_bytes_by_hop
    if not hops:
        return {}
    out = {f"hop_bytes_{h}": n for h, n in hops.items() if h != "unsplit" or n}
    out.update({f"hop_bytes_cross_{d}": n for d, n in (r.comm_cross_by_dim or {}).items()})  # per dimension
    return out


def job_nodes(world_size: int) -> Optional[int]:
    """The job's node count from its topology (``comm.ops.procs_per_node``); None when it is not known."""
    if world_size <= 1:
        return 1
    per = ops.procs_per_node()
    return world_size // per if per and world_size % per == 0 else None


def per_hop(steady: list, nodes: Optional[int]) -> dict[str, Any]:
    """Summary keys per hop over the steady steps (rank 0's bytes per step): ``hop_bytes_per_step_cross`` — what the
    slow link between nodes carries, the figure ``× fewer bytes`` is formed on — and ``hop_bytes_per_step_intra``
    (``_unsplit`` for bytes no hop was known for), plus ``comm_hops``, the topology in words. One node (or an unknown
    topology) says so instead of a split: every byte stays inside the node."""
    rows = [r.comm_bytes_by_hop for r in steady]
    if nodes is None:
        return {"comm_hops": "topology unknown: bytes not split by hop"} if steady else {}
    if nodes == 1:
        return {"comm_hops": "one node: every byte stays inside it (no cross-node hop)"}
    if not rows or any(h is None for h in rows):
        return {"comm_hops": f"{nodes} nodes: bytes per hop not counted"}
    n = len(rows)
    out: dict[str, Any] = {"comm_hops": f"{nodes} nodes: cross-node bytes = what the link between nodes carries"}
    for h in ("cross", "intra", "unsplit"):
        total = sum(r.get(h, 0) for r in rows)
        if h != "unsplit" or total:
            out[f"hop_bytes_per_step_{h}"] = total / n
    # per dimension, over the steady steps that split it (hop_bytes_per_step_cross_fsdp ...)
    dims = sorted({d for r in steady for d in (r.comm_cross_by_dim or {})})
    for d in dims:
        vals = [r.comm_cross_by_dim[d] for r in steady if r.comm_cross_by_dim and d in r.comm_cross_by_dim]
        out[f"hop_bytes_per_step_cross_{d}"] = sum(vals) / len(vals)
    return out


def row_hops(row: dict) -> Optional[dict[str, int]]:
    """A metrics row's bytes per hop back (the inverse of :func:`hop_fields`); None when it has none."""
    if "hop_bytes_cross" not in row:
        return None
    return {h: row.get(f"hop_bytes_{h}", 0) for h in ("intra", "cross", "unsplit")}


def row_cross(row: dict) -> Optional[dict[str, int]]:
    """A metrics row's cross-node bytes per dimension back (``hop_bytes_cross_<dim>``); None when it has none."""
    out = {k[len("hop_bytes_cross_"):]: v for k, v in row.items() if k.startswith("hop_bytes_cross_")}
    return out or None
