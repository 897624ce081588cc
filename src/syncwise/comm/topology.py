"""Topology-aware (hierarchical) all-reduce and its DDP comm hook.

On a cluster of N nodes x P processes, a flat all-reduce pushes ~2(NP-1)/NP of the payload through
the slow inter-node links. The hierarchical form keeps most traffic on the fast intra-node links:

1. intra-node reduce-scatter: local rank i ends up with the node's sum of shard i (1/P of the data)
   (or, on gloo whose reduce-scatter is slow, an intra-node all-reduce after which rank i keeps shard i);
2. inter-node all-reduce of shard i among the ranks with local rank i (P such groups run at once,
   so every node's NIC carries 2(N-1)/N of the payload in total, split over P processes);
3. intra-node all-gather of the reduced shards.

Which of the two is faster depends on message size (three latency-bound steps vs one) and link
speeds, so :class:`TopoAwareCollective` picks per call with a small alpha-beta cost model whose
parameters are given (``link_speeds``) or measured (``calibrate()``). Every collective goes through
``syncwise.comm.ops`` so its bytes are counted.
"""
from __future__ import annotations

import statistics
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from syncwise.errors import ConfigError

from . import ops, streams, timing
from .context import REDUCE_OPS, CommContext, Topology
from .stats import CommStats

__all__ = ["Topology", "TopoAwareCollective", "topo_allreduce_hook", "ALGORITHMS"]

ALGORITHMS = ("auto", "flat", "hierarchical")
INTRA_REDUCE = ("auto", "reduce_scatter", "all_reduce")
_LINK_KEYS = ("intra", "inter", "latency_us")
_DEFAULT_LATENCY_S = 50e-6
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # a list is all-reduced in buckets of this size, as DDP's default


