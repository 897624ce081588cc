"""Training: OptimizedTrainer (any nn.Module), its option groups, and the `syncwise train` worker.

Names are imported on first use (as ``syncwise``'s are), so the torch-free parts of this package (the fault specs,
``syncwise.train.faults``, which the command line parses before any worker starts) load without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> submodule that defines it
_EXPORTS = {
    "OptimizedTrainer": "trainer", "lm_loss": "trainer",
    "CommOptions": "options", "FaultOptions": "options", "RunOptions": "options", "StepOptions": "options",
    "DynamicBatcher": "dynamic_batch", "DynamicBatchOOMError": "dynamic_batch",
    "adamw": "schedule", "warmup_cosine": "schedule",
}
__all__ = ["OptimizedTrainer", "CommOptions", "StepOptions", "RunOptions", "FaultOptions", "DynamicBatcher",
           "DynamicBatchOOMError", "lm_loss", "adamw", "warmup_cosine"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'syncwise.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
