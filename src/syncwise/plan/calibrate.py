"""``syncwise plan --calibrate``: measure this machine (or the network lab) and write a CloudConfig TOML.

What is measured, on every worker at once (so workers that share cores measure what each gets in a run):

* **GEMMs**: square matmuls of 32…1024 (fp32 on a CPU, bf16 on a GPU) → the peak (best FLOP/s) and the
  GEMM-size efficiency curve ``eff(F) = F / (F + gemm_half_flops)``, fitted as ``t = F / peak + t0`` by
  relative least squares (``fit_gemm``).
* **Memory bandwidth**: an element-wise add over 64 MiB (read + write) → ``hbm_gbyte_s``, which prices the
  cost model's element-wise passes and the optimizer step.
* **A reference training step**: forward + backward + AdamW of a syncwise preset (``small-dense``, 8 × 128
  tokens by default) on one process per worker, no communication → ``matmul_efficiency``: the efficiency at
  which the cost model's single-process step time equals the measured one (``solve_efficiency``). This is
  the "short measured single-process step"; the lab rows it is later compared with are never used.
* **Communication**: ``syncwise comm-bench``'s sweep (``syncwise.comm.bench.run_sweep``) of all-reduce,
  all-gather, reduce-scatter and all-to-all over all ranks at a small (latency) and a large (bandwidth) size;
  in the lab with several workers per node, the same four collectives inside each node at once (node
  subgroups). Efficiencies are solved from the cost model's own collective formula (``collective_time``),
  so the planner reproduces the measured times; the all-reduce's is the fabric's ``efficiency``, the
  others' become ``all_gather_efficiency`` ... when they differ. In the lab, its tbf bucket becomes the
  inter-node fabric's ``burst_kbyte``.
* **Compressors**: each compressor's encode + decode on three gradient sets (two synthetic, the reference
  preset's) in a 1-rank group (``measure_codecs``) → ``[accelerator.codec_cost]``: ns per element and µs per
  tensor (``fit_codec``).

The launcher side (``calibrate``, ``cloud_toml``, the fits) is pure Python; the worker side imports torch
inside its functions, so ``import syncwise.plan`` stays torch-free.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import SyncwiseError
from ..specs import spec_name
from .cloud import Accelerator, CloudConfig, Fabric, cloud_from_dict

GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
REFERENCE_PRESET, REFERENCE_BATCH, REFERENCE_SEQ = "small-dense", 8, 128
SMALL_MESSAGE = 4096
GIB = 2**30


# ------------------------------------------------------------------------------------------------ pure fits
def _relative_lsq(pts: Sequence[tuple[float, float, float]]) -> Optional[tuple[float, float]]:
    """(a, b) of ``t = a·x + b·y`` through (x, y, t) points by least squares on the relative error (weights 1/t²),
    unconstrained; None when the two regressors cannot be told apart."""
    w = [1 / t ** 2 for _, _, t in pts]
    sxx = sum(wi * x * x for wi, (x, _, _) in zip(w, pts))
    syy = sum(wi * y * y for wi, (_, y, _) in zip(w, pts))
    sxy = sum(wi * x * y for wi, (x, y, _) in zip(w, pts))
    sxt = sum(wi * x * t for wi, (x, _, t) in zip(w, pts))
    syt = sum(wi * y * t for wi, (_, y, t) in zip(w, pts))
    det = sxx * syy - sxy * sxy
    if not det:
        return None
    a = (syy * sxt - sxy * syt) / det
    return a, (syt - a * sxy) / syy


def _through_origin(pts: Sequence[tuple[float, float, float]], term: int) -> float:
    """The one coefficient of ``t = c · (x or y)`` (``term`` 0 or 1) by the same relative least squares."""
    num = sum(p[term] * p[2] / p[2] ** 2 for p in pts)
    den = sum(p[term] ** 2 / p[2] ** 2 for p in pts)
    return num / den if den else 0.0


def fit_gemm(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(peak FLOP/s, gemm_half_flops) from (FLOPs, seconds) pairs: ``t = F / peak + t0`` by least squares on
    the relative error (weights 1/t²), ``t0 ≥ 0``; half = t0 × peak (the GEMM size at half the peak)."""
    pts = [(float(f), 1.0, float(t)) for f, t in points if f > 0 and t > 0]
    if not pts:
        raise ValueError("no GEMM measurements")
    if len(pts) == 1:
        return pts[0][0] / pts[0][2], 0.0
    fit = _relative_lsq(pts)
    a, b = fit if fit is not None else (0.0, 0.0)
    if b < 0 or a <= 0:                      # no measurable fixed cost: t = F / peak through the origin
        a, b = _through_origin(pts, 0), 0.0
    return 1 / a, b / a


