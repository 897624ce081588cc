"""Training: OptimizedTrainer (any nn.Module), its option groups, and the `syncwise train` worker."""
from .dynamic_batch import DynamicBatcher, DynamicBatchOOMError
from .options import CommOptions, FaultOptions, RunOptions, StepOptions
from .schedule import adamw, warmup_cosine
from .trainer import OptimizedTrainer, lm_loss

__all__ = ["OptimizedTrainer", "CommOptions", "StepOptions", "RunOptions", "FaultOptions", "DynamicBatcher",
           "DynamicBatchOOMError", "lm_loss", "adamw", "warmup_cosine"]
