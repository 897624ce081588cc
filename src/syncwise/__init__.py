"""syncwise: communication-efficient distributed training of language models on PyTorch.

The seed API lives at the top level: ``from syncwise import OptimizedTrainer, GradientCompressor, CommContext,
TopoAwareCollective, SmartCheckpointer, SmartPrefetcher, AsyncPipeline, CloudConfig, ConfigError``. Names are imported on first use, so
``import syncwise`` (and the command line's start-up) does not pay for torch.distributed.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "OptimizedTrainer": "syncwise.train",
    "DynamicBatcher": "syncwise.train",
    "GradientCompressor": "syncwise.compress",
    "CommContext": "syncwise.comm",
    "TopoAwareCollective": "syncwise.comm",
    "SmartCheckpointer": "syncwise.checkpoint",
    "SmartPrefetcher": "syncwise.data",
    "AsyncPipeline": "syncwise.parallel.pipeline",
    "CloudConfig": "syncwise.plan",
    "ConfigError": "syncwise.errors",
    "SyncwiseError": "syncwise.errors",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'syncwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