def solve_efficiency(acc: Accelerator, model: Any, batch: int, seq_len: int, measured_s: float,
                     training: Any = None) -> float:
    """The ``matmul_efficiency`` at which the cost model's single-process step (``predict`` on one worker, no
    communication) takes ``measured_s``: the step is A / eff + B, A and B read from two predictions."""
    from .cost import predict
    from .layout import Layout

    training = training or recipe_for(acc)

    def step(eff: float) -> float:
        one = CloudConfig(1, 1, accelerator=dataclasses.replace(acc, matmul_efficiency=eff),
                          inter_node=Fabric("none", "none", 1e30, 0.0, 1.0))
        return predict(one, model, Layout(), batch, seq_len, training=training, syncwise_rules=False).step_time_s

    s1, s2 = step(1.0), step(0.5)
    a = s2 - s1            # A / 0.5 - A / 1
    b = s1 - a
    if measured_s <= b or a <= 0:
        return 1.0
    return max(0.01, min(1.0, a / (measured_s - b)))


def recipe_for(acc: Accelerator) -> Any:
    """The training recipe of a calibrated accelerator: on a CPU syncwise trains in fp32 (mixed_precision
    'auto' = none), so activations and tensor-parallel traffic are 4 bytes, not bf16's 2; and FSDP2's collectives
    do not overlap compute there (``Training.overlap_fsdp``: its streams are the host thread)."""
    from .layout import SYNCWISE

    if acc.name.startswith("cpu"):
        return dataclasses.replace(SYNCWISE, name="syncwise-fp32", activation_bytes=4, overlap_fsdp=False)
    return SYNCWISE


