"""Instruments: per-step metrics log, progress, summaries, memory and MFU helpers.

The memory and MFU helpers (``metrics.system``) load torch; they are loaded on first use, so reading a run's files
(``syncwise report``, ``doctor``) starts without torch (issue 43 row 7)."""
from typing import Any

from .logger import MetricsLogger, read_jsonl, truncate_jsonl

_SYSTEM = ("PeakInfo", "detect_peak", "mfu", "peak_flops", "peak_memory_mb")


def __getattr__(name: str) -> Any:
    if name in _SYSTEM:
        from . import system
        return getattr(system, name)
    raise AttributeError(f"module 'syncwise.metrics' has no attribute {name!r}")


__all__ = ["MetricsLogger", "read_jsonl", "truncate_jsonl", "peak_memory_mb", "mfu", "peak_flops", "detect_peak", "PeakInfo"]
