"""Training: OptimizedTrainer (any nn.Module) and the `syncwise train` worker."""
from .schedule import adamw, warmup_cosine
from .trainer import OptimizedTrainer, lm_loss

__all__ = ["OptimizedTrainer", "lm_loss", "adamw", "warmup_cosine"]
