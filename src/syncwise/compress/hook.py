"""DDP comm-hook adapter: run any compressor bucket by bucket, overlapped with backward.

Why a worker thread: several compressors need more than one collective per bucket, and the second
depends on the first (PowerSGD's Q after P; the all-gather after compression). torch's PowerSGD
hook issues those from future callbacks on comm threads, so with many buckets different ranks can
issue them in different orders and gloo aborts ("Received data size doesn't match"). Here each hook
state owns ONE FIFO worker thread: the hook (called by DDP in bucket order on every rank) only
enqueues the bucket and returns a future; the worker runs the compressor bucket after bucket, so
every collective is issued in the same order on every rank. By default the worker talks on a
dedicated communicator (a ``new_group`` over the same ranks), so it can never interleave with
collectives DDP itself issues on the main thread (e.g. the unused-parameter bitmap all-reduce of
``find_unused_parameters=True``).

No host sync on the thread DDP calls the hook on (the backward's: the caller's on CPU, autograd's device
thread on CUDA), nor in the collectives' callbacks (which may run inline on it): a non-finite bucket is
decided on the device (see :mod:`.base`), so the backward keeps queueing kernels. Host waits that remain
are off that thread: gloo's own wait for a CUDA tensor's bytes (inherent to gloo: the reduction runs on
the host; NCCL has none), and, in the worker, the read of an earlier step's verdict before a counter-
seeded draw (int8, random-k, PowerSGD's warm-up), which waits for that step's event only.
"""
# no `from __future__ import annotations`: DDP checks the hook's annotations as real objects
import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError, SyncwiseError
from ..comm import hostread, ops, streams
from .base import Compressor, GatherCompressor, split_by_policy
from ..layout import MIN_NUMEL
from ..profiling import COMPRESS_LABEL


def traced() -> "contextlib.AbstractContextManager[Any]":
    """The compressor's work under ``profiling.COMPRESS_LABEL`` while a profiler records (doctor reads it as
    compression), else nothing (``ops.labelled``)."""
    return ops.labelled(COMPRESS_LABEL)


@dataclass
class CompressionPolicy:
    """Which tensors are worth compressing; the rest are sent as fp32 (as raw bytes in the all-gather
    compressors' single payload, or folded into the compressor's own fp32 all-reduce).

    Cast compressors (none/fp16/bf16) ignore the policy: they treat every tensor alike.
    """

    min_numel: int = MIN_NUMEL
    min_ndim: int = 2

    def __post_init__(self) -> None:
        if self.min_numel < 0:
            raise ConfigError("compress.min_numel", self.min_numel, "an integer >= 0")
        if self.min_ndim < 0:
            raise ConfigError("compress.min_ndim", self.min_ndim, "an integer >= 0")

    def compress(self, t: torch.Tensor) -> bool:
        """True if ``t`` should be compressed."""
        return t.numel() >= self.min_numel and t.dim() >= self.min_ndim


_STOP = object()


