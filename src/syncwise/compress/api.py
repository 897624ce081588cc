"""The seed API: ``GradientCompressor(compression_ratio, sparsity_method, communication_backend)``."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .base import Compressor
from .hook import CompressionHookState, CompressionPolicy, compression_hook
from .registry import COMPRESSORS

_BACKENDS = ("auto", "nccl", "gloo")


class GradientCompressor:
    """Build a compressor from the article's arguments and attach it to a DDP model.

    ``compression_ratio`` sets top-k / random-k's kept fraction and PowerSGD's per-tensor rank
    (``r = ratio * n*m/(n+m)``, so compressed/uncompressed size ~ ratio); the fixed-rate methods
    (none, fp16, bf16, fp8, int8, sign) ignore it. Extra keyword options go to the compressor's
    config (e.g. ``rank=4``, ``momentum=0.9``, ``chunk=512``).
    """

    def __init__(self, compression_ratio: float = 0.05, sparsity_method: str = "topk",
                 communication_backend: str = "auto", error_feedback: bool = True, **options: Any):
        method = str(sparsity_method).lower()
        if method not in COMPRESSORS:
            raise ConfigError("sparsity_method", sparsity_method, ", ".join(COMPRESSORS))
        if communication_backend not in _BACKENDS:
            raise ConfigError("communication_backend", communication_backend, ", ".join(_BACKENDS))
        if not 0.0 < float(compression_ratio) <= 1.0:
            raise ConfigError("compression_ratio", compression_ratio, "a fraction in (0, 1]")
        info = COMPRESSORS[method]
        unknown = sorted(set(options) - set(info.options))
        if unknown:
            raise ConfigError(f"GradientCompressor option {unknown[0]!r}", options[unknown[0]],
                              f"options of {method}: {', '.join(info.options)}")
        kwargs = dict(options)
        if method in ("topk", "randomk"):
            kwargs.setdefault("ratio", float(compression_ratio))
        elif method == "powersgd" and "rank" not in options:
            kwargs.setdefault("ratio", float(compression_ratio))
        if "error_feedback" in info.options:
            kwargs.setdefault("error_feedback", bool(error_feedback))
        self.compression_ratio = float(compression_ratio)
        self.sparsity_method = method
        self.communication_backend = communication_backend
        self.compressor: Compressor = info.cls(**kwargs)
        self.hook_state: Optional[CompressionHookState] = None
        self.policy: Optional[CompressionPolicy] = None  # register()'s default policy (None: CompressionPolicy())
        self._steps = 0  # a state loaded before register() keeps its step counter for the hook

    @classmethod
    def from_spec(cls, spec: str, policy: Optional[CompressionPolicy] = None) -> "GradientCompressor":
        """Build from a ``NAME[:key=value,...]`` spec, as ``--compress`` takes (e.g. ``powersgd:rank=4``)."""
        from .registry import parse_compress_spec

        compressor = parse_compress_spec(spec)
        self = cls(sparsity_method=compressor.name)
        self.compressor = compressor
        self.compression_ratio = float(getattr(compressor.config, "ratio", self.compression_ratio) or 1.0)
        self.policy = policy
        return self

    @property
    def stats(self) -> Any:
        """The :class:`~syncwise.comm.CommStats` counting this compressor's collectives (bytes on the wire)."""
        return self.compressor.stats

    def register(self, ddp_model: nn.Module, param_names: Union[dict[nn.Parameter, str], None] = None,
                 policy: Optional[CompressionPolicy] = None) -> CompressionHookState:
        """Register the compression hook on ``ddp_model`` (a DistributedDataParallel); returns its state."""
        group = getattr(ddp_model, "process_group", None)
        if self.communication_backend != "auto" and dist.is_initialized():
            actual = str(dist.get_backend(group)).lower()
            # an NCCL job's group is 'cuda:nccl,cpu:gloo' (devices.NCCL_PROCESS_GROUP): NCCL moves its gradients
            if self.communication_backend not in {part.split(":")[-1] for part in actual.split(",")}:
                raise ConfigError("communication_backend", self.communication_backend,
                                  f"the backend the process group was started with ({actual}) or 'auto'")
        if param_names is None:
            module = getattr(ddp_model, "module", ddp_model)
            param_names = {p: n for n, p in module.named_parameters()}
        self.hook_state = CompressionHookState(self.compressor, group, param_names,
                                               policy if policy is not None else self.policy)
        self.hook_state.steps = self._steps
        ddp_model.register_comm_hook(self.hook_state, compression_hook)
        return self.hook_state

    def state_dict(self) -> dict[str, Any]:
        """Compressor (and hook) state for checkpoints."""
        if self.hook_state is not None:
            return self.hook_state.state_dict()
        return {"compressor": self.compressor.state_dict(), "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        if self.hook_state is not None:
            self.hook_state.load_state_dict(state)
        else:
            self.compressor.load_state_dict(state["compressor"])
            self._steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        return (f"GradientCompressor({self.compressor!r}, ratio={self.compression_ratio}, "
                f"backend={self.communication_backend})")
