"""PyTorch Lightning: a callback that puts a syncwise compressor on DDP's gradient sync.

    trainer = L.Trainer(strategy="ddp", callbacks=[SyncwiseCallback("powersgd:rank=4")])

It registers the comm hook once Lightning has wrapped the module in DDP (``on_fit_start``; Lightning's own
``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only), and its state — every rank's compressor
state, residuals included — goes into Lightning's checkpoints and comes back on ``fit(ckpt_path=...)``.
"""
from __future__ import annotations

from typing import Any

from ._common import CompressorLike, RankedCompressorState, compressor_from, require
from ..layout import MIN_NUMEL

_L = require("lightning.pytorch", "lightning", "lightning")


class SyncwiseCallback(_L.Callback):
    """Compress DDP's gradient all-reduce with a syncwise compressor (a spec such as ``"powersgd:rank=4"``,
    a Compressor or a GradientCompressor); ``min_numel``: smaller tensors go as fp32."""

    def __init__(self, compressor: CompressorLike = "powersgd:rank=4", *, min_numel: int = MIN_NUMEL, min_ndim: int = 2):
        self.compressor = compressor_from(compressor, min_numel=min_numel, min_ndim=min_ndim)
        self._state = RankedCompressorState(self.compressor)
        self.registered = False

    @property
    def state_key(self) -> str:
        return f"SyncwiseCallback[{self.compressor.compressor.name}]"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        if self.registered or not hasattr(model, "register_comm_hook"):
            return  # one process (no DDP): nothing to compress
        self._state.to(pl_module.device)
        self.compressor.register(model)
        self.registered = True

    def state_dict(self) -> dict[str, Any]:
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state.load_state_dict(state_dict)
