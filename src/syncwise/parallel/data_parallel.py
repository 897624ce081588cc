"""Data parallelism: DDP with syncwise's gradient-sync hook, timed so exposed communication is measurable.

With compression on, every bucket goes through ``syncwise.compress.compression_hook``, so the compressed
bytes are counted by ``syncwise.comm``. With compression off, DDP keeps its built-in C++ all-reduce: any
Python comm hook (PyTorch's own ``allreduce_hook`` included) costs ~10 % of a step here, measured; the
bytes of that all-reduce are known exactly (every bucket, once per sync) and recorded in the run's ``ledger.dp``.
Either way the trainer learns when the last gradient became ready, so it can tell how long the step then
waited on the network.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..comm import ops, timing
from ..comm.context import CommContext
from ..comm.topology import TopoAwareCollective, topo_allreduce_hook
from ..comm.stats import CommStats
from ..compress import CompressionHookState, CompressionPolicy, Compressor, compression_hook, torch_reference_hook
from ..compress.hierarchical import HierarchicalHookState
from ..compress.registry import build_compressor
from ..errors import ConfigError
from ..layout import COMPRESSORS, TORCH_HOOK_PREFIX, Compress, names_torch_hook
from ..layout import BUCKET_CAP_MB, MIN_NUMEL


class _LastGradReady:
    """When the backward pass last made gradients ready; what backward() takes after that is exposed comm.

    On CUDA the moment is a CUDA event on the stream that produced the gradient, not a host timestamp: the
    host runs ahead of the GPU, so host clocks would count queued backward kernels as communication. The
    events are read only when the step's row is logged (``backward_done`` returns a reader), so timing
    adds no host sync to the step.
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.cuda = device is not None and device.type == "cuda"
        self.last_ready = 0.0
        self.buckets = 0  # readiness events seen since reset (buckets, or gradients for GradReadyClock)
        self._ready_event: Any = None

    def mark_ready(self) -> None:
        if self.cuda:
            self._ready_event.record()  # re-recording one event keeps only the last readiness
        else:
            self.last_ready = time.perf_counter()
        self.buckets += 1

    def reset(self) -> None:
        self.buckets = 0
        if self.cuda:  # a fresh event per step: the previous step's may not have been read yet
            self._ready_event = torch.cuda.Event(enable_timing=True)

    def backward_done(self) -> "Callable[[], float]":
        """Call right after the syncing backward returns; the returned function gives the exposed seconds."""
        if not self.buckets:
            return lambda: 0.0
        if not self.cuda:
            exposed = max(0.0, time.perf_counter() - self.last_ready)
            return lambda: exposed
        # DDP ends backward by making this stream wait for its all-reduce: the gap between the last gradient
        # and this event is the communication the GPU waited for.
        ready, end = self._ready_event, torch.cuda.Event(enable_timing=True)
        end.record()

        def read() -> float:
            end.synchronize()
            return max(0.0, ready.elapsed_time(end) / 1000)

        return read


class GradSyncTimer(_LastGradReady):
    """Wraps a DDP comm hook; DDP calls the hook as each bucket's gradients are complete."""

    def __init__(self, inner_state: Any, inner_hook: Any, device: Optional[torch.device] = None):
        super().__init__(device)
        self.inner_state, self.inner_hook = inner_state, inner_hook


class GradReadyClock(_LastGradReady):
    """The same for DDP's built-in (hook-less) all-reduce: a post-accumulate-grad hook on every parameter."""

    def __init__(self, model: nn.Module, device: Optional[torch.device] = None):
        super().__init__(device)
        self._handles = [p.register_post_accumulate_grad_hook(lambda _p: self.mark_ready())
                         for p in model.parameters() if p.requires_grad]


def _timed_hook(timer, bucket):  # no annotations: DDP rejects string annotations on hooks
    timer.mark_ready()
    return timer.inner_hook(timer.inner_state, bucket)


#: name -> bytes per element sent (syncwise.layout.COMPRESSORS' torch-* entries)
TORCH_HOOKS = {n.removeprefix(TORCH_HOOK_PREFIX): s.bytes_per_element and int(s.bytes_per_element)
               for n, s in COMPRESSORS.items() if s.torch_hook}
