"""Plain torchrun + ``DistributedDataParallel``: one call puts a syncwise compressor on the gradient sync.

    ddp = DDP(model)
    comp = syncwise.integrations.ddp.register(ddp, "powersgd:rank=4")
    ...
    torch.save({"model": ..., "compress": comp.state_dict()}, path)   # per rank: residuals differ by rank
    comp.load_state_dict(torch.load(path, weights_only=True)["compress"])  # before or after register

The state is keyed by parameter name, so it resumes even when DDP rebuilds its buckets.
"""
from __future__ import annotations

from torch import nn

from ..compress import GradientCompressor
from ..errors import ConfigError
from ._common import CompressorLike, compressor_from
from ..layout import MIN_NUMEL


def register(ddp_model: nn.Module, compressor: CompressorLike = "powersgd:rank=4", *,
             min_numel: int = MIN_NUMEL, min_ndim: int = 2) -> GradientCompressor:
    """Register ``compressor`` as the comm hook of ``ddp_model`` (a DistributedDataParallel, before its first
    backward); returns the :class:`GradientCompressor`, whose ``state_dict()`` belongs in each rank's checkpoint."""
    if not hasattr(ddp_model, "register_comm_hook"):
        raise ConfigError("ddp_model", type(ddp_model).__name__,
                          "a torch.nn.parallel.DistributedDataParallel (wrap the model first)")
    gc = compressor_from(compressor, min_numel=min_numel, min_ndim=min_ndim)
    gc.register(ddp_model)
    return gc