def solve_fabric(kind: str, nbytes: float, seconds: float, n: int, per_node: int, gpus_per_node: int,
                 latency: float, inter: bool) -> float:
    """Achievable bytes/s of one link (bandwidth × efficiency) that makes the cost model's ``collective_time``
    of this collective equal the measured ``seconds`` (its latency part taken off first)."""
    from .cost import _steps, collective_time

    probe = Fabric("probe", "lab", 1.0, 0.0, 1.0)          # 1 byte/s, no latency: the time is bytes moved
    nodes = max(1, n // per_node) if inter else 1
    cloud = CloudConfig(nodes, gpus_per_node if inter else n, intra_node=probe if not inter else
                        Fabric("fast", "lab", 1e30, 0.0, 1.0), inter_node=probe)
    moved = collective_time(cloud, kind, nbytes, n, per_node if inter else n)
    wire = seconds - _steps(kind, n) * latency
    if wire <= 0:
        wire = seconds
    return moved / wire


# ------------------------------------------------------------------------------------------------ worker side
def _device():
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from ..comm import ops

        ops.barrier()


def measure_gemm(sizes: Sequence[int] = GEMM_SIZES, seconds: float = 0.25) -> list[dict]:
    """FLOP/s of square GEMMs (fp32 on a CPU, bf16 on a GPU), each timed for about ``seconds``; every rank runs
    them at once (a barrier before each size)."""
    import torch

    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for s in sizes:
        a = torch.randn(s, s, device=device, dtype=dtype)
        b = torch.randn(s, s, device=device, dtype=dtype)
        flops = 2.0 * s * s * s
        for _ in range(3):
            a @ b
        _sync(device)
        _barrier()
        reps, t0 = 0, time.perf_counter()
        while True:
            for _ in range(8):
                a @ b
            reps += 8
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        rows.append({"size": s, "flops": flops, "seconds": elapsed / reps, "flop_s": flops * reps / elapsed,
                     "dtype": str(dtype).replace("torch.", "")})
    return rows


def measure_kernels(n: int = 2000) -> dict:
    """On a GPU: its SM count (``multi_processor_count``), the host's seconds per launched kernel (``n`` tiny
    in-place adds issued back to back through PyTorch's eager dispatcher, as a training step issues its kernels)
    and the device's seconds per kernel when the queue is full (the same adds queued behind a ``torch.cuda._sleep``
    that lets the host run ahead, timed with CUDA events: kernel time + the gap between kernels). ``{}`` on a
    CPU, whose per-op cost stays inside the calibrated efficiency."""
    import torch

    device = _device()
    if device.type != "cuda":
        return {}
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1.0)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = (time.perf_counter() - t0) / n
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(5e7))                  # keeps the device busy while the host queues the adds
    start.record()
    for _ in range(n):
        x.add_(1.0)
    end.record()
    _sync(device)
    gap = start.elapsed_time(end) / 1e3 / n
    return {"sm_count": int(torch.cuda.get_device_properties(device).multi_processor_count),
            "kernel_launch_s": host, "kernel_gap_s": gap}


def measure_memory(nbytes: int = 64 * 2**20, reps: int = 8) -> float:
    """Bytes/s of an element-wise add (read one buffer, write another) over ``nbytes``."""
    import torch

    device = _device()
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    torch.add(x, 1.0, out=y)
    _sync(device)
    _barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.add(x, 1.0, out=y)
    _sync(device)
    return 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)


def measure_reference_step(preset: str = REFERENCE_PRESET, batch: int = REFERENCE_BATCH, seq_len: int = REFERENCE_SEQ,
                           steps: int = 3) -> float:
    """Median seconds of a single-process training step (forward, backward, AdamW; no communication) of a
    syncwise preset, as ``syncwise train`` computes it (bf16 autocast on a GPU, fp32 on a CPU)."""
    import torch

    from ..models import PRESETS, build_model, lm_loss

    device = _device()
    torch.manual_seed(0)
    model = build_model(preset).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = PRESETS[preset].vocab_size
    x = torch.randint(0, vocab, (batch, seq_len), device=device)
    y = torch.randint(0, vocab, (batch, seq_len), device=device)
    times = []
    for i in range(steps + 1):
        _barrier()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i:                                     # the first step warms up (allocations, kernel choice)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


#: the compressors ``measure_codecs`` times (a spec's options are those syncwise bench's tables use; PowerSGD from
#: its first step: its default start_iter=10 sends its first 10 steps uncompressed, which would time an fp32 copy)
CODEC_SPECS = ("fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.01", "randomk:ratio=0.01",
               "powersgd:rank=4,start_iter=0", "demo")
#: two synthetic gradient sets: one large tensor (the per-element cost) and many small ones (the per-tensor cost);
#: ``measure_codecs`` adds the reference preset's own gradient shapes (mid-sized matrices, norms)
CODEC_SETS = (((1024, 1024),), ((64, 64),) * 32)