# spec key -> (PowerSGDState argument, type, lowest, highest): torch needs start_powerSGD_iter > 1 with error
# feedback or warm start (both on by default); ranks and iteration counts are kept within int32.
_TORCH_POWERSGD_KEYS = {"rank": ("matrix_approximation_rank", int, 1, 2**31 - 1),
                        "start_iter": ("start_powerSGD_iter", int, 2, 2**31 - 1),
                        "min_compression_rate": ("min_compression_rate", float, 0, 10**9)}


@dataclass
class TorchHookSpec:
    """PyTorch's own DDP comm hook, the peer syncwise's compressors are measured against.

    Spec strings: ``torch-allreduce``, ``torch-fp16``, ``torch-bf16``, ``torch-powersgd[:rank=4,start_iter=10]``.
    """

    name: str
    options: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return TORCH_HOOK_PREFIX + self.name + (f":{opts}" if opts else "")

    @staticmethod
    def parse(spec: str) -> "Optional[TorchHookSpec]":
        """The hook a ``torch-...`` spec names, None for any other spec; a bad one raises ConfigError."""
        from ..specs import parse_spec, read_float, read_int  # the one spec parser (syncwise.specs)

        if not names_torch_hook(spec):
            return None
        accepted = ("torch-allreduce, torch-fp16, torch-bf16, torch-powersgd[:rank=R,start_iter=N,"
                    "min_compression_rate=X] with " + ", ".join(f"{k} in [{lo}, {hi}]" for k, (_, _, lo, hi)
                                                              in _TORCH_POWERSGD_KEYS.items()))
        name, raw_options = parse_spec(spec, "compress", accepted)
        name = name.removeprefix(TORCH_HOOK_PREFIX)
        if name not in TORCH_HOOKS or (raw_options and name != "powersgd"):
            raise ConfigError("compress", spec, accepted)
        options = {}
        for key, raw in raw_options.items():
            if key not in _TORCH_POWERSGD_KEYS:
                raise ConfigError("compress", spec, accepted)
            _, typ, lo, hi = _TORCH_POWERSGD_KEYS[key]
            read = read_int if typ is int else read_float
            options[key] = read(raw, "compress", spec, key, lo, hi, accepted=accepted)
        return TorchHookSpec(name, options)

    def state_and_hook(self, process_group=None):
        opts = {_TORCH_POWERSGD_KEYS[k][0]: v for k, v in self.options.items()}
        return torch_reference_hook(self.name, process_group, **opts)


def compressor_of(c: Compress) -> Any:
    """The instance a parsed compressor spec (``syncwise.layout.Compress``) names: PyTorch's hook (a TorchHookSpec,
    with torch's own bounds) or one of syncwise's (``compress.registry.build_compressor``). Either keeps the spec
    as ``parsed``, so the layout's rules read it without parsing again (``parallelize``)."""
    if not c.torch_hook:
        return build_compressor(c)
    hook = TorchHookSpec.parse(c.text)
    hook.parsed = c
    return hook


@dataclass
class DataParallel:
    """The DDP-wrapped model plus what the loop needs to know about its gradient sync."""

    module: nn.Module
    timer: "Optional[GradSyncTimer | GradReadyClock]" = None
    hook_state: Optional[CompressionHookState] = None
    bytes_counted: bool = True  # False for torch's PowerSGD hook, whose collectives bypass syncwise.comm
    builtin_sync_bytes: int = 0  # DDP's built-in all-reduce: bytes this rank sends per gradient sync
    hierarchical: Any = None  # the comm.Topology of the hierarchical gradient sync; None: flat
    # the run's ledger.dp times the sync's collectives: not DDP's built-in all-reduce nor torch's comm hooks (they
    # bypass syncwise.comm; their exposed part is still measured, by DDP's bucket timer)
    sync_timed: bool = True
    stats: Optional[CommStats] = None  # where the gradient sync is counted (the run's ledger.dp; None: nowhere)
    group: Any = None  # DDP's process group (None: every rank): its all-reduce's bytes per hop are split over it

    def record_sync(self) -> None:
        """Count one gradient sync of DDP's built-in all-reduce (its collective bypasses syncwise.comm), split per hop
        as every ring all-reduce is (``comm.ops.split_bytes``: N_g / W of its bytes cross)."""
        if self.builtin_sync_bytes and self.stats is not None:
            self.stats.record("all_reduce", self.builtin_sync_bytes,
                              hop=ops.split_bytes(self.builtin_sync_bytes, self.group, "ring"))

    @property
    def distributed(self) -> bool:
        return self.timer is not None


