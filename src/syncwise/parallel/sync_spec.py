"""``--sync``: how often and how replicas synchronise, parsed and validated before any worker starts.

every-step: DDP's per-step gradient all-reduce (optionally compressed, ``--compress``);
localsgd / diloco: replicas train alone and average every H steps (``local_sgd.py``);
torch-localsgd: the same with PyTorch's ``PeriodicModelAverager`` (the reference);
pipesgd: every step's gradient all-reduce overlaps the next step's compute (``pipe_sgd.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import ConfigError
from ..specs import BOOL_ACCEPTED, check_keys, parse_spec, read_bool, read_float, read_int

EVERY_STEP = "every-step"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Bounds: an average at least every MAX_PERIOD steps, warm-up within train.steps' own bound, and an outer step
# of at most MAX_OUTER_LR x the averaged pseudo-gradient (DiLoCo uses 0.7; far above 1 every average overshoots).
MAX_PERIOD = 1_000_000
MAX_WARMUP = 1_000_000_000
MAX_OUTER_LR = 10.0
# method -> defaults; DiLoCo's outer optimizer follows the paper (lr 0.7, Nesterov momentum 0.9).
METHODS = {
    "localsgd": {"period": 16, "outer_lr": 1.0, "momentum": 0.0, "nesterov": False, "delay": 0,
                 "dtype": "fp32", "warmup": 0},
    "diloco": {"period": 16, "outer_lr": 0.7, "momentum": 0.9, "nesterov": True, "delay": 0,
               "dtype": "fp32", "warmup": 0},
    "torch-localsgd": {"period": 16, "warmup": 0},
    "pipesgd": {"dtype": "fp32"},
}
ACCEPTED = ("every-step (DDP all-reduce each step); localsgd[:period=H,delay=D,dtype=fp32|bf16|fp16,warmup=W,"
            "outer_lr=X,momentum=M,nesterov=yes|no]; diloco[:...same keys; defaults outer_lr=0.7,momentum=0.9,"
            "nesterov=yes]; torch-localsgd[:period=H,warmup=W] (PyTorch's PeriodicModelAverager); "
            "pipesgd[:dtype=fp32|bf16|fp16] (gradient all-reduce overlapped with the next step)")


@dataclass
class SyncSpec:
    """A parsed ``--sync`` spec (keys a method does not use keep their defaults).

    ``delay`` ≤ ``period``: an average lands at the latest just before the next one starts.
    """

    method: str
    period: int = 16
    outer_lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    delay: int = 0
    dtype: str = "fp32"
    warmup: int = 0
    options: dict = field(default_factory=dict)  # what the user wrote, for the spec string

    @property
    def spec(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return self.method + (f":{opts}" if opts else "")

    @staticmethod
    def parse(spec: str, field_name: str = "parallel.sync") -> "Optional[SyncSpec]":
        """None for ``every-step``; a spec otherwise; anything malformed raises ConfigError naming it."""
        method, raw_options = parse_spec(spec, field_name, ACCEPTED)
        if method == EVERY_STEP and not raw_options:
            return None
        if method not in METHODS:
            raise ConfigError(field_name, spec, ACCEPTED)
        values: dict[str, Any] = dict(METHODS[method])
        check_keys(raw_options, values, field_name, spec, f"keys of {method}: {', '.join(values)} ({ACCEPTED})")
        options: dict[str, Any] = {}
        for key, text in raw_options.items():
            options[key] = values[key] = _coerce(field_name, spec, key, text, values[key])
        out = SyncSpec(method, options=options, **values)
        checks = [(1 <= out.period <= MAX_PERIOD, "period", f"an integer ≥ 1 and ≤ {MAX_PERIOD:,}"),
                  (0 <= out.delay <= out.period, "delay", f"an integer in [0, period] = [0, {out.period}]"),
                  (0 <= out.warmup <= MAX_WARMUP, "warmup", f"an integer in [0, {MAX_WARMUP:,}]"),
                  (0 < out.outer_lr <= MAX_OUTER_LR, "outer_lr", f"a number in (0, {MAX_OUTER_LR:g}]"),
                  (0 <= out.momentum < 1, "momentum", "a number in [0, 1)"),
                  (out.dtype in DTYPES, "dtype", "one of " + ", ".join(DTYPES))]
        for ok, key, accepted in checks:
            if not ok:
                raise ConfigError(field_name, spec, f"{key}: {accepted}")
        return out


def _coerce(field_name: str, spec: str, key: str, text: str, default: Any) -> Any:
    """One option, read as its default's type by the shared readers (bounds are checked after)."""
    if isinstance(default, bool):
        return read_bool(text, field_name, spec, key, f"{key}: {BOOL_ACCEPTED}")
    if isinstance(default, int):
        return read_int(text, field_name, spec, key, accepted=f"{key}: an integer")
    if isinstance(default, float):
        return read_float(text, field_name, spec, key, accepted=f"{key}: a finite number")
    return text


class SyncStrategy:
    """What the trainer calls around each optimizer step (steps are 1-based); the defaults do nothing.

    ``syncs_gradients(step)``: let DDP all-reduce this step's gradients; ``exchange(step, last)``: the
    gradient sets to apply now (``None`` = what is in ``.grad``) and seconds waited; ``after_step(step,
    last)``: move parameters after the update, return seconds waited. ``replicas_diverge``: ranks hold
    different parameters between syncs (their model and optimizer state are then checkpointed per rank).
    """

    replicas_diverge = True
    restored = False  # set by load_state_dict
    spec: SyncSpec
    params: list
    syncs = 0

    def syncs_gradients(self, step: int) -> bool:
        return False

    def exchange(self, step: int, last: bool = False) -> tuple[list, float]:
        return [None], 0.0

    def after_step(self, step: int, last: bool = False) -> float:
        return 0.0

    def resumed(self) -> None:
        """Called after a checkpoint was loaded (``self.restored``: this strategy's own state was in it)."""