def measure_codecs(group: Any, specs: Sequence[str] = CODEC_SPECS, steps: int = 3,
                   reference: Optional[str] = REFERENCE_PRESET) -> list[dict]:
    """Each compressor's encode + decode (``syncwise.compress.profile_compressor``, the default compression policy
    of a run) averaging :data:`CODEC_SETS` and the ``reference`` preset's gradient shapes over ``group`` — a 1-rank
    group, so the collective is a local copy and the time is the compressor's compute, measured by every worker at
    once (as in a run). One row per (spec, set): elements, tensors, seconds."""
    import torch

    from ..compress import CompressionPolicy, parse_compress_spec, profile_compressor

    sets: list[tuple] = list(CODEC_SETS)
    if reference:
        from ..models import build_model

        sets.append(tuple(tuple(p.shape) for p in build_model(reference).parameters()))
    g = torch.Generator().manual_seed(0)
    rows = []
    for spec in specs:
        for shapes in sets:
            grads = [(f"w{i}", torch.randn(shape, generator=g)) for i, shape in enumerate(shapes)]
            prof = profile_compressor(parse_compress_spec(spec), grads, policy=CompressionPolicy(), steps=steps,
                                      group=group)
            rows.append({"spec": spec, "elements": prof["elements"], "tensors": len(grads),
                         "seconds": prof["ms_per_step"] / 1e3})
    return rows


def fit_codec(rows: Sequence[dict]) -> tuple[float, float]:
    """(seconds per element, seconds per tensor), ``t = a·E + b·T`` through a compressor's measurements by least
    squares on the relative error (weights 1/t², as ``fit_gemm``), each ≥ 0: a negative part is noise, and then the
    other carries all of the time (the better of the two one-parameter fits)."""
    pts = [(float(r["elements"]), float(r["tensors"]), float(r["seconds"])) for r in rows if r["seconds"] > 0]
    if not pts:
        return 0.0, 0.0
    fit = _relative_lsq(pts)
    if fit is not None and fit[0] >= 0 and fit[1] >= 0:
        return fit

    def err(a: float, b: float) -> float:
        return sum(((a * e + b * t - s) / s) ** 2 for e, t, s in pts)

    return min((_through_origin(pts, 0), 0.0), (0.0, _through_origin(pts, 1)), key=lambda ab: err(*ab))


