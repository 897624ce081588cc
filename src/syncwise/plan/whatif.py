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
* the run's gradient bucket size is the training recipe's ``bucket_bytes`` (the mean bucket DDP makes of the
  model's parameter tensors under the run's cap: :func:`ddp_buckets`).

A prediction is applied as a difference: predicted step after − predicted step before is added to the measured
step, so what the model leaves out (Python overhead, data waits, stalls) stays as measured. Pure Python; a
preset is read through ``syncwise.plan.model.from_preset``.

Two costs the ideal model leaves out are priced from the run's own measurements where it has them:

* **overlap** (``Measured.overlap``): the cost model hides all but the last gradient bucket behind the backward.
  ``overlap`` is the fraction of that credit the run supports (1: the model's ideal; 0: nothing hides, every
  bucket's time stays on the step; None: the ideal, for callers that do not know). ``syncwise doctor`` sets it
  from the run: the gradient communication's measured hidden share, and on a CPU without a shaped link 0 (gloo's
  reductions run on the cores the backward uses: what "hides" slows the backward by as much);
* **a micro-batch's fixed host cost** (``Measured.microbatch_fixed_s``, seconds per micro-batch per stage rank,
  forward + backward: Python, kernel dispatch, the schedule's sends): the efficiency is fitted on the compute
  without it, and a change of micro-batches pays it per micro-batch (and per bubble slot under a pipeline).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from .cloud import CloudConfig, Fabric, cluster
from .cost import COMPUTE_TERMS, Prediction, bus_factor, predict
from .layout import SYNCWISE, Layout, Training
from .model import ModelSpec
from ..layout import BUCKET_CAP_MB

LAB_LATENCY_S = 100e-6   # cloud.py's lab-loopback latency (gloo over loopback, measured order of magnitude)
# Below this many bytes moved per step the collectives' time is latency and waiting for peers, not bandwidth: the
# catalog's link is kept instead of a "bandwidth" fitted from them — unless the bytes took SLOW_LINK_FACTOR × what
# the catalog's link (latency included) would take for them, which neither latency nor a few ms of waiting explain
# (tiny's 558 KB of gradients took 218 ms on the lab's 20 Mbit/s link, 0.6 ms on the catalog's loopback).
MIN_CALIBRATION_BYTES = 1 << 20
SLOW_LINK_FACTOR = 50.0
# Host cost of one gradient collective DDP issues from inside the backward on the lab's CPUs (bucket copy-in and
# copy-out, gloo's enqueue and its loopback round trip, on cores the backward shares): 309 µs and 313 µs per extra
# bucket at widths 64 and 256, measured by benchmarks/ddp_call_cost.py (2 gloo ranks; tiny buckets against 25 MB,
# 59 extra calls a step). The cost model's own per-bucket latency assumes the call hides behind the backward; on
# shared cores it does not, so what-if adds it to the step.
DDP_CALL_S = 310e-6


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
    bucket_cap_mb: float = BUCKET_CAP_MB
    latency_s: float = LAB_LATENCY_S
    accelerator: str = "cpu-lab"
    grad_calls: Optional[float] = None      # gradient collectives per step the ranks issued (flight recorder)
    per_call_s: float = DDP_CALL_S          # host cost of each, on the critical path
    overlap: Optional[float] = None         # the fraction of the model's backward/sync overlap the run supports
    microbatch_fixed_s: float = 0.0         # fixed host seconds per micro-batch per stage rank (fwd + bwd)


@dataclass
class WhatIf:
    """One change's prediction: the model's step before and after, and the measured step moved by the difference."""

    change: dict[str, Any]
    before: Prediction
    after: Prediction
    measured_step_s: float

    calls_before: float = 0.0     # gradient collectives per step, before and after the change
    calls_after: float = 0.0
    per_call_s: float = 0.0
    overlap_delta_s: float = 0.0  # the overlap credit the run does not support, after − before (see Measured.overlap)
    microbatch_delta_s: float = 0.0  # the micro-batches' fixed host cost, after − before

    @property
    def calls_delta_s(self) -> float:
        """What the change in the number of gradient collectives costs (per-call host overhead)."""
        return (self.calls_after - self.calls_before) * self.per_call_s

    @property
    def delta_s(self) -> float:
        return (self.after.step_time_s - self.before.step_time_s + self.calls_delta_s + self.overlap_delta_s
                + self.microbatch_delta_s)

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


