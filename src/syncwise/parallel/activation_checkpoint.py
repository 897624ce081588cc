"""Activation checkpointing applied from outside the model (torchtitan style)."""
from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: ``model.layers``/``blocks``/``h`` or the largest ModuleList/ModuleDict."""
    containers = (nn.ModuleList, nn.ModuleDict)
    for name in ("layers", "blocks", "h"):
        mod = getattr(model, name, None)
        if isinstance(mod, containers):
            return list(mod.values() if isinstance(mod, nn.ModuleDict) else mod)
    found = [m for m in model.modules() if isinstance(m, containers)]
    if not found:
        raise ValueError("activation checkpointing needs a model whose blocks sit in an nn.ModuleList or "
                         "nn.ModuleDict")
    biggest = max(found, key=len)
    return list(biggest.values() if isinstance(biggest, nn.ModuleDict) else biggest)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in backward; returns the number of blocks wrapped.

    Wraps ``forward`` in place, so parameter names and checkpoints are unchanged.
    """
    blocks = _blocks(model)
    for block in blocks:
        inner = block.forward
        # the recompute context tells MoE layers not to count their tokens twice, without the graph-task query
        # that breaks torch.compile's graph (models/moe.py: _in_backward)
        block.forward = functools.partial(checkpoint, inner, use_reentrant=False, context_fn=_contexts)
    return len(blocks)


def _contexts():
    from ..models.moe import recomputing

    return contextlib.nullcontext(), recomputing()
