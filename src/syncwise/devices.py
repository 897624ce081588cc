"""Which device a worker computes on, and which process-group backend goes with it: the one owner of the rule.

A leaf module (like ``errors``): config, comm, data and train all ask it, none of them repeats it.

The rule (issue 14; FIELD-NOTES "On a GPU"):

- ``device='cpu'``: every rank on the CPU, over gloo (NCCL moves only CUDA tensors: nccl + cpu is an error).
- ``device='cuda'``: local rank ``r`` on ``cuda:(r mod G)``, G = the GPUs this process sees
  (``CUDA_VISIBLE_DEVICES`` applies). Under NCCL every rank needs a GPU of its own — NCCL refuses two
  ranks on one GPU ("Duplicate GPU detected") — so nccl is valid only with at most G local ranks, and then
  rank ``r`` is on ``cuda:r``. gloo moves CUDA tensors too and lets several ranks share one GPU (measured:
  DDP and every compressor, replicas identical), so with more ranks than GPUs they share them round-robin.
- ``device='auto'``: ``cuda`` when a GPU is visible, else ``cpu``.
- ``backend='auto'``: nccl when the device is CUDA and every local rank has a GPU of its own (and this
  torch has NCCL), else gloo — so the default 2-worker job runs on a one-GPU machine, both ranks on
  ``cuda:0`` over gloo, and :attr:`Placement.note` says so and how to get NCCL.
- The network lab's nodes are namespaces of one machine: all of them share its GPUs, so the lab runs on gloo.
- Live recovery (issue 39 row N6): the cross-replica gradient traffic goes over NCCL when the replicas compute on
  CUDA and over gloo on the CPU (:func:`replica_backend`); on one machine each replica group gets GPUs of its own,
  ``r*nproc .. r*nproc+nproc-1``, through ``CUDA_VISIBLE_DEVICES`` (:func:`replica_visible_devices`), refused in
  one line when the machine has fewer than ``replicas*nproc``.

:func:`plan` and :func:`assign` are pure (tests pass the GPU count); :func:`plan_here`, :func:`visible_gpus`,
:func:`local_env` and :func:`resolve` read this machine and process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ConfigError, SyncwiseError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class Names:
    """What the caller calls the three inputs, so an error names the field the user set."""

    device: str = "dist.device"
    backend: str = "dist.backend"
    workers: str = "dist.nproc"


CONFIG_NAMES = Names()
API_NAMES = Names("device", "backend", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Placement:
    """Where the ``local_world_size`` workers on one machine compute and how they talk."""

    device_type: str        # 'cpu' or 'cuda'
    backend: str            # 'gloo' or 'nccl'
    local_world_size: int
    gpus: int               # GPUs visible to the process (0 on the CPU)
    backend_chosen: bool    # True when backend='auto' picked it
    lab: bool = False       # the network lab: its nodes share this machine's GPUs

    @property
    def ranks_per_gpu(self) -> int:
        """Workers on the busiest GPU (0 on the CPU)."""
        if self.device_type != "cuda":
            return 0
        return -(-self.local_world_size // self.gpus)

    @property
    def shared(self) -> bool:
        """True when some GPU runs more than one worker (gloo only)."""
        return self.ranks_per_gpu > 1

    def device(self, local_rank: int) -> torch.device:
        """The device of local rank ``local_rank``."""
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not (
                0 <= local_rank < self.local_world_size):
            raise ConfigError("LOCAL_RANK", local_rank, f"an integer from 0 to {self.local_world_size - 1} "
                              f"(the local rank of one of {self.local_world_size} local workers)")
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", local_rank % self.gpus)

    @property
    def note(self) -> str:
        """One line for the user when 'auto' made the ranks share GPUs over gloo ('' otherwise)."""
        if not (self.shared and self.backend_chosen) or self.lab:
            return ""
        gpus = "1 GPU" if self.gpus == 1 else f"{self.gpus} GPUs ({self.ranks_per_gpu} per GPU at most)"
        return (f"{self.local_world_size} workers share {gpus} over gloo, since NCCL needs a GPU of its own for every "
                f"worker; for NCCL run {self.gpus} worker{'s' if self.gpus > 1 else ''} per machine "
                f"(--nproc {self.gpus})")

    def describe(self) -> str:
        """e.g. 'cuda:0..1 over nccl' / 'cpu over gloo'."""
        if self.device_type == "cpu":
            return "cpu over gloo"
        used = min(self.gpus, self.local_world_size)
        where = "cuda:0" if used == 1 else f"cuda:0..{used - 1}"
        return f"{where} over {self.backend}" + (f" ({self.ranks_per_gpu} workers per GPU)" if self.shared else "")


def plan(device: str = "auto", backend: str = "auto", local_world_size: int = 1, visible_gpus: int = 0, *,
         nccl_available: bool = True, lab: bool = False, names: Names = CONFIG_NAMES) -> Placement:
    """The placement of ``local_world_size`` workers on a machine with ``visible_gpus`` GPUs, or a ConfigError
    naming the field (in ``names``), the value and what is accepted. Pure: nothing is read from the machine."""
    if device not in DEVICES:
        raise ConfigError(names.device, device, "one of: " + ", ".join(DEVICES))
    if backend not in BACKENDS:
        raise ConfigError(names.backend, backend, "one of: " + ", ".join(BACKENDS))
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ConfigError(names.workers, local_world_size, "an integer ≥ 1 (workers on this machine)")
    if isinstance(visible_gpus, bool) or not isinstance(visible_gpus, int) or visible_gpus < 0:
        raise ConfigError("visible_gpus", visible_gpus, "an integer ≥ 0")
    kind = device if device != "auto" else ("cuda" if visible_gpus > 0 else "cpu")
    if kind == "cuda" and visible_gpus == 0:
        raise ConfigError(names.device, device, "auto or cpu: no CUDA GPU is visible to this process "
                          "(torch.cuda.is_available() is False: a CPU build of torch, no driver, or an empty "
                          "CUDA_VISIBLE_DEVICES)")
    if kind == "cpu":
        if backend == "nccl":
            raise ConfigError(names.backend, backend, "auto or gloo on a machine without CUDA (nccl needs GPUs)"
                              if device == "auto" else f"auto or gloo with {names.device}=cpu (NCCL moves only "
                              "CUDA tensors)")
        return Placement("cpu", "gloo", local_world_size, 0, backend == "auto")
    own_gpus = local_world_size <= visible_gpus and not lab
    if backend == "nccl":
        if not nccl_available:
            raise ConfigError(names.backend, backend, "auto or gloo: this torch was built without NCCL")
        if lab:
            raise ConfigError(names.backend, backend, "auto or gloo with the network lab: its nodes are namespaces "
                              "of this one machine and share its GPUs, and NCCL needs a GPU of its own for every "
                              "rank of the job")
        if not own_gpus:
            raise ConfigError(names.workers, local_world_size,
                              f"at most {visible_gpus} local worker(s) with {names.backend}=nccl, one GPU each (NCCL "
                              "refuses two ranks on one GPU: 'Duplicate GPU detected'), or "
                              f"{names.backend}=auto or gloo, whose ranks can share a GPU; {local_world_size} "
                              f"local workers, {visible_gpus} GPU(s) visible")
        return Placement("cuda", "nccl", local_world_size, visible_gpus, False)
    if backend == "auto":
        chosen = "nccl" if own_gpus and nccl_available else "gloo"
        return Placement("cuda", chosen, local_world_size, visible_gpus, True, lab)
    return Placement("cuda", "gloo", local_world_size, visible_gpus, False, lab)


def assign(device: str, backend: str, local_rank: int, local_world_size: int, visible_gpus: int, **kw) -> torch.device:
    """The device of local rank ``local_rank`` (pure; see :func:`plan` for the rule and the errors)."""
    return plan(device, backend, local_world_size, visible_gpus, **kw).device(local_rank)


def backend_for(device: torch.device, local_rank: int, local_world_size: int, visible_gpus: int,
                nccl_available: bool = True) -> str:
    """The backend for a worker that already chose ``device`` (the Python API: the model's device).

    nccl only where the rule's NCCL placement puts this rank exactly there (``cuda:local_rank``, every local rank
    with a GPU of its own); anything else — the CPU, ranks sharing a GPU, a hand-made mapping — gets gloo, which
    is correct for all of them (NCCL would fail with 'Duplicate GPU detected' when two ranks share a GPU).
    """
    if device.type != "cuda" or not nccl_available or not 0 <= local_rank < local_world_size:
        return "gloo"
    if local_world_size > visible_gpus:
        return "gloo"
    return "nccl" if device == torch.device("cuda", local_rank) else "gloo"


#: What ``init_process_group`` gets for a job that chose NCCL (issue 24). A device->backend map, as torchtitan
#: does: CUDA tensors go to NCCL, CPU tensors to a gloo communicator over the same ranks. Control values that
#: live on the host (the restart count ``resume_target`` agrees on, clipping fallbacks, object collectives,
#: DCP's planning) are then legal on every group: ``new_group`` without a backend and ``init_device_mesh``'s
#: subgroups (``new_group`` or ``split_group``) inherit the parent's backend string, so both halves exist
#: everywhere (torch 2.13 ``distributed_c10d._new_group_with_tag`` / ``split_group``). A plain "nccl" group has
#: no CPU backend: "No backend type associated with device type cpu" before step 1 (the bug of issue 24).
NCCL_PROCESS_GROUP = "cuda:nccl,cpu:gloo"


def process_group_backend(backend: str) -> str:
    """The backend string ``init_process_group`` gets for a chosen backend: 'nccl' becomes
    :data:`NCCL_PROCESS_GROUP` (CPU control tensors go to gloo); 'gloo' stays 'gloo' (it moves CPU and CUDA
    tensors). The one place both the worker and the Python API (``train.arguments.join_torchrun``) ask."""
    if backend == "nccl":
        return NCCL_PROCESS_GROUP
    if backend == "gloo":
        return "gloo"
    raise ConfigError("backend", backend, "nccl or gloo (a chosen backend, not 'auto')")


# -- this machine and process --------------------------------------------------------------------------------
def visible_gpus() -> int:
    """CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_available() -> bool:
    """Whether this torch has the NCCL backend."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def gpu_memory_bytes(index: int = 0) -> int:
    """Total memory of visible GPU ``index``."""
    return torch.cuda.get_device_properties(index).total_memory


def local_env() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) from torchrun's environment; (0, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    return int(os.environ.get("LOCAL_RANK", "0") or 0), local_world


def plan_here(device: str = "auto", backend: str = "auto", local_world_size: Optional[int] = None, *,
              lab: bool = False, names: Names = CONFIG_NAMES) -> Placement:
    """:func:`plan` for this machine: its visible GPUs and NCCL; the local worker count from torchrun's
    environment unless given."""
    if local_world_size is None:
        local_world_size = local_env()[1]
    return plan(device, backend, local_world_size, visible_gpus(), nccl_available=nccl_available(), lab=lab,
                names=names)


def resolve(device: str | torch.device, name: str = "device") -> torch.device:
    """A usable ``torch.device``: an index-less 'cuda' becomes the current CUDA device; a CUDA device on a machine
    without CUDA, or past the visible GPUs, is a ConfigError naming ``name``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(name, device, "a torch device: 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type != "cuda":
        return dev
    gpus = visible_gpus()
    if gpus == 0:
        raise ConfigError(name, device, "'cpu' (or None): no CUDA GPU is visible to this process "
                          "(torch.cuda.is_available() is False)")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= gpus:
        raise ConfigError(name, device, f"'cpu', 'cuda' or 'cuda:N' with N from 0 to {gpus - 1} (the visible GPUs)")
    return dev


# -- live recovery: the cross-replica group and each replica group's GPUs (issue 39 row N6) ------------------
#: Live recovery's cross-replica process group (one of torchft's reconfigurable groups) for the device the replicas
#: compute on. The gradient buckets cross replicas where they are: NCCL moves CUDA tensors GPU to GPU (torchft's
#: ``ProcessGroupNCCL``, aborted and rebuilt at each new quorum); gloo with CUDA tensors would copy every bucket to
#: the host, over TCP and back, every step. The one rule: the worker builds its group from it
#: (``train.live_recovery.replica_process_group``) and refuses a tensor on the other side (:func:`check_replica_wire`).
REPLICA_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def replica_backend(device_type: str) -> str:
    """The cross-replica group's backend for replicas computing on ``device_type`` ('cpu' → gloo, 'cuda' → nccl)."""
    try:
        return REPLICA_BACKENDS[device_type]
    except KeyError:
        raise ConfigError("device", device_type, "cpu or cuda (live recovery's cross-replica group: gloo for the "
                          "CPU, NCCL for CUDA)") from None


def check_replica_wire(backend: str, device: "torch.device | str") -> None:
    """Refuse a tensor on ``device`` for the cross-replica group of ``backend``: a CUDA tensor on gloo (which would
    take it through the host silently, every step) or a CPU tensor on NCCL. A SyncwiseError in one line."""
    kind = torch.device(device).type
    wanted = REPLICA_BACKENDS.get(kind)
    if wanted != backend:
        raise SyncwiseError(f"live recovery: a {kind} tensor was handed to the {backend} cross-replica group; "
                            f"{kind} tensors cross replicas over {wanted or 'no supported group'} "
                            "(syncwise.devices.replica_backend: the group is built from the replicas' device)")


def replica_gpus(replica: int, replicas: int, nproc: int, visible_gpus: int) -> range:
    """The GPUs (indices into the launcher's visible GPUs) of replica group ``replica`` when ``replicas`` groups of
    ``nproc`` workers share one machine: ``replica*nproc .. replica*nproc+nproc-1``. Every worker of the job needs a
    GPU of its own: the cross-replica NCCL group pairs rank k of every group, and NCCL refuses two ranks of one
    communicator on one GPU ('Duplicate GPU detected'). Fewer GPUs: a ConfigError in one line. Pure."""
    need = replicas * nproc
    if need > visible_gpus:
        fits = visible_gpus // nproc if nproc else 0
        raise ConfigError("ft.replicas", replicas,
                          f"at most {fits} replica group(s) of {nproc} worker(s) on this machine's {visible_gpus} "
                          f"GPU(s): every replica group needs GPUs of its own ({need} in all; live recovery's "
                          "cross-replica NCCL group pairs rank k of every group, and NCCL refuses two ranks on one "
                          "GPU), or dist.device=cpu")
    if not 0 <= replica < replicas:
        raise ConfigError("replica", replica, f"an integer from 0 to {replicas - 1}")
    return range(replica * nproc, replica * nproc + nproc)


def replica_visible_devices(device: str, replica: int, replicas: int, nproc: int, visible_gpus: int,
                            parent: Optional[str] = None) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for replica group ``replica`` of a live-recovery job on one machine (None: leave the
    environment as it is: the job computes on the CPU). ``device``: the job's dist.device ('auto' is CUDA when a
    GPU is visible). ``parent``: the launcher's own ``CUDA_VISIBLE_DEVICES`` (None: unset), whose list the ranges
    index, so a job given GPUs 4-7 splits those. Pure (see :func:`replica_gpus` for the rule and the refusal)."""
    if device not in DEVICES:
        raise ConfigError("dist.device", device, "one of: " + ", ".join(DEVICES))
    if device == "cpu" or (device == "auto" and visible_gpus == 0):
        return None
    if visible_gpus == 0:
        raise ConfigError("dist.device", device, "auto or cpu: no CUDA GPU is visible to the launcher")
    gpus = replica_gpus(replica, replicas, nproc, visible_gpus)
    listed = [s.strip() for s in parent.split(",") if s.strip()] if parent else []
    ids = [listed[i] for i in gpus] if len(listed) >= visible_gpus else [str(i) for i in gpus]
    return ",".join(ids)
