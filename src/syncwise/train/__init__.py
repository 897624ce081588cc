"""Training: OptimizedTrainer (any nn.Module) and the `syncwise train` worker."""
from .dynamic_batch import DynamicBatcher, DynamicBatchOOMError
from .schedule import adamw, warmup_cosine
from .trainer import OptimizedTrainer, lm_loss

__all__ = ["OptimizedTrainer", "DynamicBatcher", "DynamicBatchOOMError", "lm_loss", "adamw", "warmup_cosine"]
