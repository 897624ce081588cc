"""Hugging Face Accelerate: ``register(accelerator, model, compressor)`` after ``accelerator.prepare``.

    model, opt, dl = accelerator.prepare(model, opt, dl)
    comp = syncwise.integrations.accelerate.register(accelerator, model, "powersgd:rank=4")
    ...
    accelerator.save_state(dir)   # holds every rank's compressor state
    accelerator.load_state(dir)   # restores it

The compressor is registered with ``accelerator.register_for_checkpointing``, so ``save_state`` /
``load_state`` carry it (it is the last registered custom object: register it in the same order on resume).
"""
from __future__ import annotations

from typing import Any

from ..compress import GradientCompressor
from ._common import CompressorLike, RankedCompressorState, compressor_from, require
from ..layout import MIN_NUMEL

require("accelerate", "accelerate", "accelerate")


class _Checkpointed(RankedCompressorState):
    def __init__(self, compressor: GradientCompressor, device: Any):
        super().__init__(compressor)
        self.device = device

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:  # accelerate passes no device
        super().load_state_dict(state, device if device is not None else self.device)


def register(accelerator: Any, model: Any, compressor: CompressorLike = "powersgd:rank=4", *,
             min_numel: int = MIN_NUMEL, min_ndim: int = 2) -> GradientCompressor:
    """Register ``compressor`` on ``model`` (as returned by ``accelerator.prepare``) and for checkpointing.

    With one process (no DDP wrapper) nothing is registered on the model, but the compressor is returned and
    checkpointed all the same, so the same script runs on 1 and on N processes.
    """
    gc = compressor_from(compressor, min_numel=min_numel, min_ndim=min_ndim)
    if hasattr(model, "register_comm_hook"):
        gc.register(model)
    accelerator.register_for_checkpointing(_Checkpointed(gc, accelerator.device))
    return gc