def _describe(value: object) -> str:
    """A short description of a wrong argument (its type, not a huge repr)."""
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def _buckets(tensors: Sequence[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Pack tensors, in order, into per-dtype buckets of at most ``cap`` bytes (a larger tensor alone).

    Buckets are returned in the order they close, which depends only on shapes and dtypes, so every
    rank issues the same collectives in the same order."""
    done: list[list[torch.Tensor]] = []
    open_: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        bucket, size = open_.get(t.dtype, ([], 0))
        if bucket and size + nbytes > cap:
            done.append(bucket)
            bucket, size = [], 0
        open_[t.dtype] = (bucket + [t], size + nbytes)
    done += [bucket for bucket, _ in open_.values()]
    return done


class TopoAwareCollective:
    """All-reduce that is hierarchical across nodes when that pays, flat otherwise.

    ``backend`` is a backend name (a :class:`CommContext` is created and owned) or an existing
    ``CommContext``. ``threshold_bytes``: messages smaller than this always go flat.
    ``link_speeds``: ``{"intra": Gbit/s, "inter": Gbit/s, "latency_us": per-collective latency}``;
    without it (and without ``calibrate()``) every message above the threshold goes hierarchical.
    ``algorithm`` forces "flat" or "hierarchical" ("hierarchical" on a one-node topology degenerates
    to reduce-scatter + all-gather, which is still a correct all-reduce). ``intra_reduce`` picks the
    node-local first step: "reduce_scatter" (least traffic) or "all_reduce" (every local rank gets
    the node sum and keeps its shard; faster on gloo, whose reduce-scatter is slow); "auto" chooses
    "all_reduce" on gloo and "reduce_scatter" otherwise. ``pipeline_chunk_bytes``: messages above it are
    cut into chunks whose node-local phases overlap the previous chunk's inter-node all-reduce (0: off).
    ``stats``: where its collectives are counted (a run's ``ledger.dp``; default: the context's own ``stats``).
    """

    def __init__(self, backend: Union[str, CommContext] = "auto", topology: Optional[Topology] = None,
                 threshold_bytes: int = 256 * 1024, link_speeds: Optional[Mapping[str, float]] = None,
                 algorithm: str = "auto", intra_reduce: str = "auto", timeout_s: float = 300.0,
                 stats: Optional[CommStats] = None, pipeline_chunk_bytes: int = 4 * 1024 * 1024) -> None:
        if not isinstance(threshold_bytes, int) or threshold_bytes < 0:
            raise ConfigError("threshold_bytes", threshold_bytes, "an integer >= 0")
        if algorithm not in ALGORITHMS:
            raise ConfigError("algorithm", algorithm, ", ".join(ALGORITHMS))
        if intra_reduce not in INTRA_REDUCE:
            raise ConfigError("intra_reduce", intra_reduce, ", ".join(INTRA_REDUCE))
        if isinstance(backend, CommContext):
            if topology is not None and topology != backend.topology:
                raise ConfigError("topology", topology,
                                  f"None or the context's own topology {backend.topology}")
            self.ctx, self._owns_ctx = backend, False
        else:
            self.ctx, self._owns_ctx = CommContext(backend, timeout_s=timeout_s, topology=topology, stats=stats), True
        self.topology = self.ctx.topology
        self.threshold_bytes = threshold_bytes
        if not isinstance(pipeline_chunk_bytes, int) or pipeline_chunk_bytes < 0:
            raise ConfigError("pipeline_chunk_bytes", pipeline_chunk_bytes, "an integer >= 0 (0 = no pipelining)")
        self.pipeline_chunk_bytes = pipeline_chunk_bytes
        self.algorithm = algorithm
        # Measured with comm-bench on gloo/loopback: reduce-scatter reaches ~1/4 of all-reduce's busbw
        # (256 MB: 546 ms vs 269 ms), so on gloo the node's first step is a full all-reduce.
        if intra_reduce == "auto":
            intra_reduce = "all_reduce" if "gloo" in str(self.ctx.backend) else "reduce_scatter"
        self.intra_reduce = intra_reduce
        self.stats = stats if stats is not None else self.ctx.stats  # (the context's own, unless given)
        self.last_algorithm: Optional[str] = None
        self._model: Optional[dict[str, float]] = None
        if link_speeds is not None:
            self.set_link_speeds(link_speeds)

    # -- cost model --------------------------------------------------------------------------------
    def set_link_speeds(self, link_speeds: Mapping[str, float]) -> None:
        """Use given link speeds (Gbit/s) for the flat-vs-hierarchical choice (same on every rank!)."""
        if not isinstance(link_speeds, Mapping) or not set(link_speeds) <= set(_LINK_KEYS) \
                or not {"intra", "inter"} <= set(link_speeds):
            raise ConfigError("link_speeds", link_speeds,
                              "a dict with 'intra' and 'inter' in Gbit/s and optionally 'latency_us'")
        for key, value in link_speeds.items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"link_speeds.{key}", value, "a positive number")
        intra = float(link_speeds["intra"]) * 1e9 / 8
        inter = float(link_speeds["inter"]) * 1e9 / 8
        lat = float(link_speeds.get("latency_us", _DEFAULT_LATENCY_S * 1e6)) * 1e-6
        # A flat ring crosses node boundaries on some of its edges: the slowest edge sets its pace.
        self._model = {"bw_intra": intra, "bw_inter": inter, "bw_flat": min(intra, inter) if
                       self.topology.nodes > 1 else intra, "lat_world": lat, "lat_intra": lat, "lat_inter": lat}

    @property
    def link_speeds(self) -> Optional[dict[str, float]]:
        """The cost model in user units (Gbit/s bus bandwidths, µs latencies), or None."""
        if self._model is None:
            return None
        m = self._model
        return {"intra": m["bw_intra"] * 8e-9, "inter": m["bw_inter"] * 8e-9, "flat": m["bw_flat"] * 8e-9,
                "latency_us": m["lat_world"] * 1e6, "latency_intra_us": m["lat_intra"] * 1e6,
                "latency_inter_us": m["lat_inter"] * 1e6}

    def estimate_seconds(self, nbytes: int, algorithm: str) -> float:
        """Modelled time of an all-reduce of ``nbytes`` with "flat" or "hierarchical" (needs a model)."""
        if self._model is None:
            raise ConfigError("link_speeds", None, "set link_speeds or call calibrate() before estimating")
        m, n, p = self._model, self.topology.nodes, self.topology.procs_per_node
        w = n * p
        if algorithm == "flat":
            return m["lat_world"] + 2 * (w - 1) / w * nbytes / m["bw_flat"]
        t = 0.0
        if p > 1:  # reduce-scatter + all-gather together move an all-reduce's bytes on the intra links;
            # a full intra all-reduce + all-gather moves 1.5x that.
            factor = 2 if self.intra_reduce == "reduce_scatter" else 3
            t += 2 * m["lat_intra"] + factor * (p - 1) / p * nbytes / m["bw_intra"]
        if n > 1:  # P concurrent shard all-reduces share each node's NIC: the node moves 2(N-1)/N of it
            t += m["lat_inter"] + 2 * (n - 1) / n * nbytes / m["bw_inter"]
        return t

    def choose(self, nbytes: int) -> str:
        """"flat" or "hierarchical" for a message of ``nbytes`` (identical on every rank)."""
        if self.algorithm != "auto":
            return self.algorithm
        if self.topology.is_trivial or nbytes < self.threshold_bytes:
            return "flat"
        if self._model is None:
            return "hierarchical"
        hier, flat = self.estimate_seconds(nbytes, "hierarchical"), self.estimate_seconds(nbytes, "flat")
        return "hierarchical" if hier < flat else "flat"

    def calibrate(self, probe_bytes: int = 4 * 1024 * 1024, iters: int = 3) -> dict[str, float]:
        """Measure latencies and bus bandwidths of the world, intra-node and inter-node groups.

        Collective: every rank must call it. Times are maxed over ranks so every rank ends up with
        the same model and therefore makes the same flat/hierarchical choices.
        """
        if probe_bytes < 1024 or iters < 1:
            raise ConfigError("calibrate", (probe_bytes, iters), "probe_bytes >= 1024 and iters >= 1")
        topo, ctx = self.topology, self.ctx
        n, p, w = topo.nodes, topo.procs_per_node, topo.world_size
        count = max(p, probe_bytes // 4 // p * p)
        dev = ctx.device  # the group's device: NCCL takes CUDA buffers only (issue 24)
        big, tiny = torch.ones(count, device=dev), torch.ones(1, device=dev)
        shard = torch.ones(count // p, device=dev)

        def timed(t: torch.Tensor, group) -> float:
            if group is None:
                return 0.0
            ops.all_reduce(t, "sum", group=group, stats=self.stats)  # warm-up: connections, buffers
            samples = []
            for _ in range(iters):
                ops.barrier()
                timing.synchronize(dev)
                with timing.timed(dev) as iv:  # CUDA events: the collective, not its enqueue
                    ops.all_reduce(t, "sum", group=group, stats=self.stats)
                samples.append(iv.seconds())
            return statistics.median(samples)

        # Issued in the same order on every rank; the inter-node probes run concurrently across the
        # P cross groups, exactly as in the hierarchical algorithm.
        times = torch.tensor([timed(tiny, dist.group.WORLD), timed(big, dist.group.WORLD),
                              timed(tiny, ctx.intra_group), timed(big, ctx.intra_group),
                              timed(tiny, ctx.inter_group), timed(shard, ctx.inter_group)], dtype=torch.float64)
        ops.all_reduce(times, "max", stats=self.stats)
        lat_w, t_w, lat_a, t_a, lat_e, t_e = times.tolist()
        nbytes = count * 4
        eps = 1e-9
        bw_flat = 2 * (w - 1) / max(w, 1) * nbytes / max(t_w - lat_w, eps) if w > 1 else float("inf")
        bw_intra = 2 * (p - 1) / p * nbytes / max(t_a - lat_a, eps) if p > 1 else float("inf")
        bw_inter = 2 * (n - 1) / n * nbytes / max(t_e - lat_e, eps) if n > 1 else float("inf")
        self._model = {"bw_intra": bw_intra, "bw_inter": bw_inter, "bw_flat": bw_flat,
                       "lat_world": lat_w, "lat_intra": lat_a, "lat_inter": lat_e}
        return self.link_speeds  # type: ignore[return-value]

    # -- the collective ----------------------------------------------------------------------------
    def all_reduce(self, tensor: Union[torch.Tensor, Sequence[torch.Tensor]], op: str = "sum",
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Union[torch.Tensor, Sequence[torch.Tensor]]:
        """All-reduce ``tensor`` in place over all ranks (flat or hierarchical); return it.

        ``tensor`` is one tensor, or a list or tuple of dense tensors on one device (e.g. a model's
        gradients): those are packed, per dtype and in order, into buckets of at most ``bucket_bytes``
        (25 MiB by default, as DDP; a larger tensor gets a bucket of its own), each bucket is all-reduced
        as one message (so the flat/hierarchical choice and the byte counts apply per bucket) and the
        results are copied back into the caller's tensors; the list or tuple itself is returned. Every
        rank must pass the same shapes and dtypes in the same order. ``op``: sum, avg (floating-point
        only), max, min, product.
        """
        if isinstance(tensor, torch.Tensor):
            self._check_op(op, tensor)
            return self._all_reduce_one(tensor, op)
        if not isinstance(tensor, (list, tuple)):
            raise ConfigError("tensor", _describe(tensor), "a torch.Tensor, or a list or tuple of tensors")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ConfigError("bucket_bytes", bucket_bytes, "an integer >= 1 (bytes per bucket)")
        if op not in REDUCE_OPS:  # also for an empty list
            raise ConfigError("op", op, ", ".join(REDUCE_OPS))
        for i, t in enumerate(tensor):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"tensor[{i}]", _describe(t), "a torch.Tensor (every item of the list)")
            if t.layout != torch.strided:
                raise ConfigError(f"tensor[{i}]", f"a {t.layout} tensor", "dense (strided) tensors")
            if t.device != tensor[0].device:
                raise ConfigError(f"tensor[{i}]", f"a tensor on {t.device}",
                                  f"tensors on one device (tensor[0] is on {tensor[0].device})")
            self._check_op(op, t)
        for bucket in _buckets(tensor, bucket_bytes):
            with torch.no_grad():  # in place, also on leaves that require grad (parameters)
                if len(bucket) == 1:
                    self._all_reduce_one(bucket[0], op)
                    continue
                flat = _flatten_dense_tensors(bucket)
                self._all_reduce_one(flat, op)
                for t, result in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    t.copy_(result)
        return tensor

    @staticmethod
    def _check_op(op: str, tensor: torch.Tensor) -> None:
        if op not in REDUCE_OPS:
            raise ConfigError("op", op, ", ".join(REDUCE_OPS))
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ConfigError("op", op, "'avg' only for floating-point tensors; use 'sum' for integers")

    def _all_reduce_one(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        algorithm = self.choose(tensor.numel() * tensor.element_size())
        self.last_algorithm = algorithm
        # Collectives need contiguous memory: reduce a contiguous copy and write it back.
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if algorithm == "flat":
            ops.all_reduce(work, op, stats=self.stats)
        else:
            self._hierarchical(work, op)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def _hierarchical(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce(-scatter) in the node, all-reduce shards across nodes, all-gather in the node.

        Large messages are cut into chunks and pipelined: while chunk i crosses the (slow) inter-node
        link asynchronously, chunk i+1 is reduced inside the node and chunk i-1 gathered, so the node-local
        phases hide behind the inter-node one. Every collective is issued from this thread in a fixed
        order, identical on all ranks.
        """
        p = self.topology.procs_per_node
        flat = tensor.view(-1)
        chunk = max(p, self.pipeline_chunk_bytes // flat.element_size() // p * p) if self.pipeline_chunk_bytes \
            else flat.numel()
        pending = []
        for start in range(0, flat.numel(), chunk):
            piece = flat[start:start + chunk]
            buf, shard = self._reduce_in_node(piece, op)
            work = None
            if self.ctx.inter_group is not None:
                work = ops.all_reduce(shard, "sum" if op == "avg" else op, group=self.ctx.inter_group,
                                      async_op=True, stats=self.stats)
            pending.append((piece, buf, shard, work))
            if len(pending) > 1:  # keep one chunk in flight across nodes while the next is reduced
                self._gather_in_node(*pending.pop(0), op)
        for item in pending:
            self._gather_in_node(*item, op)

    def _reduce_in_node(self, piece: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Node-local first step for one chunk: returns (padded chunk buffer, this rank's shard of the node sum)."""
        p, ctx = self.topology.procs_per_node, self.ctx
        base_op = "sum" if op == "avg" else op
        numel = piece.numel()
        shard_len = -(-numel // p)
        if shard_len * p == numel:
            buf = piece  # no copy: the reduce reads it, then the all-gather writes the result back
        else:
            # Pad to P equal shards; the pad value never reaches the result (it is sliced off).
            buf = torch.zeros(shard_len * p, dtype=piece.dtype, device=piece.device)
            buf[:numel].copy_(piece)
        if ctx.intra_group is None:
            return buf, buf
        if self.intra_reduce == "reduce_scatter":
            shard = torch.empty(shard_len, dtype=piece.dtype, device=piece.device)
            ops.reduce_scatter(shard, buf, base_op, group=ctx.intra_group, stats=self.stats)
            return buf, shard
        ops.all_reduce(buf, base_op, group=ctx.intra_group, stats=self.stats)
        lr = ctx.local_rank
        # A copy, not a view: the all-gather writes into buf and must not read from it.
        return buf, buf[lr * shard_len:(lr + 1) * shard_len].clone()

    def _gather_in_node(self, piece: torch.Tensor, buf: torch.Tensor, shard: torch.Tensor, work, op: str) -> None:
        """Wait for the chunk's inter-node all-reduce, then share the shards inside the node."""
        ctx = self.ctx
        if work is not None:
            work.wait()
        if op == "avg":
            shard.div_(ctx.world_size)  # divide 1/P of the data instead of all of it
        if ctx.intra_group is not None:
            ops.all_gather(buf, shard, group=ctx.intra_group, stats=self.stats)
        if buf is not piece:
            piece.copy_(buf[:piece.numel()])

    def close(self) -> None:
        """Close the CommContext if this object created it."""
        if self._owns_ctx:
            self.ctx.close()

    def __enter__(self) -> "TopoAwareCollective":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def topo_allreduce_hook(state: TopoAwareCollective, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with ``state.all_reduce`` (flat or hierarchical).

    Runs synchronously and returns a completed future: gloo's reduce-scatter has no future to chain
    on, and issuing each bucket's collectives right here, in DDP's bucket order, keeps their order
    identical on every rank (the failure mode of torch's PowerSGD hook on gloo).
    Register with ``ddp.register_comm_hook(TopoAwareCollective(ctx), topo_allreduce_hook)``.
    """
    buf = bucket.buffer()
    side = streams.side_stream(buf.device, "topo")
    if side is None:
        state.all_reduce(buf, op="avg")
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    # CUDA (comm.streams): the collectives go on a side stream that waits for the bucket, so the backward's
    # stream does not queue behind them; DDP waits for the CUDA-aware future's events on the device.
    side.wait_stream(torch.cuda.current_stream(buf.device))
    fut = streams.device_future(buf.device)
    with torch.cuda.stream(side):
        buf.record_stream(side)
        state.all_reduce(buf, op="avg")
        fut.set_result(buf)
    return fut


# DDP inspects these annotations and compares them with the real objects, so they must not stay
# strings (this module uses postponed annotations).
topo_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, state=TopoAwareCollective)
topo_allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