class CompressionHookState:
    """State for :func:`compression_hook`: the compressor, its group, parameter names and policy.

    Construct it on every rank at the same point (it may create a communicator, a collective call).
    ``param_names`` maps parameters to stable names (or pass the module: its ``named_parameters``
    are used); without it, parameters are named ``p0, p1, ...`` in the order the first backward
    delivers them, which is stable across restarts of the same model and DDP settings.
    """

    def __init__(self, compressor: Compressor, process_group: Any = None,
                 param_names: Union[dict[nn.Parameter, str], nn.Module, None] = None,
                 policy: Optional[CompressionPolicy] = None, dedicated_group: bool = True):
        self.compressor = compressor
        self.policy = policy if policy is not None else CompressionPolicy()
        self.process_group = process_group
        if dedicated_group and dist.is_initialized():
            ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                     else list(range(dist.get_world_size())))
            # the training group's backend, and its GPU run's for the strict check (ops.new_group's like)
            self.comm_group = ops.new_group(ranks=ranks, like=process_group if process_group is not None
                                            else dist.group.WORLD, desc="compress")
        else:
            self.comm_group = process_group
        if isinstance(param_names, nn.Module):
            param_names = {p: n for n, p in param_names.named_parameters()}
        self._names: dict[int, str] = {id(p): n for p, n in (param_names or {}).items()}
        self._keep_alive = list((param_names or {}).keys())  # ids stay valid while we hold the params
        self.steps = 0  # backward passes completed (last bucket processed)
        # Host seconds spent compressing/decompressing (the compressor's work minus the collectives it waited on):
        # read per step by syncwise.metrics.StepProbe for `syncwise doctor`. On CUDA this is launch time only.
        self.compute_s = 0.0
        # Inline (issue 24, the "check" row on expert parallel): with ep > 1 the backward also issues the experts'
        # all-to-alls, on the autograd thread and the ep communicator. A worker thread would interleave its
        # collectives (another communicator) with them in an order that depends on timing, so differently on
        # different ranks — NCCL can deadlock on communicators launched in different orders. Inline, every
        # collective of the backward is issued from one thread in autograd's order, the same on every rank
        # (multi-collective compressors then do not overlap the backward on the CPU; on CUDA they still run on
        # the side stream). Set by parallelize (apply_data_parallel(inline_compress=True)) when ep > 1.
        self.inline = False
        # One-collective compressors (casts, fp8) skip the worker from the hook (_direct_*); a state whose bucket
        # average is more than the compressor's collective (the hierarchical sync) turns that off.
        self.direct = True
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        # The gradient sync's own clock (issue 43 row 3), host buckets only: each bucket's interval from DDP's
        # hand-off to the hook to its average written (codec, collectives, the wait in the worker's queue). Per
        # syncing backward: the union of those intervals beyond the collectives' own seconds, and the part after
        # the last bucket's hand-off (what the backward waited for). ``take_sync`` hands them to the step meter.
        self._window: Optional[dict] = None
        self._synced: list[tuple[float, float]] = []

    # ---- the sync's clock (host buckets) -----------------------------------------------------------------
    def _handed(self, buffer: torch.Tensor, is_last: bool) -> Optional[float]:
        """A bucket reaches the hook: open the step's window on its first; the hand-off time (None on a device:
        there the step meter's CUDA events time the sync)."""
        if buffer.device.type != "cpu":
            return None
        now = time.perf_counter()
        with self._lock:
            if self._window is None:
                self._window = {"comm_mark": self.compressor.stats.total_time_s, "intervals": [], "open": 0,
                                "last": None}
            self._window["open"] += 1
            if is_last:
                self._window["last"] = now
        return now

    def _finished(self, handed: Optional[float]) -> None:
        """A bucket's average is written: close the step's window once its last bucket is done."""
        if handed is None:
            return
        now = time.perf_counter()
        with self._lock:
            w = self._window
            if w is None:
                return
            w["intervals"].append((handed, now))
            w["open"] -= 1
            if w["open"] or w["last"] is None:
                return
            self._window = None
            span, end = 0.0, float("-inf")
            for a, b in sorted(w["intervals"]):
                span += max(0.0, b - max(a, end))
                end = max(end, b)
            collectives = self.compressor.stats.total_time_s - w["comm_mark"]
            self._synced.append((max(0.0, span - collectives), max(0.0, end - w["last"])))

    def take_sync(self) -> Optional[tuple[float, float]]:
        """The syncing backwards closed since the last call: (seconds the sync took beyond its collectives' own,
        seconds from the last bucket's hand-off to the last average written), or None when none was timed."""
        with self._lock:
            done, self._synced = self._synced, []
        if not done:
            return None
        return sum(d[0] for d in done), sum(d[1] for d in done)

    # ---- naming ------------------------------------------------------------------------------
    def name_of(self, p: torch.Tensor) -> str:
        """The stable key of parameter ``p`` (assigned on first sight if no names were given)."""
        key = self._names.get(id(p))
        if key is None:
            key = self._names[id(p)] = f"p{len(self._names)}"
            self._keep_alive.append(p)
        return key

    def average(self, tensors: list[torch.Tensor], keys: list[str], group: Any = None, *,
                blocking: bool = False) -> None:
        """Average ``tensors`` (named ``keys``) in place over ``group`` (default: this state's communicator) with
        the compressor, each compressed or sent as fp32 by the policy — synchronously, on the calling thread.
        ``blocking``: the caller's step waits for it (FSDP2's all-reduce hook, inside the backward on the CPU): on
        host tensors its time joins the sync's clock (:meth:`take_sync`) as exposed, and what it took beyond its
        collectives as the sync's own."""
        timed = blocking and bool(tensors) and tensors[0].device.type == "cpu"
        if timed:
            t0, mark = time.perf_counter(), self.compressor.stats.total_time_s
        self.compressor.average(tensors, keys, self.comm_group if group is None else group,
                                [self.policy.compress(t) for t in tensors])
        if timed:
            took = time.perf_counter() - t0
            with self._lock:
                self._synced.append((max(0.0, took - (self.compressor.stats.total_time_s - mark)), took))

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Compressor state plus the step counter."""
        self.wait_idle()
        return {"compressor": self.compressor.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.wait_idle()
        if state.get("hierarchical") is not None and type(self) is CompressionHookState:
            h = state["hierarchical"]
            raise SyncwiseError(f"the compressor state was saved by the hierarchical gradient sync on {h['nodes']} "
                                f"nodes × {h['procs_per_node']} ranks (each rank kept only its own tensors' state); "
                                "this job runs the flat one: resume with the same topology and --dist.hierarchical")
        self.compressor.load_state_dict(state["compressor"])
        self.steps = int(state.get("steps", 0))

    # ---- worker ------------------------------------------------------------------------------
    def submit(self, tensors: list[torch.Tensor], keys: list[str], flags: list[bool], result: torch.Tensor,
               is_last: bool, handed: Optional[float] = None) -> "torch.futures.Future[torch.Tensor]":
        """Queue one bucket; the future completes with ``result`` once it holds the average."""
        # CUDA (comm.streams): the worker runs the bucket on a side stream that waits for this event (the
        # gradients are ready on the backward's stream), and completes a CUDA-aware future there, so the
        # backward's stream never waits for a collective and DDP's reducer waits for the result on the device.
        fut = streams.device_future(result.device)
        ready = streams.ready_event(result.device)
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="syncwise-compress", daemon=True)
                self._worker.start()
        self._queue.put((tensors, keys, flags, result, is_last, fut, ready, handed))
        return fut

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            self._process(*job)

    def _process(self, tensors, keys, flags, result, is_last, fut, ready, handed=None) -> None:
        """Average one bucket (on the worker, or inline) and complete ``fut``; on CUDA on the side stream."""
        side = streams.side_stream(result.device, "compress") if ready is not None else None
        try:
            with (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()), hostread.step_region():
                if side is not None:
                    side.wait_event(ready)
                    streams.keep_for_stream([*tensors, result], side)  # made on the backward's stream
                stats = self.compressor.stats  # the compressor's collectives (a run's ledger.dp)
                start, waited = time.perf_counter(), stats.total_time_s
                with traced():
                    self._average_bucket(tensors, keys, flags)
                self.compute_s += max(0.0, time.perf_counter() - start - (stats.total_time_s - waited))
                if is_last:
                    self.steps += 1
                self._finished(handed)
                fut.set_result(result)  # on the side stream: a CUDA-aware future records its events here
        except BaseException as exc:  # surface on the training thread instead of hanging it
            if not fut.done():
                fut.set_exception(exc)

    def _average_bucket(self, tensors: list[torch.Tensor], keys: list[str], flags: list[bool]) -> None:
        """Average one bucket in place over the group (subclasses: the hierarchical sync)."""
        self.compressor.average(tensors, keys, self.comm_group, flags)

    def run_inline(self, tensors: list[torch.Tensor], keys: list[str], flags: list[bool], result: torch.Tensor,
                   is_last: bool, handed: Optional[float] = None) -> "torch.futures.Future[torch.Tensor]":
        """Average one bucket now, on the calling (backward's) thread: :attr:`inline` mode."""
        fut = streams.device_future(result.device)
        self._process(tensors, keys, flags, result, is_last, fut, streams.ready_event(result.device), handed)
        return fut

    def wait_idle(self) -> None:
        """Block until every queued bucket has been processed."""
        if self._worker is None or not self._worker.is_alive():
            return
        ev = threading.Event()
        self._queue.put(ev)
        ev.wait()

    def close(self) -> None:
        """Stop the worker thread (it is a daemon, so this is optional at exit)."""
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(_STOP)
            self._worker.join()
        self._worker = None


def _direct_single_collective(state: CompressionHookState, bucket: dist.GradBucket):
    """none/fp16/bf16: one collective per bucket, issued straight from the hook (as DDP's own all-reduce).

    DDP calls the hook in bucket order on every rank, so a single collective per bucket is issued in the
    same order everywhere without the worker thread; skipping the thread hop keeps the baseline path as
    cheap as DDP's built-in one.
    """
    comp, group, buffer = state.compressor, state.comm_group, bucket.buffer()
    handed = state._handed(buffer, bucket.is_last())
    world = dist.get_world_size(group)
    cast = comp.wire_dtype != buffer.dtype
    start = time.perf_counter()
    # Pre-divide a cast copy so a 16-bit sum cannot overflow where the average would not.
    wire = buffer.to(comp.wire_dtype).div_(world) if cast else buffer
    state.compute_s += time.perf_counter() - start
    comp.book(True, buffer.numel(), ())  # no state to protect: a NaN reaches every rank through the sum
    comp._counters["bytes_sent"] += wire.numel() * wire.element_size()
    comp._counters["collectives"] += 1
    if bucket.is_last():
        state.steps += 1
    work = ops.all_reduce(wire, "sum", group=group, async_op=True, stats=comp.stats)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed (timed-out) collective: DDP must not apply a half-received bucket
        # torch runs this callback on a pool stream: `wire` was allocated on the backward's (comm.streams rule 4)
        streams.keep_for_current_stream((wire, buffer))
        if not cast:
            buffer.div_(world)
            state._finished(handed)
            return buffer
        start = time.perf_counter()
        buffer.copy_(wire)
        state.compute_s += time.perf_counter() - start
        state._finished(handed)
        return buffer

    return work.get_future().then(finish)


def _direct_gather(state: CompressionHookState, bucket: dist.GradBucket):
    """fp8: one all-gather per bucket, issued straight from the hook; the payloads are decoded and summed
    in the future's callback. As with the casts, DDP's bucket order keeps the single collective in the
    same order on every rank, and skipping the worker thread keeps the encode off the queue. The
    payload's non-finite flag makes every rank skip a bucket that any rank could not send."""
    comp, group, buffer = state.compressor, state.comm_group, bucket.buffer()
    handed = state._handed(buffer, bucket.is_last())
    world = dist.get_world_size(group)
    grads = bucket.gradients()
    tensors, keys, raw = split_by_policy(grads, [state.name_of(p) for p in bucket.parameters()],
                                         [state.policy.compress(g) for g in grads])
    start = time.perf_counter()
    with traced():
        packed = comp.pack(tensors, keys, raw, dist.get_rank(group))
    state.compute_s += time.perf_counter() - start
    work, gathered = comp._all_gather(packed.payload, group, world, async_op=True)
    if bucket.is_last():
        state.steps += 1

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed (timed-out) collective: DDP must not apply a half-received bucket
        # torch runs this callback on a pool stream; the payload, the gathered bytes and the staged residual
        # were allocated on the backward's stream and die with this closure: without record_stream the caching
        # allocator could hand their blocks out while this stream still reads them (comm.streams rule 4).
        streams.keep_for_current_stream((packed.payload, gathered, *packed.streamed, buffer, *tensors, *raw))
        # the verdict stays on the device (this callback may run inline on the backward's thread)
        start = time.perf_counter()
        with traced():
            comp.book(comp.unpack_sum(gathered, packed, tensors, raw, world), buffer.numel(), keys)
        state.compute_s += time.perf_counter() - start
        state._finished(handed)
        return buffer

    return work.get_future().then(finish)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` with ``state.compressor``; returns a future of the flat bucket.

    Every rank issues the same collectives whatever its gradients hold: a bucket with NaN/Inf on any
    rank is flagged inside the compressor's own payload, comes back as NaN on every rank (the trainer
    skips the step everywhere) and leaves the compressor's state untouched.
    """
    comp = state.compressor
    if state.direct and getattr(comp, "wire_dtype", None) is not None:
        return _direct_single_collective(state, bucket)
    if state.direct and isinstance(comp, GatherCompressor) and comp.direct:
        return _direct_gather(state, bucket)
    handed = state._handed(bucket.buffer(), bucket.is_last())
    params = bucket.parameters()
    grads = bucket.gradients()
    keys = [state.name_of(p) for p in params]
    flags = [state.policy.compress(g) for g in grads]
    # the compressor writes the averages into the gradient views, i.e. into the bucket buffer itself
    if state.inline:
        return state.run_inline(list(grads), keys, flags, bucket.buffer(), bucket.is_last(), handed)
    return state.submit(list(grads), keys, flags, bucket.buffer(), bucket.is_last(), handed)


def torch_reference_hook(name: str, process_group: Any = None, **powersgd_options: Any) -> tuple[Any, Any]:
    """PyTorch's own DDP hook ``(state, hook)`` for side-by-side benchmarks: 'allreduce', 'fp16', 'bf16'
    (the generic cast path, since torch's ``bf16_compress_hook`` refuses gloo) or 'powersgd'.

    These issue torch's collectives directly, so no syncwise ``CommStats`` counts their bytes.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return process_group, default_hooks.allreduce_hook
    if name == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if name == "bf16":
        def bf16_hook(pg: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return default_hooks._compress_hook(torch.bfloat16, pg, bucket)
        return process_group, bf16_hook
    if name == "powersgd":
        opts = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10, **powersgd_options}
        return powerSGD_hook.PowerSGDState(process_group=process_group, **opts), powerSGD_hook.powerSGD_hook
    raise ConfigError("torch_hook", name, "allreduce, fp16, bf16, powersgd")
