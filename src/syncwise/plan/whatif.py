"""What-if predictions for a run that happened: the cost model of :mod:`syncwise.plan.cost`, calibrated on the run.

``syncwise doctor`` measures a run (its compute per step, the bytes its gradient sync sent and how long that
took) and asks: what would this step cost with another compressor, another bucket size, more pipeline
micro-batches? The answer comes from ``predict`` on a cluster made of the run's own numbers:

* the accelerator is the catalog's ``cpu-lab`` (or any catalog entry), with the matmul efficiency fitted so the
  predicted compute (compute + recomputation + optimizer) equals the measured one;
* the link the data-parallel ranks share is one fabric whose bandwidth is the run's *effective* bandwidth —
  the bytes its collectives moved (bus factors of the cost model) divided by the time they took — and whose
  latency is ``latency_s`` (the lab's 100 µs by default: cloud.py's lab-loopback); a run that moved less than
  1 MiB per step keeps the catalog's loopback link (its collectives' time is latency and waits, not bandwidth);
* the run's gradient bucket size is the training recipe's ``bucket_bytes``.

A prediction is applied as a difference: predicted step after − predicted step before is added to the measured
step, so what the model leaves out (Python overhead, data waits, stalls) stays as measured. Pure Python; a
preset is read through ``syncwise.plan.model.from_preset``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from .cloud import CloudConfig, Fabric, cluster
from .cost import Prediction, bus_factor, predict
from .layout import SYNCWISE, Layout, Training
from .model import ModelSpec

LAB_LATENCY_S = 100e-6   # cloud.py's lab-loopback latency (gloo over loopback, measured order of magnitude)
# Below this many bytes moved per step the collectives' time is latency and waiting for peers, not bandwidth: the
# catalog's link is kept instead of a "bandwidth" fitted from them.
MIN_CALIBRATION_BYTES = 1 << 20


@dataclass
class Measured:
    """What a run measured, per optimizer step (seconds, bytes), and how it was laid out."""

    model: ModelSpec
    layout: Layout
    global_batch: int
    seq_len: int
    compute_s: float                        # forward + backward + optimizer, no waits (the useful compute)
    moved_bytes: Optional[float] = None     # bytes the gradient-sync collectives moved per rank (bus-factored)
    wire_s: Optional[float] = None          # seconds those collectives took per step
    bucket_cap_mb: float = 25.0
    latency_s: float = LAB_LATENCY_S
    accelerator: str = "cpu-lab"


@dataclass
class WhatIf:
    """One change's prediction: the model's step before and after, and the measured step moved by the difference."""

    change: dict[str, Any]
    before: Prediction
    after: Prediction
    measured_step_s: float

    @property
    def delta_s(self) -> float:
        return self.after.step_time_s - self.before.step_time_s

    @property
    def step_after_s(self) -> float:
        return max(1e-9, self.measured_step_s + self.delta_s)


def moved_bytes(op: str, payload_bytes: float, n: int) -> float:
    """Bytes one rank moves for a collective on a ``payload_bytes`` input (the cost model's bus factors; an
    all-gather's buffer is n × the payload)."""
    if op == "all_gather":
        return payload_bytes * n * bus_factor("all_gather", n)
    if op in ("all_reduce", "reduce_scatter", "all_to_all"):
        return payload_bytes * bus_factor(op, n)
    return payload_bytes


def calibrated_cloud(m: Measured) -> tuple[CloudConfig, Training]:
    """The cluster and recipe of the run: its ranks on one measured link, its bucket size."""
    world = m.layout.world
    cloud = cluster(m.accelerator, 1, world)
    if m.moved_bytes and m.wire_s and m.moved_bytes >= MIN_CALIBRATION_BYTES:
        # the cost model's latency of the sync: all-reduce message steps, once per bucket
        steps = 2 * max(1, math.ceil(math.log2(max(world, 2))))
        buckets = max(1.0, m.model.param_counts()[0] * 4 / (m.bucket_cap_mb * 1e6))
        wire = max(m.wire_s - steps * m.latency_s * buckets, 0.05 * m.wire_s)
        link = Fabric("measured", "lab", m.moved_bytes / wire, m.latency_s, 1.0,
                      source="this run's effective bandwidth (bytes moved / collective time)")
    else:
        link = dataclasses.replace(cloud.intra_node, latency=m.latency_s)
    cloud = dataclasses.replace(cloud, intra_node=link)
    return cloud, dataclasses.replace(SYNCWISE, bucket_bytes=m.bucket_cap_mb * 1e6)


def _compute_part(p: Prediction) -> float:
    b = p.breakdown
    return b["compute"] + b["kernel_overhead"] + b["recompute"] + b["optimizer"]


def fitted_efficiency(m: Measured, cloud: CloudConfig, training: Training) -> float:
    """The matmul efficiency at which the model's compute equals the measured compute (a few fixed-point steps:
    element-wise work does not scale with it)."""
    eff = 1.0
    for _ in range(4):
        p = predict(cloud, m.model, m.layout, m.global_batch, m.seq_len, training=training, syncwise_rules=False,
                    matmul_efficiency=eff)
        eff = min(1.0, max(1e-4, eff * _compute_part(p) / max(m.compute_s, 1e-9)))
    return eff


def whatif(m: Measured, measured_step_s: float, *, compress: Optional[str] = None,
           bucket_cap_mb: Optional[float] = None, microbatches: Optional[int] = None,
           pp_schedule: Optional[str] = None) -> WhatIf:
    """Predict the run's step after one change (a compressor, a bucket size, pipeline micro-batches or schedule)."""
    cloud, training = calibrated_cloud(m)
    eff = fitted_efficiency(m, cloud, training)
    before = predict(cloud, m.model, m.layout, m.global_batch, m.seq_len, training=training, syncwise_rules=False,
                     matmul_efficiency=eff)
    layout, after_training, change = m.layout, training, {}
    if compress is not None:
        layout, change["compress"] = dataclasses.replace(layout, compress=compress), compress
    if microbatches is not None:
        layout, change["microbatches"] = dataclasses.replace(layout, microbatches=microbatches, micro_batch=0), \
            microbatches
    if pp_schedule is not None:
        layout, change["pp_schedule"] = dataclasses.replace(layout, pp_schedule=pp_schedule), pp_schedule
    if bucket_cap_mb is not None:
        after_training, change["bucket_cap_mb"] = dataclasses.replace(training, bucket_bytes=bucket_cap_mb * 1e6), \
            bucket_cap_mb
    after = predict(cloud, m.model, layout, m.global_batch, m.seq_len, training=after_training, syncwise_rules=False,
                    matmul_efficiency=eff)
    return WhatIf(change, before, after, measured_step_s)
