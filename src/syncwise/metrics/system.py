"""Memory and model-FLOPs utilisation."""
from __future__ import annotations

import resource
import sys
from typing import Optional

import torch

# Dense bf16 tensor-core peaks (FLOP/s) of common accelerators, for MFU; CPUs have no agreed peak.
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12, "V100": 125e12, "MI300X": 1307e12}


def peak_memory_mb(device: Optional[torch.device] = None) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def peak_flops(device: Optional[torch.device] = None) -> Optional[float]:
    """The accelerator's bf16 peak FLOP/s when known, else None (e.g. on CPU)."""
    if device is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def mfu(flops_per_token: Optional[float], tokens_per_s_per_device: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation = achieved training FLOP/s over the device peak."""
    if not flops_per_token or not peak:
        return None
    return flops_per_token * tokens_per_s_per_device / peak