def param_tensors(model: ModelSpec) -> list[int]:
    """Elements of each parameter tensor in the order DDP fills its buckets (reverse registration: head first):
    embedding, per block its attention matrices, norms and MLP matrices (a MoE block's experts as one tensor per
    matrix and expert, its router), the final norm and an untied head."""
    out = [model.vocab_size * model.d_model]
    for i in range(model.n_layers):
        out += [a * b for a, b in model.attention_matrices()]
        out += [model.d_model] * (4 if model.biases else 2)
        if model.layer_is_moe(i):
            out.append(model.n_routed_experts * model.d_model)
            out += [model.d_model * model.moe_hidden] * (model.mlp_matrices
                                                        * (model.n_routed_experts + model.n_shared_experts))
        else:
            out += [model.d_model * model.ffn_hidden] * model.mlp_matrices
    out.append(model.d_model)
    if not model.tie_embeddings:
        out.append(model.vocab_size * model.d_model)
    return out[::-1]


def ddp_buckets(model: ModelSpec, bucket_cap_mb: float, bytes_per_element: float = 4.0) -> int:
    """Buckets DDP makes of the model's gradients: tensors in reverse order, a new bucket when the next tensor
    would pass the cap, a tensor larger than the cap alone in its own (syncwise passes bucket_cap_mb, so DDP's
    1 MiB first bucket, used only for its default cap, does not apply)."""
    buckets, fill, cap = 0, 0.0, bucket_cap_mb * 2**20
    for n in param_tensors(model):
        b = n * bytes_per_element
        if buckets == 0 or fill + b > cap:
            buckets, fill = buckets + 1, 0.0
        fill += b
    return max(buckets, 1)


def calibrated_cloud(m: Measured) -> tuple[CloudConfig, Training]:
    """The cluster and recipe of the run: its ranks on one measured link, its bucket size."""
    world = m.layout.world
    cloud = cluster(m.accelerator, 1, world)
    # the cost model's latency of the sync: all-reduce message steps, once per bucket
    steps = 2 * max(1, math.ceil(math.log2(max(world, 2))))
    buckets = max(1.0, m.model.param_counts()[0] * 4 / (m.bucket_cap_mb * 1e6))
    catalog_s = (m.moved_bytes or 0) / cloud.intra_node.effective + steps * m.latency_s * buckets
    if m.moved_bytes and m.wire_s and (m.moved_bytes >= MIN_CALIBRATION_BYTES or
                                       m.wire_s >= SLOW_LINK_FACTOR * catalog_s):
        wire = max(m.wire_s - steps * m.latency_s * buckets, 0.05 * m.wire_s)
        link = Fabric("measured", "lab", m.moved_bytes / wire, m.latency_s, 1.0,
                      source="this run's effective bandwidth (bytes moved / collective time)")
    else:
        link = dataclasses.replace(cloud.intra_node, latency=m.latency_s)
    cloud = dataclasses.replace(cloud, intra_node=link)
    return cloud, dataclasses.replace(SYNCWISE, bucket_bytes=bucket_bytes(m.model, m.bucket_cap_mb))


def bucket_bytes(model: ModelSpec, bucket_cap_mb: float) -> float:
    """The mean bucket DDP makes under ``bucket_cap_mb``: the gradients over :func:`ddp_buckets` — the cost model
    counts buckets as gradient bytes / bucket bytes, which under a cap smaller than a tensor would count
    thousands of buckets where DDP makes one per tensor."""
    grads = sum(param_tensors(model)) * 4.0
    return grads / ddp_buckets(model, bucket_cap_mb)


def _compute_part(p: Prediction) -> float:
    return sum(p.breakdown[k] for k in COMPUTE_TERMS)


