"""Parallelism applied outside the model: data parallel (DDP + hooks), activation checkpointing."""
from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import DataParallel, GradSyncTimer, TorchHookSpec, apply_data_parallel

__all__ = ["apply_data_parallel", "TorchHookSpec", "DataParallel", "GradSyncTimer", "apply_activation_checkpointing"]
