"""The Python API's arguments, in the spellings users write (seed code, Lightning, Accelerate), checked up front.

One owner per rule: ``OptimizedTrainer`` and ``train()`` call these; each bad value raises the library's
``ConfigError`` naming the argument, before anything is built.
"""
from __future__ import annotations

import atexit
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import devices, schema
from ..comm import ops
from ..errors import ConfigError

def mixed_precision_mode(value: Any) -> str:
    """'none' | 'bf16' | 'fp16' | 'auto' from any of its spellings (False/None/'fp32'/'no', True ('auto': bf16 on a
    GPU that has it), names and torch dtypes): ``syncwise.schema.MIXED_PRECISION``'s rule, the command line's too."""
    return schema.MIXED_PRECISION.validate("mixed_precision", value)


def resume_mode(value: Any) -> Optional[str]:
    """None (fresh), 'auto' (newest valid checkpoint, if any) or a checkpoint path, from True/False/None/'auto'/
    'none'/paths."""
    if value is None or value is False:
        return None
    if value is True:
        return "auto"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        low = value.strip().lower()
        if low in ("none", "auto"):
            return None if low == "none" else "auto"
        if os.path.isdir(value):
            return value
        raise ConfigError("resume", value, "True or 'auto' (newest valid checkpoint), False/None (fresh), or the path "
                          f"of a checkpoint directory (there is no directory {value!r})")
    raise ConfigError("resume", value, "True or 'auto' (newest valid checkpoint), False/None (fresh), or the path "
                      "of a checkpoint directory")


def finite(name: str, value: Any, minimum: float = 0.0, inclusive: bool = True) -> float:
    """A finite number ≥ ``minimum`` (> when not ``inclusive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= minimum if inclusive else value > minimum)
    if not ok:
        raise ConfigError(name, value, f"a finite number {'≥' if inclusive else '>'} {minimum:g}")
    return float(value)


def join_torchrun(device: torch.device, timeout_s: Optional[float] = None, backend: str = "auto") -> bool:
    """Join the job torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless a
    process group exists already. Returns True if this call created the group; it is then destroyed at exit (a DDP
    process that exits with a live group can abort).

    ``backend='auto'`` follows ``syncwise.devices``: NCCL only where this rank's device is the GPU the rule gives
    it under NCCL (``cuda:LOCAL_RANK``, every local rank with a GPU of its own), gloo otherwise — on the CPU, and
    when ranks share a GPU, which NCCL refuses ('Duplicate GPU detected'). An index-less 'cuda' is the current
    CUDA device. NCCL joins as ``devices.NCCL_PROCESS_GROUP`` ('cuda:nccl,cpu:gloo': CPU control tensors have a
    communicator too), after ``torch.cuda.set_device``."""
    if not dist.is_available() or dist.is_initialized():
        return False
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    device = devices.resolve(device)
    local_rank, local_world = devices.local_env()
    if backend == "auto":
        backend = devices.backend_for(device, local_rank, local_world, devices.visible_gpus(),
                                      devices.nccl_available())
    elif backend not in devices.BACKENDS:
        raise ConfigError("backend", backend, "one of: " + ", ".join(devices.BACKENDS))
    elif backend == "nccl" and device.type != "cuda":
        raise ConfigError("backend", backend, f"auto or gloo for a model on {device} (NCCL moves only CUDA tensors)")
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if timeout_s:  # NCCL's above syncwise's own, so syncwise's hang report comes first (comm.ops.backend_timeout)
        kwargs["timeout"] = ops.backend_timeout(timeout_s, backend)
    if device.type == "cuda":
        # Before any CUDA tensor or communicator: control tensors made with current_device() (checkpointer,
        # DCP, DTensor) must land on this rank's GPU, not cuda:0 (issue 24).
        torch.cuda.set_device(device)
    # The strict-devices check (comm.ops) holds the groups to their GPU-run backend: this one on NCCL, NCCL's
    # on gloo (a CPU run: the same code on GPUs would get devices.NCCL_PROCESS_GROUP).
    ops.declare_backend(devices.process_group_backend("nccl") if backend == "gloo" and device.type == "cpu"
                        else devices.process_group_backend(backend))
    from ..bind import gloo_env, store_kwargs  # (rank 0's store listens on the job's address only: bind.py)

    kwargs.update(store_kwargs(kwargs.get("timeout")))
    gloo_env(devices.process_group_backend(backend))  # gloo's interface and lazy pairs (bind.py)
    dist.init_process_group(devices.process_group_backend(backend), **kwargs)
    atexit.register(_leave)
    return True


def _leave() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def as_path(name: str, value: Any) -> Optional[str]:
    """A directory argument: None, a str or a PathLike."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return str(Path(value))
    raise ConfigError(name, value, "a directory path (str or pathlib.Path) or None")
