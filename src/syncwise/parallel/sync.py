"""Build the sync strategy a ``--sync`` spec names (the parsing lives in ``sync_spec.py``)."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from ..comm.stats import CommStats
from .local_sgd import LocalSGD, TorchPeriodicAveraging
from .pipe_sgd import PipeSGD
from .sparseloco import SparseLoCo
from .streaming import StreamingDiLoCo
from .sync_spec import SyncSpec, SyncStrategy


def build_sync(spec: "str | SyncSpec | None", model: nn.Module, group: Any = None,
               stats: Optional[CommStats] = None) -> Optional[SyncStrategy]:
    """The object a ``--sync`` spec names (LocalSGD, TorchPeriodicAveraging, PipeSGD, SparseLoCo,
    StreamingDiLoCo); None for every-step
    sync or a single process. ``stats``: where its collectives are counted (a run's ``ledger.dp``; default: the
    strategy's own ``stats``)."""
    if isinstance(spec, str):
        spec = SyncSpec.parse(spec)
    if spec is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    cls = {"torch-localsgd": TorchPeriodicAveraging, "pipesgd": PipeSGD, "sparseloco": SparseLoCo,
           "streaming": StreamingDiLoCo}.get(spec.method, LocalSGD)
    return cls(model, spec, group=group, stats=stats)
