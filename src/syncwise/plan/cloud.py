"""``CloudConfig``: the cluster a layout runs on, its TOML form, and the built-in hardware catalog.

A cluster is ``nodes`` × ``gpus_per_node`` accelerators of one kind, an intra-node fabric (NVLink, PCIe, the
lab's loopback) and an inter-node fabric (InfiniBand, RoCE, Ethernet, the lab's shaped links) with
``nics_per_node`` NICs per node. Every catalog number carries its source: a vendor datasheet for peaks,
memory and link rates; "assumed" for efficiencies and latencies that no datasheet gives (they are the
planner's calibration knobs, see docs/plan.md). Units inside the dataclasses are SI (FLOP/s, bytes,
bytes/s, seconds); the TOML form names its unit in each key (``peak_bf16_tflops``, ``bandwidth_gbit_s``).

Pure Python: reads TOML with ``tomllib``, imports nothing of torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import ConfigError
from ..specs import count

TOPOLOGIES = ("fat_tree", "rail_optimized", "single_switch", "oversubscribed")
NETWORK_PRIORITIES = ("balanced", "low_latency", "bandwidth")
GIB = 2**30
FABRIC_KINDS = ("nvlink", "xgmi", "pcie", "infiniband", "roce", "ethernet", "efa", "lab", "none")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: dense peaks (no 2:4 sparsity), memory, HBM bandwidth and the achievable share of peak."""

    name: str
    peak_bf16_flops: float
    peak_fp16_flops: float
    peak_fp8_flops: float          # 0: no fp8 tensor cores
    memory_bytes: float            # GPU memory is binary: an "80GB" H100 reports 81,559 MiB ≈ 80 GiB
    hbm_bandwidth: float           # bytes/s
    matmul_efficiency: float       # achieved / peak on a transformer's GEMMs (assumed; calibrate it)
    reserved_bytes: float = 3 * 2**30  # CUDA context, allocator fragmentation, NCCL buffers (assumed)
    source: str = ""
    # GEMM-size efficiency: a GEMM of F FLOPs runs at matmul_efficiency × F / (F + gemm_half_flops), i.e. each
    # GEMM costs a fixed gemm_half_flops / (peak × matmul_efficiency) on top of its FLOPs (launch, tail wave,
    # cache warm-up). Measured by `syncwise plan --calibrate`; 0 = size-independent.
    gemm_half_flops: float = 0.0
    # GEMM shape (first principles, syncwise.plan.cost.gemm_time): a GEMM's output is cut into tiles, one per
    # streaming multiprocessor at a time; a partial last wave leaves SMs idle (wave quantization), and a GEMM too
    # thin to reuse its operands runs at HBM bandwidth instead (roofline). 0 = no SM count: size-independent.
    sm_count: int = 0
    # Per kernel: the host issues kernels at most one per ``kernel_launch_s`` (CUDA launch + framework dispatch),
    # the device pays ``kernel_gap_s`` between dependent kernels; a micro-batch of many small kernels is bound by
    # the host (syncwise.plan.cost.kernels_per_microbatch). 0 = not charged (the CPU lab: in the calibration).
    kernel_launch_s: float = 0.0
    kernel_gap_s: float = 0.0
    # Measured compressor compute on this accelerator (`syncwise plan --calibrate`): (compressor name, seconds per
    # gradient element, seconds per gradient tensor) of its encode + decode for one peer. Absent compressors are
    # priced from CODEC_COST (memory traffic and FLOPs per element, syncwise.plan.cost).
    codec_cost: tuple[tuple[str, float, float], ...] = ()
    # Workers per compute unit when they share one (the CPU lab: 4 workers of 1 thread on 2 cores = 2; written by
    # `--calibrate` on a CPU). The calibrated speed is the shared one (every worker measured at once); a pipeline
    # stage idle in its bubble lends its share to the busy ones (syncwise.plan.cost). 1 = a unit of its own.
    shared_by: float = 1.0

    def codec(self, name: str) -> Optional[tuple[float, float]]:
        """(seconds per element, seconds per tensor) measured for compressor ``name``, or None."""
        for n, per_element, per_tensor in self.codec_cost:
            if n == name:
                return per_element, per_tensor
        return None

    def gemm_efficiency(self, flops: float) -> float:
        """Achieved / peak for one GEMM of ``flops`` FLOPs (monotone non-decreasing in ``flops``)."""
        return self.matmul_efficiency * flops / (flops + self.gemm_half_flops) if flops > 0 else 0.0

    def gemm_shape_efficiency(self, m: int, n: int, k: int, dtype_bytes: int = 2) -> float:
        """Achieved / peak for one GEMM with an ``m`` × ``n`` output and inner dimension ``k`` (syncwise.plan.cost.
        gemm_time's model): matmul_efficiency × the best wave efficiency over cuBLAS-like tiles, capped by the
        roofline (bf16 operands read once, output written once)."""
        flops = 2.0 * m * n * k
        if flops <= 0:
            return 0.0
        t = gemm_time(self, m, n, k, self.peak_bf16_flops, self.matmul_efficiency, dtype_bytes)
        return flops / t / self.peak_bf16_flops

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (bf16, fp16, fp8)."""
        value = {"bf16": self.peak_bf16_flops, "fp16": self.peak_fp16_flops, "fp8": self.peak_fp8_flops}[dtype]
        if not value:
            raise ConfigError("cluster.accelerator", self.name, f"an accelerator with {dtype} tensor cores "
                              f"({self.name} has no {dtype} peak in the catalog)")
        return value


@dataclass(frozen=True)
class Fabric:
    """A link: per-direction bandwidth per GPU (intra-node) or per NIC (inter-node), latency, achievable share."""

    name: str
    kind: str
    bandwidth: float               # bytes/s, one direction
    latency: float                 # seconds per message step (assumed order of magnitude)
    efficiency: float              # achievable bus bandwidth / line rate (nccl-tests style; assumed or measured)
    nics_per_node: int = 1         # inter-node only
    source: str = ""
    # measured bus-bandwidth efficiency of other collectives where they differ from the all-reduce's (gloo's
    # reduce-scatter and all-gather are not NCCL's rings): ((kind, efficiency), ...); absent kinds use efficiency
    op_efficiency: tuple[tuple[str, float], ...] = ()
    # a token-bucket-shaped link (the network lab's tc tbf): bytes that pass at the host's own speed when the bucket
    # is full; the bucket refills at ``bandwidth`` while the step computes. 0 = an ordinary link.
    burst_bytes: float = 0.0
    # α of the α-β model at the call level: seconds every collective call costs on top of its message steps
    # (``latency`` each) and its bytes — NCCL's kernel launch, channel setup and the protocol's first chunk, the
    # flat part of an nccl-tests curve (CALL_LATENCY_SOURCE). `syncwise plan --calibrate` measures a fabric's
    # small-message time per message step into ``latency`` and writes 0 here (its steps already hold it).
    call_latency: float = 0.0

    def burst_credit(self, gap_s: float) -> float:
        """Bytes that pass without waiting on the rate after ``gap_s`` seconds without traffic: the bucket's depth,
        or what refilled it in that time (tbf: tokens accrue at the rate up to the burst)."""
        return min(self.burst_bytes, self.bandwidth * max(0.0, gap_s)) if self.burst_bytes > 0 else 0.0

    @property
    def effective(self) -> float:
        """Achievable bytes/s of one link (one direction)."""
        return self.bandwidth * self.efficiency

    def effective_for(self, kind: str) -> float:
        """Achievable bytes/s of one link for collective ``kind`` (all_reduce, all_gather, ...)."""
        return self.bandwidth * dict(self.op_efficiency).get(kind, self.efficiency)


#: output tiles (rows, cols) a cuBLAS / CUTLASS tensor-core GEMM picks among (NVIDIA, "Matrix Multiplication
#: Background User's Guide", docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/:
#: "Tile Quantization" / "Wave Quantization" — cuBLAS chooses the tile per GEMM; 256×128 and 128×128 are its
#: A100 examples, 128×64 the next smaller). Smaller tiles reuse operands less; that cost is not modelled.
GEMM_TILES = ((256, 128), (128, 128), (128, 64))


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """Busy share of ``sms`` streaming multiprocessors over a GEMM with an ``m`` × ``n`` output: tiles / (waves ×
    SMs) for the best tile of :data:`GEMM_TILES` (one thread block per SM at a time, the guide's model). 1.0 when
    the tiles fill whole waves; → 1 for large outputs; 1/SMs for a one-tile GEMM."""
    if sms <= 0 or m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        # a partly filled tile does the work of a full one (tile quantization)
        useful = (m * n) / (tm * tn * tiles)
        best = max(best, useful * tiles / (waves * sms))
    return best


def gemm_time(acc: "Accelerator", m: float, n: float, k: float, peak: float, eff: float,
              dtype_bytes: float = 2) -> float:
    """Seconds of one GEMM (``m`` × ``n`` output, inner ``k``) at ``peak`` × ``eff`` (the large-GEMM efficiency)
    × the wave efficiency over ``acc.sm_count`` SMs, or at HBM bandwidth where its operands (read once) and output
    (written once) take longer (roofline). Without an SM count: FLOPs / (peak × eff)."""
    flops = 2.0 * m * n * k
    if flops <= 0:
        return 0.0
    if not acc.sm_count:
        return flops / (peak * eff)
    wave = wave_efficiency(int(math.ceil(m)), int(math.ceil(n)), acc.sm_count)
    return max(flops / (peak * eff * wave), dtype_bytes * (m * k + k * n + m * n) / acc.hbm_bandwidth)


def batched_gemm_time(acc: "Accelerator", batch: float, m: float, n: float, k: float, peak: float, eff: float,
                      dtype_bytes: float = 2) -> float:
    """Seconds of ``batch`` independent GEMMs (``m`` × ``n`` output, inner ``k``) in one batched kernel (the
    attention core's QKᵀ and AV without a fused kernel): their tiles share the SMs' waves (as one output of
    ``batch`` × ``m`` rows) and each reads its operands and writes its output once (roofline)."""
    flops = 2.0 * batch * m * n * k
    if flops <= 0:
        return 0.0
    if not acc.sm_count:
        return flops / (peak * eff)
    wave = wave_efficiency(int(math.ceil(batch * m)), int(math.ceil(n)), acc.sm_count)
    return max(flops / (peak * eff * wave), dtype_bytes * batch * (m * k + k * n + m * n) / acc.hbm_bandwidth)


# ------------------------------------------------------------------------------------------------ the catalog
_NV_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16/FP16 tensor 312 TFLOPS dense (624 with "
            "sparsity)")
_NV_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/), SXM5: BF16/FP16 1,979 "
            "TFLOPS and FP8 3,958 TFLOPS with sparsity, i.e. 989 / 1,979 dense; 80 GB HBM3 at 3.35 TB/s")
_EFF = ("matmul_efficiency assumed (typical achieved share of dense peak on transformer GEMMs; "
        "calibrate with measured runs)")
#: SM counts: NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs on A100), NVIDIA H100 Tensor Core GPU
#: Architecture whitepaper (132 SMs on H100 SXM5; H800 / H200 SXM the same GH100 configuration), L40S datasheet
#: (142 SMs), AMD CDNA 3 whitepaper (304 compute units on MI300X)
_SMS = ("; SMs from the vendor's architecture whitepaper; GEMM shape efficiency = wave × tile quantization and "
        "roofline (NVIDIA Matrix Multiplication Background User's Guide)")
#: Per-kernel costs. Host: the seconds eager PyTorch spends issuing one op — Python bytecode ~1 µs, pybind11 ~1,
#: autograd's node ~1-3, the ATen dispatcher ~1-2, the backend's algorithm pick ~1-5, cudaLaunchKernel ~1-3:
#: ~5-25 µs per op ("From PyTorch op to kernel launch", jiahuanglin.xyz/all_lessons/gpu_kernel_serving/
#: 18_pytorch_to_kernel.html); the range's upper end, as a training step's ops run through Python module code
#: with autograd recording (the CUDA launch alone is 3.8 µs: NVIDIA, "Getting Started with CUDA Graphs",
#: developer.nvidia.com/blog/cuda-graphs/, back-to-back launches of a 2.9 µs kernel). `syncwise plan
#: --calibrate` measures the cluster's own (eager in-place adds through the dispatcher). Device: the 3.8 − 2.9
#: ≈ 1 µs between dependent kernels of NVIDIA's measurement.
KERNEL_LAUNCH_S = 25e-6
KERNEL_GAP_S = 1e-6
_KERNEL = ("; per-kernel host issue 25 µs (eager PyTorch's per-op dispatch stack, 5-25 µs: jiahuanglin.xyz "
           "'From PyTorch op to kernel launch') and device gap 1 µs (NVIDIA, 'Getting Started with CUDA Graphs', "
           "developer.nvidia.com/blog/cuda-graphs/)")
_GPU = dict(kernel_launch_s=KERNEL_LAUNCH_S, kernel_gap_s=KERNEL_GAP_S)

#: the CPU lab worker's compressor compute (ns per element, µs per tensor → seconds), measured by
#: `syncwise plan --calibrate --nproc 2` on the 2-core VM (2 workers at once, 1 thread each; 2026-11-25): 1 × 1024²,
#: 32 × 64² and small-dense's gradients, PowerSGD from its first step
CPU_LAB_CODECS = tuple(sorted((name, ns * 1e-9, us * 1e-6) for name, (ns, us) in {
    "fp16": (1.261, 11.0), "bf16": (1.403, 10.5), "fp8": (5.113, 14.1), "int8": (8.484, 20.5),
    "sign": (11.27, 39.7), "topk": (14.08, 8.5), "randomk": (5.294, 59.3), "powersgd": (3.920, 35.5),
    "demo": (17.00, 105.4)}.items()))

ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100-40gb", 312e12, 312e12, 0.0, 40 * GIB, 1.555e12, 0.70,
                source=_NV_A100 + "; 40 GB HBM2 at 1,555 GB/s; no FP8. " + _EFF + _SMS + _KERNEL, sm_count=108, **_GPU),
    Accelerator("a100-80gb", 312e12, 312e12, 0.0, 80 * GIB, 2.039e12, 0.70,
                source=_NV_A100 + "; 80 GB HBM2e at 2,039 GB/s (SXM); no FP8. " + _EFF + _SMS + _KERNEL, sm_count=108,
                **_GPU),
    Accelerator("h100-sxm", 989e12, 989e12, 1979e12, 80 * GIB, 3.35e12, 0.65,
                source=_NV_H100 + ". " + _EFF + _SMS + _KERNEL, sm_count=132, **_GPU),
    Accelerator("h800", 989e12, 989e12, 1979e12, 80 * GIB, 3.35e12, 0.65,
                source="NVIDIA H800 SXM (export variant of H100 SXM: same compute and HBM3 per NVIDIA's product "
                       "brief; NVLink cut to 400 GB/s bidirectional). " + _EFF + _SMS + _KERNEL, sm_count=132, **_GPU),
    Accelerator("h200", 989e12, 989e12, 1979e12, 140 * GIB, 4.8e12, 0.65,
                source="NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/), SXM: BF16 1,979 "
                       "and FP8 3,958 TFLOPS with sparsity (989 / 1,979 dense); 141 GB HBM3e at 4.8 TB/s (nvidia-smi reports 143,771 MiB ≈ 140 GiB). " + _EFF + _SMS + _KERNEL,
                sm_count=132, **_GPU),
    Accelerator("l40s", 362e12, 362e12, 733e12, 48 * GIB, 0.864e12, 0.60,
                source="NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s/): BF16/FP16 tensor 362.05 TFLOPS "
                       "dense (733 with sparsity), FP8 733 dense (1,466 with sparsity); 48 GB GDDR6 at 864 GB/s. "
                       + _EFF + _SMS + _KERNEL, sm_count=142, **_GPU),
    Accelerator("mi300x", 1307e12, 1307e12, 2615e12, 192 * GIB, 5.3e12, 0.50,
                source="AMD Instinct MI300X data sheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): "
                       "peak BF16/FP16 dense 1,307.4 TFLOPS, FP8 2,614.9 TFLOPS; 192 GB HBM3 at 5.3 TB/s. "
                       "matmul_efficiency assumed lower than NVIDIA's (published MI300X training runs reach a "
                       "smaller share of the larger peak); calibrate" + _SMS + _KERNEL, sm_count=304, **_GPU),
    # The network lab (DESIGN.md §5): one worker process on this project's 2-core VM. 'peak' is the measured
    # effective training throughput (efficiency 1.0), not a hardware peak.
    Accelerator("cpu-lab", 60e9, 60e9, 0.0, 5.5 * GIB, 10e9, 1.0, reserved_bytes=0.4 * GIB,
                source="measured, benchmarks/RESULTS.md §3: `small` preset compute-only steps, 16 × 128 tokens in "
                       "538 ms and 96 × 128 in 2.9-3.3 s = 59-66 GFLOP/s of PaLM-convention training FLOPs per "
                       "worker (1 thread); memory: a share of the VM's 23 GiB; 10 GB/s memory bandwidth assumed; "
                       "reserved 0.4 GiB = the Python/torch baseline RSS of RESULTS.md §7; codec_cost measured by "
                       "`syncwise plan --calibrate --nproc 2` on the same VM (CPU_LAB_CODECS; "
                       "benchmarks/results/codec-cost-calibrated.json checks it on the presets' gradients)",
                codec_cost=CPU_LAB_CODECS),
)}

#: Collective latency per call (α) and per message step, fitted to published nccl-tests curves. NVLink: the
#: all_reduce_perf tables of 2-8 A100 SXM GPUs on NVSwitch (1 MiB-1 GiB, fp32) that vTrain publishes as its
#: communication model (github.com/VIA-Research/vTrain, trace/a100/AR_GPU{2..8}_1M_1024M_LUT; Bang et al.,
#: MICRO 2024): 1 MiB takes 45 µs on 2 GPUs, 52 on 4, 92 on 8, flat to ~4 MiB; least squares of the fitted α(n)
#: (45-78 µs) on the planner's 2⌈log2 n⌉ message steps gives 32 µs per call + 6 µs per step, and 227 GB/s
#: bus bandwidth on 8 GPUs (0.76 of NVLink 3's 300 GB/s: the catalog's 0.8). TCP-class links (GPUDirect-TCPX /
#: sockets): nccl-tests all_reduce_perf on 2 × 8 H100 over GCP A3-Mega's TCPXO, 8 B in 123-136 µs
#: (github.com/lessizzmore/create-a3mega-ztan-fork, ztan-NCCL-test-result). InfiniBand / RoCE / other NVLink
#: generations: no published curve at hand, NVLink 3's per-call cost assumed (NCCL's kernel path, not the link).
NCCL_CALL_S = 32e-6
NVLINK_STEP_S = 6e-6
TCP_CALL_S = 123e-6
CALL_LATENCY_SOURCE = (f"collective α {NCCL_CALL_S * 1e6:.0f} µs per call (TCP-class links {TCP_CALL_S * 1e6:.0f} "
                       "µs), fitted to published nccl-tests curves (vTrain's A100 tables, github.com/VIA-Research/"
                       "vTrain trace/a100; 2 × 8 H100 over GCP TCPXO): cloud.NCCL_CALL_S")
_LAT = ("latency per message step assumed (order of magnitude of a NCCL / gloo message step, not a datasheet "
        "figure); " + CALL_LATENCY_SOURCE)

FABRICS: dict[str, Fabric] = {f.name: f for f in (
    # intra-node (bandwidth per GPU, one direction)
    Fabric("nvlink3", "nvlink", 300e9, NVLINK_STEP_S, 0.80, call_latency=NCCL_CALL_S,
           source="NVIDIA A100 datasheet: NVLink 600 GB/s per GPU (bidirectional) = 300 GB/s each way; efficiency "
                  "0.8 assumed (nccl-tests all-reduce busbw on DGX A100 is ~230-240 GB/s); per-step latency and "
                  + CALL_LATENCY_SOURCE),
    Fabric("nvlink4", "nvlink", 450e9, 3e-6, 0.80, call_latency=NCCL_CALL_S,
           source="NVIDIA H100/H200 datasheets: NVLink 900 GB/s per GPU (bidirectional) = 450 GB/s each way; "
                  "efficiency 0.8 assumed; " + _LAT),
    Fabric("nvlink-h800", "nvlink", 200e9, 3e-6, 0.80, call_latency=NCCL_CALL_S,
           source="NVIDIA H800 product brief: NVLink 400 GB/s bidirectional = 200 GB/s each way (DeepSeek-V3 "
                  "technical report §3.2.2 quotes 160 GB/s achieved, i.e. 0.8); " + _LAT),
    Fabric("xgmi-mi300x", "xgmi", 448e9, 4e-6, 0.70, call_latency=NCCL_CALL_S,
           source="AMD MI300X data sheet: 7 Infinity Fabric links of 64 GB/s each way to the other 7 GPUs "
                  "(896 GB/s aggregate bidirectional) in a fully connected node; efficiency 0.7 assumed; " + _LAT),
    Fabric("pcie4", "pcie", 32e9, 5e-6, 0.75, call_latency=NCCL_CALL_S,
           source="PCI Express 4.0 x16: 16 GT/s × 16 lanes ≈ 32 GB/s each way (PCI-SIG); efficiency 0.75 assumed "
                  "(GPU peer traffic through host bridges); " + _LAT),
    Fabric("pcie5", "pcie", 64e9, 5e-6, 0.75, call_latency=NCCL_CALL_S,
           source="PCI Express 5.0 x16 ≈ 64 GB/s each way (PCI-SIG); efficiency 0.75 assumed; " + _LAT),
    Fabric("lab-loopback", "lab", 1.35e9, 100e-6, 1.0,
           source="measured, benchmarks/RESULTS.md §2: gloo all-reduce between 2 local workers peaks at "
                  "~10.8 Gbit/s busbw (1.35 GB/s); latency assumed (gloo over TCP loopback)"),
    # inter-node (bandwidth per NIC, one direction)
    Fabric("ib-hdr", "infiniband", 25e9, 5e-6, 0.90, call_latency=NCCL_CALL_S,
           source="NVIDIA ConnectX-6 / HDR InfiniBand: 200 Gb/s per port = 25 GB/s each way; efficiency 0.9 "
                  "assumed; " + _LAT),
    Fabric("ib-ndr", "infiniband", 50e9, 5e-6, 0.90, call_latency=NCCL_CALL_S,
           source="NVIDIA ConnectX-7 / NDR InfiniBand: 400 Gb/s per port = 50 GB/s each way; efficiency 0.9 "
                  "assumed; " + _LAT),
    Fabric("roce-400g", "roce", 50e9, 8e-6, 0.85, call_latency=NCCL_CALL_S,
           source="400 GbE RoCEv2 NIC (e.g. ConnectX-7): 400 Gb/s = 50 GB/s each way; efficiency 0.85 assumed; "
                  + _LAT),
    Fabric("roce-200g", "roce", 25e9, 8e-6, 0.85, call_latency=NCCL_CALL_S,
           source="200 GbE RoCEv2 NIC: 200 Gb/s = 25 GB/s each way; efficiency 0.85 assumed; " + _LAT),
    Fabric("opa-100", "omnipath", 12.5e9, 5e-6, 0.90, call_latency=NCCL_CALL_S,
           source="Intel Omni-Path 100: 100 Gb/s per port = 12.5 GB/s each way (Jean Zay, BLOOM's cluster: 4 "
                  "links per node, BLOOM paper §3.4.1); efficiency 0.9 assumed as for InfiniBand; " + _LAT),
    Fabric("efa-100g", "efa", 12.5e9, 15e-6, 0.80, call_latency=TCP_CALL_S,
           source="AWS Elastic Fabric Adapter, 100 Gb/s per adapter (p4d: 4 per node, p5: 32 per node, AWS "
                  "instance pages); efficiency 0.8 assumed; " + _LAT),
    Fabric("eth-100g", "ethernet", 12.5e9, 30e-6, 0.80, call_latency=TCP_CALL_S,
           source="100 GbE (TCP sockets): 100 Gb/s = 12.5 GB/s each way; efficiency 0.8 assumed; " + _LAT),
    Fabric("eth-25g", "ethernet", 3.125e9, 30e-6, 0.80, call_latency=TCP_CALL_S,
           source="25 GbE (TCP sockets): 3.125 GB/s each way; efficiency 0.8 assumed; " + _LAT),
    Fabric("lab-tbf", "lab", 200e6 / 8, 200e-6, 0.95,
           source="the network lab's tbf-shaped veth link (its rate is set by `syncwise cluster up --bandwidth`; "
                  "200 Mbit/s here, override bandwidth_gbit_s); efficiency 0.93-0.957 measured "
                  "(benchmarks/RESULTS.md §2, 64 MB all-reduce); latency assumed"),
    Fabric("none", "none", 1e30, 0.0, 1.0, source="a single-node cluster has no inter-node fabric"),
)}


@dataclass(frozen=True)
class CloudConfig:
    """The cluster: ``nodes`` × ``gpus_per_node`` accelerators, how they connect, and what the network should
    favour. ``topology``: fat_tree / rail_optimized / single_switch (full bisection, the default) or
    oversubscribed (inter-node bandwidth divided by ``oversubscription`` for groups that span nodes).
    ``network_priority``: balanced (rank by step time only), low_latency (among layouts within 2 % of the
    best, prefer fewer inter-node messages) or bandwidth (prefer fewer inter-node bytes)."""

    nodes: int
    gpus_per_node: int
    topology: str = "fat_tree"
    network_priority: str = "balanced"
    accelerator: Accelerator = field(default_factory=lambda: ACCELERATORS["h100-sxm"])
    intra_node: Fabric = field(default_factory=lambda: FABRICS["nvlink4"])
    inter_node: Fabric = field(default_factory=lambda: dataclasses.replace(FABRICS["ib-ndr"], nics_per_node=8))
    oversubscription: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            count(f"cluster.{key}", getattr(self, key))
        if self.topology not in TOPOLOGIES:
            raise ConfigError("cluster.topology", self.topology, "one of: " + ", ".join(TOPOLOGIES))
        if self.network_priority not in NETWORK_PRIORITIES:
            raise ConfigError("cluster.network_priority", self.network_priority,
                              "one of: " + ", ".join(NETWORK_PRIORITIES))
        if not (isinstance(self.oversubscription, (int, float)) and 1 <= self.oversubscription < math.inf):
            raise ConfigError("cluster.oversubscription", self.oversubscription, "a number ≥ 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_inter_bandwidth(self, kind: str = "all_reduce") -> float:
        """Achievable bytes/s one node can send to other nodes (all its NICs) in collective ``kind``, after
        oversubscription."""
        if self.nodes == 1:
            return math.inf
        bw = self.inter_node.effective_for(kind) * self.inter_node.nics_per_node
        return bw / (self.oversubscription if self.topology == "oversubscribed" else 1.0)

    def describe(self) -> str:
        return (f"{self.name + ': ' if self.name else ''}{self.nodes} × {self.gpus_per_node} {self.accelerator.name}, "
                f"{self.intra_node.name} inside a node, {self.inter_node.nics_per_node} × {self.inter_node.name} "
                f"per node, {self.topology}")


# ------------------------------------------------------------------------------------------------ the TOML form
_ACC_KEYS = {  # TOML key -> (Accelerator field, scale to SI)
    "peak_bf16_tflops": ("peak_bf16_flops", 1e12), "peak_fp16_tflops": ("peak_fp16_flops", 1e12),
    "peak_fp8_tflops": ("peak_fp8_flops", 1e12), "memory_gib": ("memory_bytes", 2**30),
    "hbm_gbyte_s": ("hbm_bandwidth", 1e9), "matmul_efficiency": ("matmul_efficiency", 1.0),
    "reserved_gib": ("reserved_bytes", 2**30), "gemm_half_gflop": ("gemm_half_flops", 1e9),
    "sm_count": ("sm_count", 1), "kernel_launch_us": ("kernel_launch_s", 1e-6), "kernel_gap_us": ("kernel_gap_s", 1e-6),
    "shared_by": ("shared_by", 1),
}
_FAB_KEYS = {
    "bandwidth_gbit_s": ("bandwidth", 1e9 / 8), "bandwidth_gbyte_s": ("bandwidth", 1e9),
    "latency_us": ("latency", 1e-6), "call_latency_us": ("call_latency", 1e-6), "efficiency": ("efficiency", 1.0),
    "burst_kbyte": ("burst_bytes", 1e3),
}
#: per-collective efficiencies a fabric table may give (TOML key -> collective kind)
OP_EFFICIENCY_KEYS = {"all_gather_efficiency": "all_gather", "reduce_scatter_efficiency": "reduce_scatter",
                      "all_to_all_efficiency": "all_to_all", "p2p_efficiency": "p2p"}
_TOP_KEYS = ("name", "nodes", "gpus_per_node", "topology", "network_priority", "oversubscription",
             "accelerator", "intra_node", "inter_node")
# Tables of the same file that syncwise.launch reads (scheduler settings: syncwise.launch.spec); ignored here.
_LAUNCH_TABLES = ("launch", "slurm", "kubernetes")


def _number(path: str, value: Any, lo: float, lo_open: bool = True, hi: float = math.inf) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bound = f"> {lo:g}" if lo_open else f"≥ {lo:g}"
        raise ConfigError(path, value, f"a finite number {bound}" + (f" and ≤ {hi:g}" if hi < math.inf else ""))
    return float(value)


def _table(path: str, value: Any, catalog: dict, keys: dict, extra: tuple[str, ...]) -> tuple[str, Any, dict]:
    """(name, catalog entry or None, {field: SI value}) of an ``[accelerator]`` / ``[intra_node]`` /
    ``[inter_node]`` table, or of a bare catalog name given as a string."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(path, value, "a catalog name (" + ", ".join(catalog) + ") or a table of its keys")
    accepted = ["name", *keys, *extra, "source"]
    for key in value:
        if key not in accepted:
            raise ConfigError(f"{path}.{key}", value[key], f"a key of [{path.split('.')[-1]}]: " + ", ".join(accepted))
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", name, "a catalog name (" + ", ".join(catalog) + ") or a new name "
                          "with every number given")
    base = catalog.get(name.lower())
    fields: dict[str, Any] = {}
    for key, (attr, scale) in keys.items():
        if key in value:
            hi = 1.0 if attr in ("matmul_efficiency", "efficiency") else math.inf
            lo_open = attr not in ("peak_fp8_flops", "reserved_bytes", "latency", "call_latency", "gemm_half_flops",
                                   "sm_count", "kernel_launch_s", "kernel_gap_s", "burst_bytes")
            fields[attr] = _number(f"{path}.{key}", value[key], 0.0, lo_open, hi) * scale
            if attr == "sm_count":
                if value[key] != int(value[key]):
                    raise ConfigError(f"{path}.{key}", value[key], "a whole number of SMs ≥ 0")
                fields[attr] = int(value[key])
            if attr == "shared_by" and fields[attr] < 1:
                raise ConfigError(f"{path}.{key}", value[key], "a number ≥ 1 (workers sharing one compute unit)")
    if base is None:
        required = {"peak_bf16_flops": "peak_bf16_tflops", "memory_bytes": "memory_gib",
                    "matmul_efficiency": "matmul_efficiency"} if keys is _ACC_KEYS else \
            {"bandwidth": "bandwidth_gbit_s (or bandwidth_gbyte_s)"}
        missing = [key for attr, key in required.items() if attr not in fields]
        if missing:
            raise ConfigError(f"{path}.name", name, "a catalog name (" + ", ".join(catalog) + "), or a new entry "
                              "with its numbers: missing " + ", ".join(missing))
    return name, base, fields


def _codec_table(path: str, value: Any) -> tuple[tuple[str, float, float], ...]:
    """``[accelerator.codec_cost]``: compressor name = [ns per element, µs per tensor] → Accelerator.codec_cost."""
    from ..layout import COMPRESSORS

    if not isinstance(value, dict):
        raise ConfigError(path, value, "a table: compressor name = [ns per element, µs per tensor]")
    out = []
    for key, pair in value.items():
        if key not in COMPRESSORS:
            raise ConfigError(f"{path}.{key}", pair, "a compressor name: " + ", ".join(COMPRESSORS))
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ConfigError(f"{path}.{key}", pair, "[ns per element, µs per tensor]: two numbers ≥ 0")
        ns = _number(f"{path}.{key}[0]", pair[0], 0.0, False)
        us = _number(f"{path}.{key}[1]", pair[1], 0.0, False)
        out.append((key, ns * 1e-9, us * 1e-6))
    return tuple(sorted(out))


def cloud_from_dict(values: dict[str, Any], source: str = "cluster") -> CloudConfig:
    """Build a CloudConfig from the TOML tables (see ``examples/clusters/``); errors name the field."""
    if not isinstance(values, dict):
        raise ConfigError(source, values, "a table of cluster keys")
    for key in values:
        if key not in _TOP_KEYS and key not in _LAUNCH_TABLES:
            raise ConfigError(f"cluster.{key}", values[key], "a cluster key: " + ", ".join(_TOP_KEYS + _LAUNCH_TABLES))
    for key in ("nodes", "gpus_per_node"):
        if key not in values:
            raise ConfigError(f"cluster.{key}", None, "an integer ≥ 1 (required)")
    raw_acc = values.get("accelerator", "h100-sxm")
    name, base, fields = _table("cluster.accelerator", raw_acc, ACCELERATORS, _ACC_KEYS, ("codec_cost",))
    if isinstance(raw_acc, dict) and "codec_cost" in raw_acc:
        fields["codec_cost"] = _codec_table("cluster.accelerator.codec_cost", raw_acc["codec_cost"])
    if base is None:
        acc = Accelerator(name, fields["peak_bf16_flops"], fields.get("peak_fp16_flops", fields["peak_bf16_flops"]),
                          fields.get("peak_fp8_flops", 0.0), fields["memory_bytes"], fields.get("hbm_bandwidth", 2e12),
                          fields["matmul_efficiency"], fields.get("reserved_bytes", 3 * GIB), source="cluster file",
                          gemm_half_flops=fields.get("gemm_half_flops", 0.0), sm_count=fields.get("sm_count", 0),
                          kernel_launch_s=fields.get("kernel_launch_s", 0.0),
                          kernel_gap_s=fields.get("kernel_gap_s", 0.0), codec_cost=fields.get("codec_cost", ()),
                          shared_by=fields.get("shared_by", 1.0))
    else:
        acc = dataclasses.replace(base, **fields)
    fabrics = []
    for key, default in (("intra_node", "nvlink4"), ("inter_node", "ib-ndr")):
        extra = (("nics_per_node", "kind") if key == "inter_node" else ("kind",)) + tuple(OP_EFFICIENCY_KEYS)
        raw = values.get(key, default)
        fname, base, fields = _table(f"cluster.{key}", raw, FABRICS, _FAB_KEYS, extra)
        table = raw if isinstance(raw, dict) else {}
        kind = table.get("kind", base.kind if base else "ethernet")
        if kind not in FABRIC_KINDS:
            raise ConfigError(f"cluster.{key}.kind", kind, "one of: " + ", ".join(FABRIC_KINDS))
        nics = table.get("nics_per_node", base.nics_per_node if base else 1)
        count(f"cluster.{key}.nics_per_node", nics)
        ops = dict(base.op_efficiency) if base else {}
        for okey, kind_name in OP_EFFICIENCY_KEYS.items():
            if okey in table:
                ops[kind_name] = _number(f"cluster.{key}.{okey}", table[okey], 0.0, True, 1.0)
        fields["op_efficiency"] = tuple(sorted(ops.items()))
        if base is None:
            fab = Fabric(fname, kind, fields["bandwidth"], fields.get("latency", 10e-6),
                         fields.get("efficiency", 0.8), nics, source="cluster file",
                         call_latency=fields.get("call_latency", 0.0),
                         op_efficiency=fields["op_efficiency"], burst_bytes=fields.get("burst_bytes", 0.0))
        else:
            fab = dataclasses.replace(base, kind=kind, nics_per_node=nics, **fields)
        fabrics.append(fab)
    kwargs = {k: values[k] for k in ("nodes", "gpus_per_node", "topology", "network_priority") if k in values}
    if "oversubscription" in values:
        kwargs["oversubscription"] = _number("cluster.oversubscription", values["oversubscription"], 1.0, False)
    name = values.get("name", "")
    if not isinstance(name, str):
        raise ConfigError("cluster.name", name, "a string")
    return CloudConfig(accelerator=acc, intra_node=fabrics[0], inter_node=fabrics[1], name=name, **kwargs)


def read_cluster_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a cluster TOML file (``name`` defaults to the file's stem); errors name ``--cluster``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--cluster", str(path), "an existing cluster .toml file (see examples/clusters/)")
    try:
        values = tomllib.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError("--cluster", str(path), f"a readable, valid TOML file ({e})") from None
    values.setdefault("name", p.stem)
    return values


def load_cluster(path: str | Path) -> CloudConfig:
    """Read a cluster TOML file (``examples/clusters/*.toml``) into a CloudConfig."""
    return cloud_from_dict(read_cluster_toml(path), str(path))


def cluster(name: str, nodes: int, gpus_per_node: int = 8, *, intra: Optional[str] = None,
            inter: Optional[str] = None, nics_per_node: Optional[int] = None, **kwargs: Any) -> CloudConfig:
    """A CloudConfig from catalog names, e.g. ``cluster("a100-80gb", 4, 8, intra="nvlink3", inter="ib-hdr")``.
    Defaults: the accelerator's usual intra-node fabric, NDR InfiniBand (the lab's link for cpu-lab; none on
    one node), one NIC per GPU for InfiniBand / RoCE and one per node otherwise."""
    if name not in ACCELERATORS:
        raise ConfigError("cluster.accelerator", name, "one of: " + ", ".join(ACCELERATORS))
    intra = intra or ("nvlink3" if name.startswith("a100") else "nvlink-h800" if name == "h800" else
                      "pcie4" if name == "l40s" else "xgmi-mi300x" if name == "mi300x" else
                      "lab-loopback" if name == "cpu-lab" else "nvlink4")
    inter = inter or ("none" if nodes == 1 else "lab-tbf" if name == "cpu-lab" else "ib-ndr")
    for which, fabric in (("intra_node", intra), ("inter_node", inter)):
        if fabric not in FABRICS:
            raise ConfigError(f"cluster.{which}", fabric, "one of: " + ", ".join(FABRICS))
    inter_fabric = dataclasses.replace(FABRICS[inter], nics_per_node=nics_per_node or
                                       (gpus_per_node if FABRICS[inter].kind in ("infiniband", "roce") else 1))
    return CloudConfig(nodes, gpus_per_node, accelerator=ACCELERATORS[name], intra_node=FABRICS[intra],
                       inter_node=inter_fabric, **kwargs)
