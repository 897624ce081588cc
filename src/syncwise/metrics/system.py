"""Memory and model-FLOPs utilisation (MFU), with the accelerator's peak detected by part and variant."""
from __future__ import annotations

import os
import re
import resource
import sys
from typing import Mapping, NamedTuple, Optional

import torch

PEAK_ENV = "SYNCWISE_PEAK_TFLOPS"


class PeakEntry(NamedTuple):
    """One row of the peak table: a name pattern, the part it means, its dense peak, the source."""

    pattern: str      # regular expression searched in the normalised device name (see _normalise)
    part: str         # the part, as shown in metrics
    tflops: float     # dense (no 2:4 sparsity) tensor-core TFLOP/s per device as torch sees it
    source: str       # where the figure comes from


class PeakInfo(NamedTuple):
    """The peak used for MFU: FLOP/s (None when unknown), the detected part, and the source."""

    flops: Optional[float]
    part: str
    source: str


# Dense bf16 tensor-core peaks per device (per GPU, per GCD on multi-die AMD parts), first match wins,
# so a variant precedes its family. NVIDIA's datasheets print the 2:4-sparsity figure; dense is half
# of it (the number in parentheses below). The full table with links is in docs/gpu.md.
_NV = "NVIDIA datasheet"
PEAK_TABLE: tuple[PeakEntry, ...] = (
    # Blackwell
    PeakEntry(r"\bgb200\b", "GB200", 2500.0, f"{_NV}: GB200 NVL72, 5 PFLOPS sparse per GPU"),
    PeakEntry(r"\bb200\b", "B200", 2250.0, f"{_NV}: HGX B200, 4.5 PFLOPS sparse per GPU"),
    PeakEntry(r"\bb100\b", "B100", 1750.0, f"{_NV}: HGX B100, 3.5 PFLOPS sparse per GPU"),
    # Hopper
    PeakEntry(r"\bgh200\b", "GH200", 989.4, f"{_NV}: GH200 (1,979 sparse)"),
    PeakEntry(r"\bh100\b.*\bnvl\b", "H100 NVL", 835.5, f"{_NV}: H100 NVL (1,671 sparse per GPU)"),
    PeakEntry(r"\bh100\b.*\bpcie\b", "H100 PCIe", 756.5, f"{_NV}: H100 PCIe (1,513 sparse)"),
    PeakEntry(r"\bh100\b", "H100 SXM5", 989.4, f"{_NV}: H100 SXM5 (1,979 sparse); "
                                              "a name without PCIe/NVL, e.g. 'NVIDIA H100 80GB HBM3'"),
    PeakEntry(r"\bh200\b.*\bnvl\b", "H200 NVL", 835.5, f"{_NV}: H200 NVL (1,671 sparse)"),
    PeakEntry(r"\bh200\b", "H200 SXM", 989.4, f"{_NV}: H200 SXM (1,979 sparse)"),
    PeakEntry(r"\bh800\b.*\bpcie\b", "H800 PCIe", 756.5, f"{_NV}: H800 PCIe (1,513 sparse)"),
    PeakEntry(r"\bh800\b", "H800 SXM5", 989.4, f"{_NV}: H800 SXM5 (1,979 sparse)"),
    PeakEntry(r"\bh20\b", "H20", 148.0, "NVIDIA H20 specification as reported (296 sparse); no public datasheet"),
    # Ampere
    PeakEntry(r"\ba100\b.*\bpcie\b", "A100 PCIe", 312.0, f"{_NV}: A100 40/80GB PCIe (624 sparse)"),
    PeakEntry(r"\ba100\b", "A100 SXM4", 312.0, f"{_NV}: A100 40/80GB SXM4 (624 sparse)"),
    PeakEntry(r"\ba800\b", "A800", 312.0, f"{_NV}: A800 40/80GB (624 sparse)"),
    PeakEntry(r"\ba30\b", "A30", 165.0, f"{_NV}: A30 (330 sparse)"),
    PeakEntry(r"\ba40\b", "A40", 149.7, f"{_NV}: A40 (299.4 sparse)"),
    PeakEntry(r"\ba10g\b", "A10G", 125.0, "estimate: AWS's A10G has no NVIDIA datasheet; the A10's figure "
                                          "(125) is used, and its real tensor rate may be lower"),
    PeakEntry(r"\ba10\b", "A10", 125.0, f"{_NV}: A10 (250 sparse)"),
    PeakEntry(r"\brtx 3090\b", "GeForce RTX 3090", 71.0, "NVIDIA Ampere GA102 whitepaper: FP16/BF16 tensor "
                                                         "with FP32 accumulate (142 sparse)"),
    # Ada
    PeakEntry(r"\bl40s\b", "L40S", 362.05, f"{_NV}: L40S (733 sparse)"),
    PeakEntry(r"\bl40\b", "L40", 181.05, f"{_NV}: L40 (362.1 sparse)"),
    PeakEntry(r"\bl4\b", "L4", 121.0, f"{_NV}: L4 (242 sparse)"),
    PeakEntry(r"\brtx 4090\b", "GeForce RTX 4090", 165.2, "NVIDIA Ada whitepaper: FP16/BF16 tensor with FP32 "
                                                          "accumulate (330.4 sparse)"),
    # Volta / Turing: no bf16 tensor cores; the fp16 tensor peak (fp16 autocast) is the reference.
    PeakEntry(r"\bv100s\b", "V100S PCIe", 130.0, f"{_NV}: V100S, fp16 tensor (no bf16 tensor cores)"),
    PeakEntry(r"\bv100\b.*\bpcie\b", "V100 PCIe", 112.0, f"{_NV}: V100 PCIe, fp16 tensor (no bf16 tensor cores)"),
    PeakEntry(r"\bv100\b", "V100 SXM2", 125.0, f"{_NV}: V100 SXM2, fp16 tensor (no bf16 tensor cores)"),
    PeakEntry(r"\bt4\b", "T4", 65.0, f"{_NV}: T4, fp16 tensor (no bf16 tensor cores)"),
    # AMD Instinct (ROCm builds of torch report these through torch.cuda)
    PeakEntry(r"\bmi355x\b", "MI355X", 2500.0, "AMD specification: MI355X, 2.5 PFLOPS dense bf16"),
    PeakEntry(r"\bmi350x\b", "MI350X", 2300.0, "AMD specification: MI350X, 2.3 PFLOPS dense bf16"),
    PeakEntry(r"\bmi325x\b", "MI325X", 1307.4, "AMD specification: MI325X, dense bf16"),
    PeakEntry(r"\bmi300x\b", "MI300X", 1307.4, "AMD specification: MI300X, dense bf16"),
    PeakEntry(r"\bmi300a\b", "MI300A", 980.6, "AMD specification: MI300A, dense bf16"),
    PeakEntry(r"\bmi250x\b", "MI250X (one GCD)", 191.5, "AMD specification: MI250X 383 per module, 2 GCDs, "
                                                        "each a torch device"),
    PeakEntry(r"\bmi250\b", "MI250 (one GCD)", 181.0, "AMD specification: MI250 362.1 per module, 2 GCDs"),
    PeakEntry(r"\bmi210\b", "MI210", 181.0, "AMD specification: MI210, dense bf16"),
)

