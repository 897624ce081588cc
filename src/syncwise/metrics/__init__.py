"""Instruments: per-step metrics log, progress, summaries, memory and MFU helpers."""
from .logger import MetricsLogger, read_jsonl, truncate_jsonl
from .system import PeakInfo, detect_peak, mfu, peak_flops, peak_memory_mb

__all__ = ["MetricsLogger", "read_jsonl", "truncate_jsonl", "peak_memory_mb", "mfu", "peak_flops", "detect_peak", "PeakInfo"]