def _time_group(op: str, nbytes: int, group, n: int, iters: int) -> float:
    """Median seconds of ``op`` on ``nbytes`` (comm-bench's definition of the buffer) inside ``group``."""
    import statistics

    import torch

    from ..comm import ops as cops
    from ..comm.stats import CommStats

    from ..comm import timing

    stats = CommStats()
    count = max(n, nbytes // 4 // n * n)
    chunk = count // n
    dev = _device()  # the group's device: NCCL takes CUDA buffers only (issue 24)
    ones = lambda c: torch.ones(c, device=dev)  # noqa: E731
    empty = lambda c: torch.empty(c, device=dev)  # noqa: E731
    if op == "all_reduce":
        buf = ones(count)
        call = lambda: cops.all_reduce(buf, "sum", group=group, stats=stats)  # noqa: E731
    elif op == "all_gather":
        inp, out = ones(chunk), empty(count)
        call = lambda: cops.all_gather(out, inp, group=group, stats=stats)  # noqa: E731
    elif op == "reduce_scatter":
        inp, out = ones(count), empty(chunk)
        call = lambda: cops.reduce_scatter(out, inp, "sum", group=group, stats=stats)  # noqa: E731
    else:
        inp, out = ones(count), empty(count)
        call = lambda: cops.all_to_all(out, inp, group=group, stats=stats)  # noqa: E731
    call()
    samples = []
    for _ in range(iters):
        cops.barrier()
        timing.synchronize(dev)
        with timing.timed(dev) as iv:  # CUDA events: the collective itself, not its enqueue
            call()
        samples.append(iv.seconds())
    # a CPU control tensor: the gloo half of an NCCL job's group (devices.NCCL_PROCESS_GROUP)
    worst = torch.tensor(samples, dtype=torch.float64)
    cops.all_reduce(worst, "max", stats=stats)          # as comm-bench: the slowest rank, every iteration
    return statistics.median(worst.tolist())


def worker(options: dict) -> dict:
    """One calibration worker (under torchrun or ``run_local``): every rank measures compute at once, then the
    collectives; rank 0 returns everything (other ranks their own compute numbers)."""
    import torch
    import torch.distributed as dist

    from ..comm.bench import run_sweep
    from ..comm.context import CommContext, Topology

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(options.get("procs_per_node") or os.environ.get("LOCAL_WORLD_SIZE", world))
    topology = Topology(world // per_node, per_node) if world % per_node == 0 else None
    with CommContext(timeout_s=float(options.get("timeout", 600)), topology=topology) as ctx:
        rank = ctx.rank
        gemm = measure_gemm(options.get("gemm_sizes", GEMM_SIZES), options.get("gemm_seconds", 0.25))
        memory = measure_memory()
        ref = options.get("reference") or [REFERENCE_PRESET, REFERENCE_BATCH, REFERENCE_SEQ]
        step_s = measure_reference_step(ref[0], int(ref[1]), int(ref[2]), int(options.get("reference_steps", 3)))
        alone, _ = dist.new_subgroups(group_size=1)       # every rank's own 1-rank group (all ranks create all)
        specs = options.get("codecs", CODEC_SPECS)           # [] / None: not measured
        codecs = measure_codecs(alone, specs, reference=ref[0]) if specs else []
        mine = {"rank": rank, "gemm": gemm, "memory_bytes_s": memory, "reference_step_s": step_s,
                "kernels": measure_kernels(), "codecs": codecs, "threads": torch.get_num_threads()}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        sizes = sorted({SMALL_MESSAGE, int(options.get("large_bytes", 16 * 2**20))})
        rows = run_sweep(COMM_OPS, sizes, iters=int(options.get("iters", 5)), warmup=2, ctx=ctx)
        intra: list[dict] = []
        nodes = world // per_node
        if nodes > 1 and per_node > 1:             # inside each node, all nodes at once (node subgroups)
            from ..comm.ops import new_group

            groups = [new_group(list(range(k * per_node, (k + 1) * per_node)), desc="calibrate-node")
                      for k in range(nodes)]
            mine_group = groups[rank // per_node]
            for op in COMM_OPS:
                for size in sorted({SMALL_MESSAGE, int(options.get("intra_large_bytes", 16 * 2**20))}):
                    t = _time_group(op, size, mine_group, per_node, int(options.get("iters", 5)))
                    intra.append({"op": op, "bytes": size, "time_s": t, "world_size": per_node})
    return {"workers": everyone, "world": rows, "intra": intra, "nodes": nodes, "procs_per_node": per_node,
            "world_size": world, "reference": ref, "torch": torch.__version__,
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def _local_worker(options: dict) -> dict:
    return worker(options)


def main(argv: Optional[list[str]] = None) -> int:
    """torchrun worker module (the lab): ``python -m syncwise.plan.calibrate --options JSON --json OUT``."""
    p = argparse.ArgumentParser(prog="python -m syncwise.plan.calibrate")
    p.add_argument("--options", default="{}")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    result = worker(json.loads(a.options))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


# ------------------------------------------------------------------------------------------------ launcher side
def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _pow2_at_most(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


def calibrate(lab: bool = False, prefix: Optional[str] = None, nproc: Optional[int] = None,
              reference: tuple[str, int, int] = (REFERENCE_PRESET, REFERENCE_BATCH, REFERENCE_SEQ),
              iters: int = 5, launcher: Optional[Callable[..., Any]] = None) -> dict:
    """Run the measurements (local workers, or a torchrun job across the lab's nodes) and return the raw result
    plus the derived cluster (``result["cluster"]``, the TOML tables as a dict). The workers start through
    ``launcher``: the launch table's ``syncwise.launch.run.launch``, which the command passes in (launch sits
    above plan)."""
    if launcher is None:
        raise ValueError("calibrate() needs launcher=syncwise.launch.run.launch")
    options: dict[str, Any] = {"reference": list(reference), "iters": iters}
    started = time.time()
    if lab:
        from ..lab.cluster import PREFIX, require

        state = require(prefix or PREFIX)
        per_node = nproc or state.procs_per_node
        rate = state.inter_node_bps / 8
        # the large message: about half a second on the link, 1-64 MiB
        options["large_bytes"] = min(64 * 2**20, max(2**20, _pow2_at_most(rate * 0.5)))
        options["procs_per_node"] = per_node
        with tempfile.TemporaryDirectory(prefix="syncwise-calibrate-") as tmp:
            out = Path(tmp) / "result.json"
            code = launcher(argv=["syncwise.plan.calibrate", "--options", json.dumps(options), "--json", str(out)],
                            nproc=per_node, lab=True, lab_prefix=state.prefix).codes[0]
            if code != 0 or not out.exists():
                raise SyncwiseError(f"the lab calibration job failed (exit code {code}); see the worker output")
            result = json.loads(out.read_text())
        result["lab"] = {"prefix": state.prefix, "nodes": state.num_nodes, "inter_node": state.inter_node,
                         "inter_node_bps": state.inter_node_bps, "intra_node": state.intra_node,
                         "burst_bytes": state.burst}
    else:
        per_node = nproc or 2
        options["procs_per_node"] = per_node
        result = launcher(fn=_local_worker, args=(options,), nproc=per_node).results[0]
        result["lab"] = None
    result["measured_at"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["host"] = platform.node()
    result["cpu_count"] = os.cpu_count()
    result["seconds"] = time.time() - started
    result["cluster"] = derive_cluster(result)
    return result


def derive_cluster(result: dict) -> dict:
    """The CloudConfig tables (TOML keys) from a calibration result; pure Python."""
    from .model import load_model

    workers = result["workers"]
    nodes, per_node, world = result["nodes"], result["procs_per_node"], result["world_size"]
    cpu = result.get("device", "cpu") == "cpu"
    # compute: the median worker's GEMM curve (workers ran at once, sharing cores as in a run)
    fits = [fit_gemm([(r["flops"], r["seconds"]) for r in w["gemm"]]) for w in workers]
    peak = _median([f[0] for f in fits])
    half = _median([f[1] for f in fits])
    hbm = _median([w["memory_bytes_s"] for w in workers])
    step_s = _median([w["reference_step_s"] for w in workers])
    preset, batch, seq = result["reference"]
    # a GPU's SM count and per-kernel costs (measure_kernels; none on a CPU): the GEMM-shape and launch terms.
    # With an SM count the shape model prices small GEMMs itself: the fitted fixed cost is not added on top.
    kern = [w.get("kernels") or {} for w in workers]
    kern = [k for k in kern if k]
    sms = int(_median([k["sm_count"] for k in kern])) if kern else 0
    launch = _median([k["kernel_launch_s"] for k in kern]) if kern else 0.0
    gap = _median([k["kernel_gap_s"] for k in kern]) if kern else 0.0
    if sms:
        half = 0.0
    acc = Accelerator("cpu-measured" if cpu else "gpu-measured", peak, peak, 0.0, 1.0, hbm, 1.0,
                      gemm_half_flops=half, sm_count=sms, kernel_launch_s=launch, kernel_gap_s=gap)
    eff = solve_efficiency(acc, load_model(preset, int(seq)), int(batch), int(seq), step_s)
    if cpu:
        mem = _physical_memory() / world
        reserved = 0.4
    else:
        mem, reserved = 80 * GIB, 3.0
    accelerator = {"name": acc.name, "peak_bf16_tflops": peak / 1e12, "peak_fp16_tflops": peak / 1e12,
                   "memory_gib": round(mem / GIB, 2), "hbm_gbyte_s": hbm / 1e9, "matmul_efficiency": round(eff, 4),
                   "gemm_half_gflop": half / 1e9, "reserved_gib": reserved}
    if sms:
        accelerator.update(sm_count=sms, kernel_launch_us=round(launch * 1e6, 3), kernel_gap_us=round(gap * 1e6, 3))
    codec = {}
    for spec in dict.fromkeys(r["spec"] for w in workers for r in w.get("codecs") or []):
        fits = [fit_codec([r for r in w["codecs"] if r["spec"] == spec]) for w in workers if w.get("codecs")]
        codec[spec_name(spec)] = [round(_median([f[0] for f in fits]) * 1e9, 4),
                                         round(_median([f[1] for f in fits]) * 1e6, 3)]
    if codec:
        accelerator["codec_cost"] = codec
    # CPU workers on this host's cores (locally, and the lab's namespaces): workers × threads per core
    threads = sum(int(w.get("threads") or 1) for w in workers)
    cores = result.get("cpu_count") or 0
    if cpu and cores and threads > cores:
        accelerator["shared_by"] = round(threads / cores, 4)
    # communication
    world_rows = result["world"]
    intra_rows = result["intra"] if nodes > 1 else world_rows
    lab = result.get("lab") or {}
    intra = _fabric(intra_rows, per_node, per_node, per_node, inter=False) if per_node > 1 else None
    inter = _fabric(world_rows, world, per_node, per_node, inter=True, line=lab.get("inter_node_bps", 0) / 8) \
        if nodes > 1 else None
    tables: dict[str, Any] = {"name": "", "nodes": nodes, "gpus_per_node": per_node, "topology": "single_switch",
                              "network_priority": "balanced", "accelerator": accelerator}
    tables["intra_node"] = {"name": "measured-intra", "kind": "lab" if cpu else "nvlink", **intra} if intra else \
        {"name": "lab-loopback" if cpu else "nvlink4"}
    if inter and lab.get("burst_bytes"):          # the lab's tbf bucket (Fabric.burst_bytes)
        inter["burst_kbyte"] = lab["burst_bytes"] / 1e3
    tables["inter_node"] = {"name": "measured-inter", "kind": "lab" if lab else "ethernet", **inter,
                            "nics_per_node": 1} if inter else {"name": "none"}
    cloud_from_dict(tables)      # the file must load: fail here, not in the user's next command
    return tables


def _fabric(rows: list[dict], n: int, per_node: int, gpus_per_node: int, inter: bool,
            line: float = 0.0) -> dict:
    """A fabric table from comm-bench rows of one group size: latency per message step (the smallest
    all-reduce), bandwidth = the line rate (``line``, bytes/s; else the fastest collective's achieved rate) and
    every collective's efficiency = its achieved bytes/s per link ÷ that bandwidth."""
    from .cost import _steps

    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("world_size", n) == n:
            by.setdefault(r["op"], []).append(r)
    # latency: the median over the collectives of the smallest message's time per message step (one noisy
    # small all-reduce right after the compute measurements moved it 5× in a trial)
    latency = _median([min(rs, key=lambda r: r["bytes"])["time_s"] / max(1, _steps(op, n)) for op, rs in by.items()])
    achieved = {}
    for op, rs in by.items():
        big = max(rs, key=lambda r: r["bytes"])
        achieved[op] = solve_fabric(op, big["bytes"], big["time_s"], n, per_node, gpus_per_node, latency, inter)
    ref = line or max(achieved.values())      # an op faster than the line rate is capped at efficiency 1
    out: dict[str, Any] = {("bandwidth_gbit_s" if line else "bandwidth_gbyte_s"): ref * (8 if line else 1) / 1e9,
                           "latency_us": latency * 1e6, "efficiency": round(min(1.0, achieved["all_reduce"] / ref), 4)}
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        if op in achieved:
            out[f"{op}_efficiency"] = round(min(1.0, achieved[op] / ref), 4)
    return out


def _physical_memory() -> float:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            return float(limit)
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * GIB


def cloud_toml(result: dict, command: str = "syncwise plan --calibrate") -> str:
    """The calibration as a cluster TOML (``load_cluster`` reads it), with a comment saying it was measured,
    when, where and how, and the raw numbers behind each value."""
    t = result["cluster"]
    w = result["workers"]
    lines = [f"# Measured by `{command}` on {result.get('host', '?')} at {result.get('measured_at', '?')}"
             f" ({result.get('seconds', 0):.0f} s; torch {result.get('torch', '?')}, {result.get('cpu_count', '?')} cores).",
             f"# {result['world_size']} workers = {result['nodes']} node(s) × {result['procs_per_node']}, measuring at "
             "once (workers that share cores measure what each gets in a run).",
             "# compute: square GEMMs " + ", ".join(f"{r['size']}: {r['flop_s'] / 1e9:.1f}" for r in w[0]["gemm"])
             + f" GFLOP/s ({w[0]['gemm'][0]['dtype']}, rank 0) -> peak = best fit t = F/peak + t0 over "
             "the workers' medians; gemm_half_gflop = t0 × peak (GEMM size at half the peak).",
             f"# memory: element-wise add over 64 MiB, {_median([x['memory_bytes_s'] for x in w]) / 1e9:.1f} GB/s.",
             *([f"# kernels: {k['sm_count']} SMs; {k['kernel_launch_s'] * 1e6:.2f} µs per launch on the host "
                f"(back-to-back adds), {k['kernel_gap_s'] * 1e6:.2f} µs per kernel on a full queue (rank 0); "
                "with an SM count the GEMM-shape model prices small GEMMs, so gemm_half_gflop is 0."]
               if (k := w[0].get("kernels")) else []),
             *(["# codec_cost: each compressor's encode + decode in a 1-rank group (calibrate.measure_codecs) on "
                f"1 × 1024², 32 × 64² and the {result['reference'][0]} preset's fp32 gradients, fitted t = elements × "
                "ns + tensors × µs (rank 0: " + ", ".join(
                    f"{spec_name(r['spec'])} {r['seconds'] * 1e3:.2f}" for r in w[0]["codecs"]) + " ms)"]
               if w[0].get("codecs") else []),
             f"# matmul_efficiency: the cost model's single-process step equals a measured "
             f"{result['reference'][0]} step ({result['reference'][1]} x {result['reference'][2]} tokens, forward + "
             f"backward + AdamW, no communication): median {_median([x['reference_step_s'] for x in w]) * 1e3:.0f} ms.",
             "# communication: syncwise comm-bench (all_reduce, all_gather, reduce_scatter, all_to_all) over all "
             "ranks" + (", and inside each node at once" if result["intra"] else "") + "; latency per message "
             "step from the smallest messages (median over the collectives), efficiencies so the planner's collective formula reproduces the "
             "largest message's time:"]
    for name, rows in (("all ranks", result["world"]), ("inside a node", result["intra"])):
        for r in rows:
            lines.append(f"#   {name}: {r['op']} {r['bytes'] / 2**20:.3g} MiB {r['time_s'] * 1e3:.2f} ms")
    if result.get("lab"):
        lab = result["lab"]
        lines.append(f"# network lab '{lab['prefix']}': {lab['nodes']} nodes, inter-node tbf {lab['inter_node']}"
                     + (f", intra-node {lab['intra_node']}" if lab.get("intra_node") else ", loopback unshaped"))
    lines.append("")
    lines += _toml_table(None, {k: v for k, v in t.items() if not isinstance(v, dict) and v != ""})
    lines.append(f'name = "calibrated-{result["nodes"]}x{result["procs_per_node"]}"')
    for key in ("accelerator", "intra_node", "inter_node"):
        lines.append("")
        lines += _toml_table(key, t[key])
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(float(f"{v:.6g}"))


def _toml_table(name: Optional[str], values: dict) -> list[str]:
    """TOML lines of a table; its dict values become sub-tables after it (``[name.key]``)."""
    out = [f"[{name}]"] if name else []
    out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    for k, v in values.items():
        if isinstance(v, dict):
            out += ["", *_toml_table(f"{name}.{k}" if name else k, v)]
    return out


if __name__ == "__main__":
    sys.exit(main())
