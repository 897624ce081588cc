"""What every integration shares: turning the user's argument into a GradientCompressor, byte counts."""
from __future__ import annotations

import importlib
from typing import Any, Union

from ..compress import CompressionPolicy, Compressor, GradientCompressor
from ..errors import ConfigError, SyncwiseError
from ..layout import MIN_NUMEL

CompressorLike = Union[str, Compressor, GradientCompressor]


def require(module: str, package: str, integration: str) -> Any:
    """Import ``module`` or fail with one line naming what to pip install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = {"transformers": "hf"}.get(integration, integration)  # pyproject's extras
        raise SyncwiseError(f"syncwise.integrations.{integration} needs {package}: pip install 'syncwise[{extra}]' "
                            f"or pip install {package}") from None


def compressor_from(compressor: CompressorLike, min_numel: int = MIN_NUMEL, min_ndim: int = 2) -> GradientCompressor:
    """A :class:`GradientCompressor` from a spec (``"powersgd:rank=4"``), a compressor or a GradientCompressor.

    ``min_numel`` / ``min_ndim``: tensors smaller than this are sent as fp32 (the trainer's ``--compress.min_numel``).
    """
    policy = CompressionPolicy(min_numel=min_numel, min_ndim=min_ndim)
    if isinstance(compressor, GradientCompressor):
        if compressor.policy is None:
            compressor.policy = policy
        return compressor
    if isinstance(compressor, str):
        return GradientCompressor.from_spec(compressor, policy=policy)
    if isinstance(compressor, Compressor):
        gc = GradientCompressor.from_spec(compressor.name, policy=policy)
        gc.compressor = compressor
        return gc
    raise ConfigError("compressor", compressor,
                      "a spec such as 'powersgd:rank=4', a syncwise Compressor or a GradientCompressor")


def bytes_on_wire(compressor: Any) -> int:
    """Bytes ``compressor`` has sent so far (its ``stats``: each compressor counts its own collectives, no counter is
    process-wide): compressed gradients, plus the fp32 tensors the policy left uncompressed. ``compressor``: what an
    integration returned (``ddp.register``, ``accelerate.register``: a GradientCompressor; Lightning's or
    transformers' callback), or a Compressor."""
    stats = getattr(compressor, "stats", None)
    if stats is None:  # a callback: its GradientCompressor's
        stats = getattr(getattr(compressor, "compressor", None), "stats", None)
    if stats is None:
        raise ConfigError("compressor", compressor, "what a syncwise integration returned (a GradientCompressor or "
                          "its callback), or a Compressor")
    return stats.total_bytes


def _to(obj: Any, device: Any) -> Any:
    import torch

    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


class RankedCompressorState:
    """A GradientCompressor's state for frameworks that write ONE checkpoint file from rank 0.

    Error-feedback residuals differ from rank to rank, so :meth:`state_dict` all-gathers every rank's state
    (a collective: Lightning, Accelerate and ``transformers.Trainer`` call it on every rank) and
    :meth:`load_state_dict` restores this rank's entry. A checkpoint from a different world size cannot
    place residuals: the compressor then starts fresh, with a warning.
    """

    FORMAT = "syncwise.compress/per-rank/1"

    def __init__(self, compressor: GradientCompressor):
        self.compressor = compressor

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist

        local = _to(self.compressor.state_dict(), "cpu")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)
        else:
            ranks = [local]
        return {"format": self.FORMAT, "world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        import warnings

        import torch.distributed as dist

        if not isinstance(state, dict) or state.get("format") != self.FORMAT:
            raise SyncwiseError(f"not a syncwise compressor checkpoint (expected format {self.FORMAT!r}): "
                                "resume from a checkpoint written with the syncwise integration attached")
        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        if state["world_size"] != world:
            warnings.warn(f"syncwise: the compressor checkpoint holds {state['world_size']} ranks' state, this run "
                          f"has {world}: the compressor's error feedback and warm start begin afresh")
            return
        local = state["ranks"][rank]
        self.compressor.load_state_dict(_to(local, device) if device is not None else local)

    def to(self, device: Any) -> None:
        """Move the loaded state to ``device`` (the gradients' device), once it is known."""
        if str(device) != "cpu":
            self.compressor.load_state_dict(_to(self.compressor.state_dict(), device))
