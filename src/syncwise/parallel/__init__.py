"""Parallelism applied outside the model, through one seam (``parallelize``): activation checkpointing, tensor
parallel, expert parallel, the pipeline split, DDP + hooks or FSDP2, local SGD / DiLoCo / Pipe-SGD, compile."""
from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import DataParallel, GradSyncTimer, TorchHookSpec, apply_data_parallel
from .local_sgd import LocalSGD, TorchPeriodicAveraging
from .sparseloco import SparseLoCo
from .streaming import StreamingDiLoCo
from .mesh import ParallelSpec, build_mesh
from .parallelize import Parallelized, describe_layout, parallelize, rebind_optimizer
from .pipe_sgd import PipeSGD
from .sync import build_sync
from .sync_spec import SyncSpec, SyncStrategy

__all__ = ["parallelize", "Parallelized", "ParallelSpec", "build_mesh", "describe_layout", "rebind_optimizer",
           "apply_data_parallel", "TorchHookSpec", "DataParallel", "GradSyncTimer", "apply_activation_checkpointing",
           "LocalSGD", "TorchPeriodicAveraging", "PipeSGD", "SparseLoCo", "StreamingDiLoCo",
           "SyncSpec", "SyncStrategy", "build_sync",
           "AsyncPipeline", "apply_expert_parallel"]


def __getattr__(name: str):
    # Imported on first use: expert_parallel pulls in torch._dynamo (~1 s), pipeline torch's pipelining.
    if name == "AsyncPipeline":
        from .pipeline import AsyncPipeline
        return AsyncPipeline
    if name == "apply_expert_parallel":
        from .expert_parallel import apply_expert_parallel
        return apply_expert_parallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