def _no_forward_buffer_sync() -> dict[str, bool]:
    # torch renamed broadcast_buffers to forward_sync_buffers; both still sync once at construction.
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _counted(bytes_per_element: int, hook, stats: Optional[CommStats], group: Any = None):
    """Count the bytes of a torch hook that sends the whole bucket in one dtype (it bypasses syncwise.comm): an
    all-reduce over ``group``, split per hop as every ring's (``comm.ops.split_bytes``)."""
    if stats is None:
        return hook

    def counted(state, bucket):
        nbytes = bucket.buffer().numel() * bytes_per_element
        stats.record("all_reduce", nbytes, hop=ops.split_bytes(nbytes, group, "ring"))
        return hook(state, bucket)

    return counted


def apply_data_parallel(model: nn.Module, compressor: "Optional[Compressor | TorchHookSpec]" = None,
                        bucket_cap_mb: float = BUCKET_CAP_MB, min_numel: int = MIN_NUMEL,
                        device: Optional[torch.device] = None,
                        find_unused_parameters: Optional[bool] = None, process_group: Any = None,
                        ignore: "Optional[list[str]]" = None, inline_compress: bool = False,
                        hierarchical: bool = False, stats: Optional[CommStats] = None) -> DataParallel:
    """Wrap ``model`` in DDP when a multi-rank process group exists; else return it as is.

    ``find_unused_parameters`` defaults to the model's ``has_sparse_params`` (MoE experts that received
    no token in a step get no gradient). ``process_group``: the data-parallel ranks (default: every rank; a
    pipeline stage's replicas otherwise). ``ignore``: names of parameters DDP leaves alone (expert-parallel
    experts, whose gradients are summed over their own group). ``hierarchical``: average each bucket inside the
    node at full precision and run the compressor only across nodes (``compress.hierarchical``; with no compressor
    an fp32 hierarchical all-reduce, ``comm.topology``); the caller decides (``layout.hierarchical_applies``).
    ``stats``: where the gradient sync syncwise does not issue itself is counted (DDP's built-in all-reduce, torch's
    cast hooks, the hierarchical fp32 all-reduce: the run's ``ledger.dp``; a compressor counts into its own
    ``stats``, which ``parallelize`` makes the same one).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return DataParallel(module=model, stats=stats)
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    if find_unused_parameters is None:
        find_unused_parameters = bool(getattr(model, "has_sparse_params", False))
    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb, process_group=process_group,
              find_unused_parameters=find_unused_parameters,
              # Buffers (e.g. MoE router biases) are kept identical by the model's own update, not re-sent
              # every forward.
              **_no_forward_buffer_sync())
    if hierarchical:
        return _hierarchical(ddp, model, compressor, min_numel, device, inline_compress, stats)
    if isinstance(compressor, TorchHookSpec):
        state, hook = compressor.state_and_hook(process_group)
        per_element = TORCH_HOOKS[compressor.name]
        timer = GradSyncTimer(state, _counted(per_element, hook, stats, process_group) if per_element
                              else hook, device)
        ddp.register_comm_hook(timer, _timed_hook)
        return DataParallel(module=ddp, timer=timer, bytes_counted=per_element is not None, sync_timed=False,
                            stats=stats)
    if compressor is None or (getattr(compressor, "name", None) == "none"):
        # Every bucket, unused parameters' zeros included, is all-reduced once per sync.
        nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if p.requires_grad and n not in (ignore or ()))
        return DataParallel(module=ddp, timer=GradReadyClock(model, device), builtin_sync_bytes=nbytes,
                            sync_timed=False, stats=stats, group=process_group)
    names = {p: n for n, p in model.named_parameters()}
    # A dedicated communicator is made by new_group, which every rank of the world must call alike: only when the
    # data-parallel ranks are the whole world (a pipeline stage's replicas compress on their own group).
    whole = process_group is None or dist.get_world_size(process_group) == dist.get_world_size()
    state = CompressionHookState(compressor, process_group=process_group, param_names=names,
                                 policy=CompressionPolicy(min_numel=min_numel), dedicated_group=whole)
    state.inline = inline_compress  # ep > 1: one thread issues every collective (CompressionHookState.inline)
    timer = GradSyncTimer(state, compression_hook, device)
    ddp.register_comm_hook(timer, _timed_hook)
    return DataParallel(module=ddp, timer=timer, hook_state=state, stats=stats)


def _hierarchical(ddp: DDP, model: nn.Module, compressor: Any, min_numel: int, device: Optional[torch.device],
                  inline_compress: bool, stats: Optional[CommStats] = None) -> DataParallel:
    """DDP over every rank with the hierarchical hook: the node-local and cross-node groups of a CommContext
    (made here, on every rank alike; the topology from torchrun's LOCAL_WORLD_SIZE / GROUP_RANK)."""
    ctx = CommContext(timeout_s=ops.collective_timeout_s() or 300.0,
                      device=device.type if device is not None else "auto", stats=stats)
    if compressor is None or getattr(compressor, "name", None) == "none":
        coll = TopoAwareCollective(ctx, algorithm="hierarchical")
        timer = GradSyncTimer(coll, topo_allreduce_hook, device)
        ddp.register_comm_hook(timer, _timed_hook)
        return DataParallel(module=ddp, timer=timer, hierarchical=ctx.topology, stats=stats)
    state = HierarchicalHookState(compressor, ctx, {p: n for n, p in model.named_parameters()},
                                  CompressionPolicy(min_numel=min_numel))
    state.inline = inline_compress
    timer = GradSyncTimer(state, compression_hook, device)
    ddp.register_comm_hook(timer, _timed_hook)
    return DataParallel(module=ddp, timer=timer, hook_state=state, hierarchical=ctx.topology, stats=stats)


class StageGradientSync:
    """Data parallel for a pipeline stage: average its gradients over ``group`` with a syncwise compressor once the
    schedule's last microbatch is done, bucket by bucket (``bucket_cap_mb``).

    Not DDP: a stage runs one backward per microbatch, and DDP's first-iteration bucket rebuild counts every
    parameter once per backward (torch 2.13: "rebuilt parameter indices size is not same as original model
    parameters size"). The sync does not overlap the backward; it overlaps nothing, and the step records it as
    exposed communication. Parameters start identical on the group (broadcast from its first rank, as DDP does).
    ``ignore``: names left alone (expert-parallel experts, summed over their own group). ``stats``: where the
    sync is counted without a compressor (the run's ``ledger.dp``; a compressor counts into its own ``stats``).
    """

    def __init__(self, module: nn.Module, compressor: Optional[Compressor], group: Any,
                 bucket_cap_mb: float = BUCKET_CAP_MB, min_numel: int = MIN_NUMEL,
                 ignore: "Optional[list[str]]" = None, stats: Optional[CommStats] = None) -> None:
        from ..compress import NoneCompressor

        self.group = group
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in (ignore or ())]
        if compressor is None:
            compressor = NoneCompressor()
            if stats is not None:
                compressor.stats = stats
        self.hook_state = CompressionHookState(compressor, process_group=group,
                                               param_names={p: n for n, p in self.params},
                                               policy=CompressionPolicy(min_numel=min_numel), dedicated_group=False)
        self.bucket_cap_mb = bucket_cap_mb
        with torch.no_grad():
            for _, p in self.params:
                ops.broadcast_from(p.data, 0, group=group, stats=None)  # setup, not step traffic: not counted

    def sync(self) -> "Callable[[], float]":
        """Average every gradient over the group (missing ones as zeros); returns the reader of the seconds it
        took (comm.timing: CUDA events on a GPU, read when the row is logged, so no host sync here)."""
        from ..compress.profile import ddp_like_buckets

        interval = timing.Interval(self.params[0][1].device if self.params else None).start()
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        named = [(n, p.grad) for n, p in self.params]
        for bucket in ddp_like_buckets(named, self.bucket_cap_mb):
            self.hook_state.average([named[i][1] for i in bucket], [named[i][0] for i in bucket])
        self.hook_state.steps += 1
        interval.stop()
        return interval.seconds
