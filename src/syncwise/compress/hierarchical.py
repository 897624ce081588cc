"""Compress only where the link is slow: the hierarchical gradient sync (``--dist.hierarchical``).

On N nodes × P ranks per node a flat compressed all-reduce sends every rank's compressed payload over the
slow inter-node links, and pays the compressor's error on all N·P contributions. Here each DDP bucket goes:

1. **intra-node reduce-scatter, full precision** (fp32 on the fast link). The model's tensors are dealt out
   to the node's P local ranks whole (in parameter order, each to the least loaded so far, the same on every
   node and in every run): local rank ``l`` receives the node's average of the tensors it owns. Tensors stay whole because the compressors work
   per tensor (PowerSGD factors matrices, top-k ranks within a tensor, per-tensor residuals).
2. **inter-node: the compressor**, on local rank ``l``'s cross-node group (the ranks with local rank ``l`` on
   every node, ``CommContext.inter_group``) over the tensors it owns: the P groups run concurrently, each
   with 1/P of the bucket. Compressor state (error feedback, PowerSGD's Q, warm-up counters) exists only for
   a rank's own tensors, so it is per-rank state as before and checkpoints in the rank's own file.
3. **intra-node all-gather** of the averaged shards.

A non-finite gradient on any rank must make every rank skip the step with the compressor's state untouched,
as the flat hook does. Each owner's segment carries one extra slot: 0, or NaN when this rank's bucket had a
non-finite value; the reduce-scatter sums it, the owner adds it to each tensor it owns (+0 changes nothing),
so the compressor sees the non-finite bucket, flags it in its own payload across nodes and leaves its state
alone; the all-gather then hands NaN to every rank of every node. No host sync: the flag stays on the device.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from ..comm import ops
from ..comm.context import CommContext
from ..errors import SyncwiseError
from .base import Compressor
from .hook import CompressionHookState, CompressionPolicy


class HierarchicalHookState(CompressionHookState):
    """A :class:`CompressionHookState` whose bucket average is hierarchical (see the module docstring).

    ``ctx``: the job's :class:`~syncwise.comm.CommContext` (its topology and node-local / cross-node groups;
    build it on every rank at the same point, it creates groups). ``hop_bytes`` counts what this rank sent
    per hop: ``intra`` (the fp32 reduce-scatter input and all-gather shard) and ``inter`` (the compressor's
    payloads), by the same rule as ``syncwise.comm.CommStats``; the collectives themselves are counted in the
    compressor's ``stats`` (a run's ``ledger.dp``), each split by its group (``comm.ops.split_bytes``: the
    node-local group's all ``intra``, the cross-node group's — one rank per node — all ``cross``), which is what the
    run's summary reports.
    """

    def __init__(self, compressor: Compressor, ctx: CommContext,
                 param_names: Union[dict[nn.Parameter, str], nn.Module, None] = None,
                 policy: Optional[CompressionPolicy] = None):
        super().__init__(compressor, process_group=None, param_names=param_names, policy=policy,
                         dedicated_group=False)
        self.ctx = ctx
        self.procs = ctx.topology.procs_per_node
        self.local_rank = ctx.topology.local_rank_of(ctx.rank)
        self.intra_group = ctx.intra_group      # None: one rank per node
        self.comm_group = ctx.inter_group       # the compressor's group; None: one node
        self.hop_bytes = {"intra": 0, "inter": 0}
        self.direct = False  # every compressor through _average_bucket (the casts and fp8 included)
        self._owners: dict[tuple, list[int]] = {}
        self._owner_of: dict[str, int] = {}
        self._load = [0] * self.procs
        for p in self._keep_alive:  # the parameters named at construction, in the model's order
            if p.requires_grad:
                self._assign(self._names[id(p)], p.numel())

    def owners(self, tensors: list[torch.Tensor], keys: list[str]) -> list[int]:
        """The local rank owning each tensor of a bucket (cached per bucket).

        Ownership is per tensor, not per bucket: DDP rebuilds its buckets after the first step, and a resumed
        run's first step uses the initial ones again, so a tensor's compressor state must not follow the bucket
        it happens to sit in. Tensors are dealt out in the model's parameter order (known ones first, then in the
        order they are first seen, the same on every node), each to the local rank with the least load so far
        (ties: the lower one): consecutive tensors, i.e. one bucket, spread over the node's ranks."""
        sig = tuple(keys)
        plan = self._owners.get(sig)
        if plan is None:
            for t, k in zip(tensors, keys):
                if k not in self._owner_of:
                    self._assign(k, t.numel())
            plan = self._owners[sig] = [self._owner_of[k] for k in keys]
        return plan

    def _assign(self, key: str, numel: int) -> None:
        o = min(range(self.procs), key=lambda r: (self._load[r], r))
        self._owner_of[key], self._load[o] = o, self._load[o] + numel

    def _average_bucket(self, tensors: list[torch.Tensor], keys: list[str], flags: list[bool]) -> None:
        if not tensors:
            return
        p, me = self.procs, self.local_rank
        plan = self.owners(tensors, keys)
        mine = [i for i in range(len(tensors)) if plan[i] == me]
        loads = [sum(tensors[i].numel() for i in range(len(tensors)) if plan[i] == o) for o in range(p)]
        seg = max(loads) + 1  # + the non-finite slot
        ref = tensors[0]
        dtype = torch.float32 if ref.dtype in (torch.float16, torch.bfloat16) else ref.dtype  # full precision
        with torch.no_grad():
            buf = torch.zeros(p * seg, dtype=dtype, device=ref.device)
            places: list[tuple[int, int]] = [(0, 0)] * len(tensors)
            fill = [o * seg for o in range(p)]
            for i, t in enumerate(tensors):
                start = fill[plan[i]]
                buf[start:start + t.numel()].copy_(t.reshape(-1))
                places[i], fill[plan[i]] = (start, t.numel()), start + t.numel()
            bad = torch.stack([torch.isfinite(t).all() for t in tensors]).all().logical_not()
            # each segment's last slot: 0, or NaN when this rank's bucket is non-finite (a device op: no host sync)
            buf.view(p, seg)[:, -1].copy_(torch.where(bad, float("nan"), 0.0).to(dtype).expand(p))
            if self.intra_group is not None:
                shard = torch.empty(seg, dtype=dtype, device=ref.device)
                ops.reduce_scatter(shard, buf, "sum", group=self.intra_group, stats=self.compressor.stats)
                shard.div_(p)
                self.hop_bytes["intra"] += (buf.numel() + seg) * buf.element_size()
            else:
                shard = buf
            if mine:
                views = [shard[places[i][0] - me * seg:places[i][0] - me * seg + places[i][1]].view(tensors[i].shape)
                         for i in mine]
                flag = shard[seg - 1]
                for v in views:
                    v.view(-1)[:1].add_(flag)  # +0, or NaN when some rank of this node was non-finite
                if self.comm_group is not None:
                    before = self.compressor._counters["bytes_sent"]
                    self.compressor.average(views, [keys[i] for i in mine], self.comm_group, [flags[i] for i in mine])
                    self.hop_bytes["inter"] += self.compressor._counters["bytes_sent"] - before
            if self.intra_group is not None:
                ops.all_gather(buf, shard, group=self.intra_group, stats=self.compressor.stats)
            for i, t in enumerate(tensors):
                start, n = places[i]
                t.copy_(buf[start:start + n].view(t.shape))

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["hierarchical"] = {"nodes": self.ctx.topology.nodes, "procs_per_node": self.procs}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("hierarchical")
        here = {"nodes": self.ctx.topology.nodes, "procs_per_node": self.procs}
        if saved != here:
            # a rank's residuals belong to the tensors it owned on the saved topology: another split would
            # apply them to the wrong tensors (or drop them)
            raise SyncwiseError(f"the compressor state was saved by a {_describe(saved)} gradient sync; this job runs "
                                f"a hierarchical one on {here['nodes']} nodes × {here['procs_per_node']} ranks: resume "
                                "on the same topology with the same --dist.hierarchical")
        super().load_state_dict({k: v for k, v in state.items() if k != "hierarchical"})


def _describe(saved: Optional[dict]) -> str:
    return "flat" if saved is None else f"hierarchical {saved['nodes']} × {saved['procs_per_node']}"
