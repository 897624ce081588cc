"""Parallelism applied outside the model: DDP + hooks, local SGD / DiLoCo / Pipe-SGD, activation checkpointing."""
from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import DataParallel, GradSyncTimer, TorchHookSpec, apply_data_parallel
from .local_sgd import LocalSGD, TorchPeriodicAveraging
from .pipe_sgd import PipeSGD
from .sync import build_sync
from .sync_spec import SyncSpec, SyncStrategy

__all__ = ["apply_data_parallel", "TorchHookSpec", "DataParallel", "GradSyncTimer", "apply_activation_checkpointing",
           "LocalSGD", "TorchPeriodicAveraging", "PipeSGD", "SyncSpec", "SyncStrategy", "build_sync"]