# NVIDIA MIG slices ("... MIG 3g.40gb"): a slice of g of the 7 compute slices of A100/H100/H200.
_MIG = re.compile(r"\bmig (\d)g\b")


def _normalise(name: str) -> str:
    # "NVIDIA A100-SXM4-80GB" -> "nvidia a100 sxm4 80gb": word boundaries then separate the part
    # (a10 / a100, l4 / l40 / l40s, h20 / h200, b200 / gb200) from the variant.
    return re.sub(r"[\s_\-/,()]+", " ", name.casefold()).strip()


def _env_peak(env: Mapping[str, str]) -> tuple[Optional[float], str]:
    """(FLOP/s, "") from ``SYNCWISE_PEAK_TFLOPS``; (None, "") when unset; (None, why) when unusable."""
    raw = env.get(PEAK_ENV, "").strip()
    if not raw:
        return None, ""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        # Not raised: this is read while logging a running job, which must not die for a metric.
        return None, f"{PEAK_ENV}={raw!r} ignored: expected the dense bf16 peak in TFLOP/s, a number > 0"
    return value * 1e12, ""


def peak_for_name(name: Optional[str], env: Optional[Mapping[str, str]] = None) -> PeakInfo:
    """The dense bf16 peak for a device called ``name`` (``torch.cuda.get_device_name()``; None or
    "cpu" for a CPU), as (FLOP/s or None, part, source). ``SYNCWISE_PEAK_TFLOPS`` in ``env``
    (default: the process environment) overrides the table; an unknown part gets None and a source
    saying how to supply the figure, as does a malformed override. A pure function of its arguments: no device is touched."""
    env = os.environ if env is None else env
    shown = name if name else "cpu"
    override, bad = _env_peak(env)
    if override is not None:
        return PeakInfo(override, shown, f"{PEAK_ENV}={env[PEAK_ENV].strip()} (set by the user)")
    if bad:
        return PeakInfo(None, shown, bad)
    if not name or _normalise(name) == "cpu":
        return PeakInfo(None, "cpu", f"no agreed peak for CPUs; set {PEAK_ENV} to report MFU")
    norm = _normalise(name)
    for entry in PEAK_TABLE:
        if re.search(entry.pattern, norm):
            mig = _MIG.search(norm)
            if mig:
                g = int(mig.group(1))
                return PeakInfo(entry.tflops * 1e12 * g / 7, f"{entry.part} MIG {g}g",
                                f"{entry.source}; MIG slice: {g}/7 of the GPU (estimate)")
            return PeakInfo(entry.tflops * 1e12, entry.part, entry.source)
    return PeakInfo(None, name, f"part not in syncwise's peak table; set {PEAK_ENV} to its dense bf16 "
                                "TFLOP/s to report MFU")


def detect_peak(device: Optional[torch.device] = None) -> PeakInfo:
    """``peak_for_name`` for ``device`` (a CUDA/ROCm device is asked its name; anything else is a CPU)."""
    if device is not None and device.type == "cuda":
        return peak_for_name(torch.cuda.get_device_name(device))
    return peak_for_name(None)


def peak_memory_mb(device: Optional[torch.device] = None) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def peak_flops(device: Optional[torch.device] = None) -> Optional[float]:
    """The device's dense bf16 peak FLOP/s when known, else None (e.g. on CPU); see ``detect_peak``."""
    return detect_peak(device).flops


def mfu(flops_per_token: Optional[float], tokens_per_s_per_device: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation = achieved training FLOP/s over the device peak."""
    if not flops_per_token or not peak:
        return None
    return flops_per_token * tokens_per_s_per_device / peak
