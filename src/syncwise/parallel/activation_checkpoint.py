"""Activation checkpointing applied from outside the model (torchtitan style)."""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: ``model.layers``/``blocks``/``h`` or the largest ModuleList."""
    for name in ("layers", "blocks", "h"):
        mod = getattr(model, name, None)
        if isinstance(mod, nn.ModuleList):
            return mod
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError("activation checkpointing needs a model with an nn.ModuleList of blocks")
    return max(lists, key=len)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in backward; returns the number of blocks wrapped.

    Wraps ``forward`` in place, so parameter names and checkpoints are unchanged.
    """
    blocks = _blocks(model)
    for block in blocks:
        inner = block.forward
        block.forward = functools.partial(checkpoint, inner, use_reentrant=False)
    return len(blocks)
