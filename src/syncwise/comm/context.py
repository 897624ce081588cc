"""CommContext: one object that owns the process group, the node topology and its subgroups.

``CommContext("nccl")`` / ``CommContext()`` initialises the default process group from torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) unless one
already exists, builds the node-local and cross-node subgroups once (collectively, in the same order on
every rank) and tears everything down on ``close()`` / leaving a ``with`` block. Destroying the group
explicitly matters: without it DDP runs on gloo sometimes abort at interpreter exit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from syncwise import devices
from syncwise.errors import ConfigError, SyncwiseError

from . import ops
from .stats import CommStats

BACKENDS = devices.BACKENDS
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``procs_per_node`` ranks, numbered node-major (ranks 0..P-1 on node 0, ...)."""

    nodes: int
    procs_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"topology.{name}", value, "an integer >= 1")

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.procs_per_node

    @property
    def is_trivial(self) -> bool:
        """True when hierarchy buys nothing (one node, or one process per node)."""
        return self.nodes == 1 or self.procs_per_node == 1

    def node_of(self, rank: int) -> int:
        """Node index of global ``rank``."""
        return rank // self.procs_per_node

    def local_rank_of(self, rank: int) -> int:
        """Rank of global ``rank`` within its node."""
        return rank % self.procs_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks living on ``node``."""
        return list(range(node * self.procs_per_node, (node + 1) * self.procs_per_node))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with the same ``local_rank`` on every node (one per node)."""
        return [n * self.procs_per_node + local_rank for n in range(self.nodes)]

    @classmethod
    def from_env(cls, world_size: Optional[int] = None) -> "Topology":
        """Read torchrun's LOCAL_WORLD_SIZE (and WORLD_SIZE); without it, assume a single node."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local < 1 or world % local:
            # torchrun allows uneven nodes; hierarchical collectives need equal ones.
            raise ConfigError("LOCAL_WORLD_SIZE", local,
                              f"a divisor of WORLD_SIZE={world} (every node must run the same number of workers)")
        topo = cls(nodes=world // local, procs_per_node=local)
        if "GROUP_RANK" in os.environ and "RANK" in os.environ:
            rank, group_rank = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
            if topo.node_of(rank) != group_rank:
                raise SyncwiseError(
                    f"rank {rank} runs on node GROUP_RANK={group_rank} but node-major numbering puts it on node "
                    f"{topo.node_of(rank)}; pass an explicit Topology(nodes, procs_per_node) that matches the launch.")
        return topo


def resolve_backend(backend: str, device: str = "auto") -> str:
    """The backend this worker's group uses: ``syncwise.devices``' rule ('auto' -> nccl when every local worker
    has a GPU of its own, else gloo); validates the names."""
    return devices.plan_here(device, backend, names=devices.API_NAMES).backend


def _is_timeout(exc: BaseException) -> bool:
    return ops.timed_out(exc)


class CommContext:
    """Process group + topology + node-local / cross-node subgroups, with instrumented collectives.

    ``timeout_s`` bounds every collective of groups this context creates (gloo honours the process
    group timeout): a hung peer turns into a :class:`SyncwiseError` instead of a silent hang.
    If the default group already exists, it is reused (and not destroyed by ``close()``).

    ``device`` ('auto', 'cpu', 'cuda') and ``backend`` follow ``syncwise.devices``: local rank r computes on
    ``cuda:(r mod GPUs)``; 'auto' picks NCCL only when every local worker has a GPU of its own (ranks sharing
    a GPU use gloo, which NCCL refuses). ``.device`` is this rank's device (set as the current CUDA device).

    ``stats``: where its collectives are counted (``.stats``; default: a :class:`CommStats` of its own).
    """

    def __init__(self, backend: str = "auto", timeout_s: float = 300.0, topology: Optional[Topology] = None,
                 stats: Optional[CommStats] = None, device: str = "auto") -> None:
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError("timeout_s", timeout_s, "a positive number of seconds")
        self.timeout_s = float(timeout_s)
        self.stats = stats if stats is not None else CommStats()  # the context's own counts unless given a run's
        self._owns_default = False
        self._closed = False
        local_rank, local_world = devices.local_env()
        if not dist.is_initialized():
            placement = devices.plan_here(device, backend, local_world, names=devices.API_NAMES)
            missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
            if missing:
                raise SyncwiseError(
                    f"cannot initialise the process group: {', '.join(missing)} not set. Start the program with "
                    "torchrun (`syncwise train` starts its workers that way), which sets them for every worker.")
            self.backend, self.device = placement.backend, placement.device(local_rank)
            if self.device.type == "cuda":
                # Must be set before NCCL creates its communicators; gloo's CUDA tensors use it too.
                torch.cuda.set_device(self.device)
            # NCCL as devices.NCCL_PROCESS_GROUP: CPU control tensors (comm-bench's checks) have a communicator too.
            ops.declare_backend(devices.process_group_backend("nccl" if self.device.type == "cpu" else self.backend))
            extra = {"device_id": self.device} if self.backend == "nccl" else {}
            from ..bind import gloo_env, store_kwargs  # (rank 0's store on the job's address only: bind.py)

            extra.update(store_kwargs(timedelta(seconds=self.timeout_s)))
            gloo_env(devices.process_group_backend(self.backend))  # gloo's interface and lazy pairs (bind.py)
            dist.init_process_group(devices.process_group_backend(self.backend),
                                    timeout=ops.backend_timeout(self.timeout_s, self.backend) or
                                    timedelta(seconds=self.timeout_s), **extra)
            self._owns_default = True
        else:
            existing = str(dist.get_backend())
            if backend not in BACKENDS:
                raise ConfigError("backend", backend, "one of: " + ", ".join(BACKENDS))
            if backend != "auto" and backend not in existing:
                raise ConfigError("backend", backend,
                                  f"'auto' or {existing!r} (the process group is already initialised with it)")
            self.backend = existing
            if "nccl" in existing:  # an NCCL group is bound to the device its creator set
                self.device = torch.device("cuda", torch.cuda.current_device())
            else:  # gloo: the device the rule gives this local rank
                self.device = devices.plan_here(device, "gloo", local_world, names=devices.API_NAMES).device(
                    min(local_rank, local_world - 1))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.topology = topology if topology is not None else Topology.from_env(self.world_size)
        if self.topology.world_size != self.world_size:
            raise ConfigError("topology", self.topology,
                              f"nodes * procs_per_node == world size {self.world_size}")
        ops.declare_topology(self.topology.procs_per_node)  # which hop each group's collectives cross
        self._subgroups: list = []
        self.intra_group, self.inter_group = self._build_subgroups()

    # -- topology ----------------------------------------------------------------------------------
    def get_rank(self) -> int:
        """Global rank of this process."""
        return self.rank

    def get_world_size(self) -> int:
        """Number of processes in the default group."""
        return self.world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node."""
        return self.topology.local_rank_of(self.rank)

    @property
    def local_world_size(self) -> int:
        """Processes per node."""
        return self.topology.procs_per_node

    @property
    def node_rank(self) -> int:
        """Index of this node."""
        return self.topology.node_of(self.rank)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.topology.nodes

    def _build_subgroups(self):
        """Create the node-local and cross-node groups; ``None`` stands for a group of one rank.

        Every rank must create every group in the same order, so both enumerations are issued on all
        ranks; groups that would coincide with WORLD reuse it instead of opening new connections.
        """
        topo = self.topology
        timeout = ops.backend_timeout(self.timeout_s, self.backend) or timedelta(seconds=self.timeout_s)
        world = dist.group.WORLD
        if topo.nodes == 1:
            return world, None
        if topo.procs_per_node == 1:
            return None, world
        intra, intra_all = dist.new_subgroups_by_enumeration(
            [topo.node_ranks(n) for n in range(topo.nodes)], timeout=timeout)
        inter, inter_all = dist.new_subgroups_by_enumeration(
            [topo.cross_ranks(lr) for lr in range(topo.procs_per_node)], timeout=timeout)
        self._subgroups = list(intra_all) + list(inter_all)
        return intra, inter

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, local: torch.Tensor, out: Optional[torch.Tensor] = None, op: str = "sum",
                   group=None) -> torch.Tensor:
        """Reduce ``local`` over all ranks into ``out`` (or in place when ``out`` is None); return it."""
        if op not in REDUCE_OPS:
            raise ConfigError("op", op, ", ".join(REDUCE_OPS))
        if out is None:
            out = local
        elif out is not local:
            if out.shape != local.shape or out.dtype != local.dtype:
                raise SyncwiseError(f"all_reduce: out has shape {tuple(out.shape)} / {out.dtype}, "
                                    f"local has {tuple(local.shape)} / {local.dtype}; they must match")
            out.copy_(local)
        self._guard("all_reduce", lambda: ops.all_reduce(out, op, group=group, stats=self.stats))
        return out

    def barrier(self) -> None:
        """Wait for every rank (fails with a SyncwiseError after ``timeout_s``)."""
        self._guard("barrier", lambda: ops.barrier())

    def _guard(self, name: str, fn) -> None:
        if self._closed:
            raise SyncwiseError(f"{name} called on a closed CommContext")
        try:
            fn()
        except RuntimeError as exc:
            if not _is_timeout(exc):
                raise
            raise SyncwiseError(
                f"{name} on rank {self.rank} of {self.world_size} did not complete within the process group "
                f"timeout ({self.timeout_s:g} s): another rank is stuck, dead, or issuing a different collective. "
                f"Check the other ranks' logs; raise timeout_s only if the peers are merely slow. ({exc})") from exc

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the subgroups and, if this context created it, the default process group."""
        if self._closed:
            return
        self._closed = True
        if not dist.is_initialized():
            return
        for g in self._subgroups:
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self._subgroups = []
        if self._owns_default:
            dist.destroy_process_group()

    def __enter__(self) -> "CommContext":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CommContext(backend={self.backend!r}, device={str(self.device)!r}, rank={self.rank}, "
                f"world_size={self.world_size}, topology={self.topology})")