def fitted_efficiency(m: Measured, cloud: CloudConfig, training: Training) -> float:
    """The matmul efficiency at which the model's compute equals the measured compute less the micro-batches'
    fixed host cost (a few fixed-point steps: element-wise work does not scale with it)."""
    eff, target = 1.0, max(m.compute_s - _fixed_before(m), 0.1 * m.compute_s, 1e-9)
    for _ in range(4):
        p = predict(cloud, m.model, m.layout, m.global_batch, m.seq_len, training=training, syncwise_rules=False,
                    matmul_efficiency=eff)
        eff = min(1.0, max(1e-4, eff * _compute_part(p) / target))
    return eff


def _fixed_before(m: Measured) -> float:
    """The run's own micro-batches' fixed host cost inside its measured compute (busy time: no bubble slots)."""
    return m.microbatch_fixed_s * max(m.layout.microbatches or 1, 1)


def microbatch_cost(p: Prediction, fixed_s: float) -> float:
    """What ``fixed_s`` per micro-batch adds to a predicted step: once per micro-batch, and under a pipeline once per
    bubble slot too (a stage idles for the neighbour's micro-batch, fixed cost included): M / (1 − bubble
    fraction)."""
    if not fixed_s:
        return 0.0
    frac = min(float(p.info.get("bubble_fraction", 0.0) or 0.0), 0.99)
    return fixed_s * p.microbatches / (1.0 - frac)


def unsupported_overlap(p: Prediction, overlap: Optional[float]) -> float:
    """The part of the model's hidden gradient sync that the run does not support: (1 − overlap) × (sync total −
    exposed sync), for a sync every step (local SGD's averaging has its own overlap rule); 0 for overlap None."""
    if overlap is None:
        return 0.0
    b = p.breakdown
    if b.get("sync_exposed", 0.0) > 0 or b.get("dp_comm_exposed", 0.0) <= 0:
        return 0.0
    hidden = max(0.0, float(p.info.get("dp_comm_total", 0.0)) - b["dp_comm_exposed"])
    return (1.0 - min(max(overlap, 0.0), 1.0)) * hidden


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
        after_training, change["bucket_cap_mb"] = dataclasses.replace(
            training, bucket_bytes=bucket_bytes(m.model, bucket_cap_mb)), \
            bucket_cap_mb
    after = predict(cloud, m.model, layout, m.global_batch, m.seq_len, training=after_training, syncwise_rules=False,
                    matmul_efficiency=eff)
    # per-call host cost of the gradient collectives: DDP's buckets times the collectives each sends (PowerSGD 2)
    # on the lab's CPUs the host is the device: a per-call cost measured on the quiet machine slows with the compute
    # (the fitted efficiency is the run's speed against that machine's)
    per_call = m.per_call_s / eff if m.accelerator == "cpu-lab" else m.per_call_s
    w = WhatIf(change, before, after, measured_step_s, per_call_s=per_call if m.layout.dp > 1 else 0.0)
    w.overlap_delta_s = unsupported_overlap(after, m.overlap) - unsupported_overlap(before, m.overlap)
    # the run's fixed cost was measured at its own speed: it is not scaled by the fitted efficiency
    w.microbatch_delta_s = microbatch_cost(after, m.microbatch_fixed_s) - microbatch_cost(before, m.microbatch_fixed_s)
    if w.per_call_s:
        cap_after = bucket_cap_mb if bucket_cap_mb is not None else m.bucket_cap_mb
        est_before = ddp_buckets(m.model, m.bucket_cap_mb) * _calls_per_bucket(m.layout)
        scale = (m.grad_calls / est_before) if m.grad_calls else 1.0
        w.calls_before = m.grad_calls or est_before
        w.calls_after = ddp_buckets(m.model, cap_after) * _calls_per_bucket(layout) * scale
    return w


def _calls_per_bucket(layout: Layout) -> int:
    """Collectives per gradient bucket of the layout's compressor (its spec's; PowerSGD: 2)."""
    return max(1, int(getattr(layout.compress.spec, "collectives_per_bucket", 1) or 1))
