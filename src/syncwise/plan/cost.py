"""Step time of one layout: compute, each parallel dimension's communication over the fabric it crosses, the
pipeline bubble, the data-parallel sync and how much of it backward hides, expert all-to-alls, compressor
bytes and compute, sync strategies — and ``predict``, which puts them together with the memory model.

Every assumption is stated where it is made and collected in docs/plan.md. In brief:

* Compute: matmul FLOPs / (peak × matmul_efficiency) plus element-wise work (norms, activations, residual
  adds, softmax without fused attention) as HBM traffic, ≈ 4 passes over each stored activation, and the loss's
  traffic over the logits (``Training.loss_bytes_per_logit``).
* GEMM shapes (accelerators with an SM count): each GEMM of a micro-batch — forward, and backward's dX and dW —
  at the wave efficiency of its output tiles over the SMs, or at HBM bandwidth where it is too thin (roofline:
  ``cloud.gemm_time``); large GEMMs run at matmul_efficiency, small ones (small d, small micro-batch, tp) slower.
* Kernels: a micro-batch launches ``kernels_per_microbatch`` kernels (from the model's structure) plus its
  collectives; each takes the longer of its work and the host's ``kernel_launch_s`` to issue it (eager PyTorch
  runs ahead only across long kernels), + ``kernel_gap_s`` on the device (``kernel_overhead`` in the breakdown).
* Collectives (nccl-tests' bus bandwidth): ring all-reduce moves 2(n−1)/n of the buffer per rank, all-gather /
  reduce-scatter / all-to-all (n−1)/n. A dimension whose group fits in a node uses the intra-node fabric;
  one that spans nodes is bounded by the node's NICs, shared by every group of that dimension on the node
  (all ranks run the same collective at once, SPMD). Rank order as syncwise.parallel.mesh: tp innermost, then
  dp_shard, dp_replicate, pp outermost; ep groups are ep neighbouring data-parallel ranks.
* Latency (α-β): every collective call costs its fabric's ``call_latency`` (α per call: NCCL's launch and
  protocol start, fitted to published nccl-tests curves, cloud.CALL_LATENCY_SOURCE) plus ⌈log2 n⌉ message steps
  per all-gather / reduce-scatter, twice that per all-reduce, n − 1 per all-to-all, each at the fabric's
  ``latency``; a group that spans nodes pays the inter-node fabric's.
* Tensor parallel (with sequence parallel: 2 all-gathers + 2 reduce-scatters per block forward, the same in
  backward, again in a full recompute) and expert all-to-alls are not overlapped with compute. Pipeline p2p
  sends under torch.distributed.pipelining are asynchronous: in the steady state they overlap the stage's other
  micro-batches and cost only what exceeds its compute, plus one hop each way while the pipeline fills and
  drains (``Training.overlap_p2p``; the Megatron recipe pays every send/recv pair on the critical path). Under
  tensor parallel a stage's message is 1/tp of the activation per rank with sequence parallel, or with the
  scatter/gather optimization (``Training.pp_scatter_gather``: Megatron-LM's and DeepSpeed's pipelines) plus an
  all-gather of the slices over the tp group on the receiving stage; else each tp rank sends the whole of it.
* Pipeline: T = τ·(M + bubble) with τ one micro-batch's stage time; bubble = p − 1 for GPipe / 1F1B,
  (p − 1)/v interleaved (and looped BFS), (p − 1)/(3v) for the zero-bubble schedules (ZB-H1's bound, Qi et
  al. 2024, with T_F = T_B = T_W; ZB-V and DualPipeV can do better, we do not assume it).
* Data-parallel gradient sync overlaps backward bucket by bucket: all but the last bucket hides behind the
  last micro-batch's backward (syncwise under pp syncs after the schedule: nothing hides). FSDP2's gathers are
  prefetched one block ahead: all but the first block's gather hides behind compute.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ConfigError
from ..layout import EVERY_STEP, FSDP_REDUCE_DTYPES, OUTER_QBLOCK, hierarchical_applies, parse_compress
from .cloud import Accelerator, CloudConfig, batched_gemm_time, gemm_time
from .layout import SYNCWISE, Layout, Training, owner_layout, syncwise_refusal
from .memory import Memory, activation_terms, memory_per_rank, stage_params
from .model import ModelSpec

GIB = 2**30
#: the breakdown's parts the device spends computing (the busy time a run's measured compute holds), and those it
#: spends idle in a pipeline (its bubble, waiting on the busiest stage): together the floor no communication
#: strategy lowers
COMPUTE_TERMS = ("compute", "kernel_overhead", "recompute", "grad_accumulation", "optimizer")
PIPELINE_IDLE_TERMS = ("pp_bubble", "pp_imbalance")


# ------------------------------------------------------------------------------------------------ collectives
def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus factor: bytes each rank moves per byte of the buffer."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "p2p":
        return 1.0
    raise ValueError(kind)


def _steps(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    log = max(1, math.ceil(math.log2(n)))
    return {"all_reduce": 2 * log, "all_gather": log, "reduce_scatter": log, "all_to_all": n - 1, "p2p": 1}[kind]


@dataclass
class Traffic:
    """What crossed node boundaries in one step (for network_priority) — bytes sent per node, messages."""

    inter_bytes: float = 0.0
    inter_messages: float = 0.0
    burst_left: float = 0.0      # bytes per node a token-bucket link still passes at the host's speed (Fabric.burst_bytes)


def group(cloud: CloudConfig, layout: Layout, dim: str) -> tuple[int, int, int]:
    """(size, stride, members per node) of ``dim``'s groups: tp, dp_shard, dp_replicate, pp, dp (both
    data-parallel dimensions), ep (neighbouring dp ranks; with ``ep_fold``, Megatron's MoE parallel folding,
    neighbouring ranks, tp ones included), ep_replicate (ranks holding the same experts)."""
    t, s, r = layout.tp, layout.dp_shard, layout.dp_replicate
    size, stride = {"tp": (t, 1), "dp_shard": (s, t), "dp_replicate": (r, t * s), "pp": (layout.pp, t * s * r),
                    "dp": (s * r, t), "ep": (layout.ep, 1 if layout.ep_fold else t),
                    "ep_replicate": ((max(1, s * r * t // layout.ep), layout.ep) if layout.ep_fold else
                                     (max(1, s * r // layout.ep), t * layout.ep))}[dim]
    G = cloud.gpus_per_node
    if stride * size <= G:
        per_node = size
    elif stride >= G:
        per_node = 1
    else:
        per_node = max(1, G // stride)
    return size, stride, per_node


def collective_time(cloud: CloudConfig, kind: str, nbytes: float, n: int, per_node: int,
                    traffic: Optional[Traffic] = None, count: float = 1.0) -> float:
    """Seconds for ``count`` collectives of ``kind`` over ``n`` ranks (``per_node`` of them per node) on a
    buffer of ``nbytes`` (an all-gather's output, an all-reduce's input, an all-to-all's send buffer; a p2p
    message). Every group of the dimension on a node runs at once."""
    if n <= 1 or nbytes <= 0 or count <= 0:
        return 0.0
    bus = bus_factor(kind, n)
    intra, G = cloud.intra_node, cloud.gpus_per_node
    if per_node >= n:
        return count * (nbytes * bus / intra.effective_for(kind) + call_latency(cloud, kind, n, True))
    t_intra = nbytes * bus / intra.effective_for(kind) if per_node > 1 else 0.0
    groups_on_node = G / per_node
    if kind == "all_to_all":
        node_out = G * nbytes * (n - per_node) / n
    elif kind == "p2p":
        node_out = G * nbytes
    else:
        node_out = groups_on_node * nbytes * bus
    shaped = count * node_out
    if traffic is not None:
        traffic.inter_bytes += count * node_out
        traffic.inter_messages += count * _steps(kind, n)
        passed = min(shaped, traffic.burst_left)      # a token bucket's burst: not held to the rate
        traffic.burst_left -= passed
        shaped -= passed
    t_inter = shaped / cloud.node_inter_bandwidth(kind)
    return max(count * t_intra, t_inter) + count * call_latency(cloud, kind, n, False)


def call_latency(cloud: CloudConfig, kind: str, n: int, intra: bool) -> float:
    """α of one ``kind`` collective over ``n`` ranks: the fabric's per-call latency plus its message steps."""
    if n <= 1:
        return 0.0
    fabric = cloud.intra_node if intra else cloud.inter_node
    return fabric.call_latency + _steps(kind, n) * fabric.latency


def dim_time(cloud: CloudConfig, layout: Layout, dim: str, kind: str, nbytes: float,
             traffic: Optional[Traffic] = None, count: float = 1.0) -> float:
    n, _, per_node = group(cloud, layout, dim)
    return collective_time(cloud, kind, nbytes, n, per_node, traffic, count)


# ------------------------------------------------------------------------------------------------ compressors
@dataclass(frozen=True)
class Wire:
    """How one gradient set travels: the collective, bytes on the wire per element (of the compressed part),
    elements sent raw in fp32 beside it, and encode/decode HBM traffic per element (+ per received copy)."""

    kind: str
    bytes_per_element: float
    raw_fraction: float = 0.0
    compute_bytes: float = 0.0
    compute_bytes_per_peer: float = 0.0
    flops_per_element: float = 0.0
    collectives_per_bucket: int = 1
    codec: str = ""              # the compressor's name (Accelerator.codec_cost: its measured compute)


#: the planner's rough encode/decode cost of each compressor (docs/plan.md): HBM bytes per element, per element
#: of every received copy, whether small 1-D tensors travel raw beside it (the min_numel policy; a cast sends the
#: whole bucket). What crosses the wire is the compressor's own spec's (syncwise.layout.COMPRESSORS).
CODEC_COST: dict[str, tuple[float, float, bool]] = {
    "none": (0.0, 0.0, False), "torch-allreduce": (0.0, 0.0, False),
    "fp16": (12.0, 0.0, False), "bf16": (12.0, 0.0, False), "torch-fp16": (12.0, 0.0, False),
    "torch-bf16": (12.0, 0.0, False), "fp8": (10.0, 9.0, True), "int8": (14.0, 9.0, True),
    "sign": (16.0, 8.5, True), "topk": (48.0, 16.0, True), "randomk": (16.0, 0.0, True),
    "powersgd": (24.0, 0.0, True), "torch-powersgd": (24.0, 0.0, True),
    # DeMo: momentum update, a DCT and its inverse per tile (two small GEMMs each way), top-k: top-k's order
    "demo": (48.0, 16.0, True)}


def compressor_wire(spec: Any, model: ModelSpec, training: Training) -> Wire:
    """Bytes and compute of syncwise's compressors (compress/registry.py) and PyTorch's hooks, per element of
    the gradient, from the parsed spec (``syncwise.layout.Compress``: the collective, bytes per element from the
    options — fp8 1 B + one fp32 scale per ``block``, topk 8 B per kept element, ...) and the planner's codec
    costs (:data:`CODEC_COST`). ``none`` is the training recipe's reduce dtype (fp32 in syncwise); PowerSGD's
    bytes depend on the matrices: (rows + cols)·rank fp32 per matrix in two all-reduces, matrices that would not
    compress ``min_compression_rate`` × and 1-D tensors raw. ``spec``: parsed, or its text."""
    c = parse_compress(spec)
    if c.name not in CODEC_COST:
        raise ConfigError("compress", spec, "a compressor the planner has a wire model of: " + ", ".join(CODEC_COST))
    compute, per_peer, has_raw = CODEC_COST[c.name]
    norms = (2 * model.n_layers + 1) * model.norm_params()
    raw = norms / model.param_counts()[0] if has_raw else 0.0   # small 1-D tensors stay fp32
    sp, opts = c.spec, c.options
    if c.name in ("none", "torch-allreduce"):
        return Wire(sp.collective, training.grad_reduce_bytes)
    wire = Wire(sp.collective, c.bytes_per_element or 0.0, raw, compute_bytes=compute,
                compute_bytes_per_peer=per_peer * c.kept_fraction,
                collectives_per_bucket=sp.collectives_per_bucket, codec=c.name)
    if c.bytes_per_element is not None:
        return wire
    rank, min_rate = opts["rank"], opts["min_compression_rate"]   # PowerSGD's: the matrices decide
    sent = rawm = elems = 0.0
    for i in range(model.n_layers):
        for count, rows, cols in model.matrices(i):
            elems += count * rows * cols
            if rows * cols / ((rows + cols) * rank) >= min_rate:
                sent += count * (rows + cols) * rank
            else:
                rawm += count * rows * cols
    elems = max(elems, 1.0)
    # per element of the matrices: 4·(rows+cols)·r/(rows·cols) bytes; 4·rows·cols·r·2 FLOPs (P = MQ, Q = MᵀP)
    return dataclasses.replace(wire, bytes_per_element=4 * sent / elems + 4 * rawm / elems, flops_per_element=8 * rank)


def sync_bytes(nelements: float, n: int, wire: Wire, raw_bytes: float = 4.0) -> tuple[float, float]:
    """(buffer bytes for ``collective_time``, of the compressed part; raw fp32 bytes, all-reduced beside it)."""
    payload = nelements * (1 - wire.raw_fraction) * wire.bytes_per_element
    if wire.kind == "all_gather":
        payload *= n                     # the all-gather's output: every rank's payload
    return payload, nelements * wire.raw_fraction * raw_bytes


# ------------------------------------------------------------------------------------------------ the prediction
@dataclass
class Prediction:
    """One layout's predicted step: times in seconds per optimizer step, memory in GiB on the most loaded rank."""

    layout: Layout
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float          # model FLOPs (6N + attention; no recomputation) per second per GPU
    mfu: float
    hfu: float                     # hardware FLOPs (recomputation included) / peak
    memory_gb_per_gpu: float       # GiB
    memory_limit_gb: float         # GiB usable per GPU
    fits: bool
    breakdown: dict[str, float]
    dominant: str
    micro_batch: int
    microbatches: int
    memory: dict[str, float] = field(default_factory=dict)   # GiB by kind
    runnable: Optional[bool] = None
    not_runnable: str = ""
    inter_node_bytes: float = 0.0
    inter_node_messages: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The ``--json`` row."""
        return {"layout": self.layout.text(), "layout_fields": self.layout.as_dict(),
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu,
                "memory_gb_per_gpu": self.memory_gb_per_gpu, "memory_limit_gb": self.memory_limit_gb,
                "fits": self.fits, "breakdown": self.breakdown, "dominant": self.dominant,
                "micro_batch": self.micro_batch, "microbatches": self.microbatches, "memory": self.memory,
                "runnable": self.runnable, "not_runnable": self.not_runnable, "info": self.info}


def _check(cond: bool, field_name: str, value: Any, accepted: str) -> None:
    if not cond:
        raise ConfigError(field_name, value, accepted)


def batch_split(layout: Layout, global_batch: int) -> tuple[int, int]:
    """(micro_batch, microbatches): sequences per micro-batch per data-parallel rank, and micro-batches per
    step (pipeline M, or gradient accumulation when pp = 1); ConfigError when the batch does not split."""
    dp = layout.dp
    _check(global_batch % dp == 0, "--global-batch", global_batch,
           f"a multiple of the data-parallel degree dp_replicate × dp_shard = {dp}")
    per_rank = global_batch // dp
    if layout.micro_batch:
        _check(per_rank % layout.micro_batch == 0, "microbatch", layout.micro_batch,
               f"a divisor of the sequences per data-parallel rank ({per_rank})")
        mb = layout.micro_batch
        M = per_rank // mb
        _check(not layout.microbatches or layout.microbatches == M, "microbatches", layout.microbatches,
               f"{M} (= {per_rank} sequences per rank / microbatch {mb}) or 0")
        return mb, M
    if layout.microbatches:
        _check(per_rank % layout.microbatches == 0, "microbatches", layout.microbatches,
               f"a divisor of the sequences per data-parallel rank ({per_rank})")
        return per_rank // layout.microbatches, layout.microbatches
    M = 2 * layout.pp * layout.stages_per_rank if layout.pp > 1 else 1   # the owner's default (microbatches_per_step)
    M = math.gcd(M, per_rank) if per_rank % M else M
    return per_rank // M, M


def validate_layout(cloud: CloudConfig, model: ModelSpec, layout: Layout) -> None:
    """Physical rules (not syncwise's): the product is the world size, the degrees divide what they split."""
    world = cloud.world_size
    _check(layout.world == world, "layout", layout.text(),
           f"degrees whose product pp × dp_replicate × dp_shard × tp equals the cluster's {cloud.nodes} × "
           f"{cloud.gpus_per_node} = {world} GPUs (got {layout.world})")
    _check(model.n_heads % layout.tp == 0, "tp", layout.tp, f"a divisor of the model's heads ({model.n_heads})")
    _check(layout.pp * layout.stages_per_rank <= model.n_layers, "pp", layout.pp,
           f"at most one stage per layer ({model.n_layers} layers)")
    if layout.ep > 1:
        _check(model.is_moe and model.n_routed_experts % layout.ep == 0, "ep", layout.ep,
               f"a divisor of the routed experts ({model.n_routed_experts})" if model.is_moe else "1 (dense model)")
        if layout.ep_fold:
            _check(layout.dp * layout.tp % layout.ep == 0, "ep", layout.ep,
                   f"a divisor of dp × tp = {layout.dp * layout.tp} (ep_fold)")
        else:
            _check(layout.dp % layout.ep == 0, "ep", layout.ep, f"a divisor of dp = {layout.dp}")


def predict(cloud: CloudConfig, model: ModelSpec, layout: Layout, global_batch: int, seq_len: Optional[int] = None,
            *, training: Training = SYNCWISE, syncwise_rules: bool = True, matmul_efficiency: Optional[float] = None
            ) -> Prediction:
    """Predict one optimizer step of ``layout`` on ``cloud`` for ``global_batch`` sequences of ``seq_len`` tokens.

    ``syncwise_rules``: also decide whether syncwise can run the layout (``runnable`` / ``not_runnable``, from
    ``syncwise.layout.Layout.check`` / ``check_model``: torch-free)."""
    seq_len = seq_len or model.seq_len
    model = model.with_seq_len(seq_len) if model.seq_len != seq_len else model
    validate_layout(cloud, model, layout)
    mb, M = batch_split(layout, global_batch)
    acc, t, pp, v = cloud.accelerator, layout.tp, layout.pp, layout.stages_per_rank
    peak = acc.peak(training.peak_dtype)
    eff = matmul_efficiency or acc.matmul_efficiency
    traffic, mb_traffic = Traffic(), Traffic()      # per step; per micro-batch (× M at the end)
    tokens_mb = mb * seq_len
    tokens_step = global_batch * seq_len

    # ---- compute of one micro-batch on one stage rank (fwd + bwd), recomputation extra
    f_tok = model.flops_per_token(seq_len)
    head_flops = 6 * model.vocab_size * model.d_model
    layer_share = (f_tok - head_flops) / f_tok
    recompute_tok = {"none": 0.0, "selective": model.attention_core_flops_per_token(seq_len) / 3,
                     "full": (f_tok - head_flops) / 3}[layout.recompute]
    flops_mb = f_tok * tokens_mb / (t * pp)
    extra_mb = recompute_tok * tokens_mb / (t * pp)
    act = activation_terms(model, seq_len, training)
    rep_div = t if layout.sp else 1
    elem_tok = sum(x["replicated"] / rep_div + (x["split"] + x["core"]) / t for x in act) / pp
    elem_passes = 4.0 * (1.5 if layout.recompute == "full" else 1.0)
    # GEMM-size efficiency (Accelerator.gemm_efficiency): every GEMM costs gemm_half_flops / (peak × eff) on
    # top of its FLOPs; forward 1 GEMM per weight matrix (+ QKᵀ and AV), backward 2 each, a recompute the
    # forward's again
    n_fwd = gemms_per_forward(model, pp)
    t_gemm0 = acc.gemm_half_flops / (peak * eff)
    # GEMM shapes (cloud.gemm_time: wave quantization over the SMs, roofline): what this rank's GEMMs cost beyond
    # FLOPs / (peak × eff), forward and backward (dX and dW), from their shapes at this micro-batch and tp
    shape_fwd, shape_bwd = gemm_shape_excess(acc, model, layout, tokens_mb, peak, eff)
    if not training.flash_attention:      # QKᵀ and AV as batched GEMMs: their shapes and s² operands too
        core_fwd, core_bwd = attention_core_excess(acc, model, layout, mb, seq_len, peak, eff)
        shape_fwd, shape_bwd = shape_fwd + core_fwd, shape_bwd + core_bwd
    t_matmul = flops_mb / (peak * eff) + 3 * n_fwd * t_gemm0 + shape_fwd + shape_bwd
    recomputed = {"none": 0.0, "selective": 2 * model.n_layers / pp, "full": n_fwd}[layout.recompute]
    t_extra = extra_mb / (peak * eff) + recomputed * t_gemm0 + (shape_fwd if layout.recompute == "full" else 0.0)
    t_elem = elem_passes * elem_tok * tokens_mb / acc.hbm_bandwidth
    # the loss over the logits (vocabulary-parallel under tp; the head's stage, averaged over the stages as the
    # head's FLOPs are): memory-bound, Training.loss_bytes_per_logit of HBM traffic per logit
    t_elem += tokens_mb * model.vocab_size / t * training.loss_bytes_per_logit / pp / acc.hbm_bandwidth
    t_fwd = (t_matmul - shape_bwd - shape_fwd) / 3 + shape_fwd + t_elem / 3
    t_bwd = 2 * (t_matmul - shape_bwd - shape_fwd) / 3 + shape_bwd + 2 * t_elem / 3 + t_extra

    # ---- tensor parallel (per micro-batch, this rank's layers)
    layers_rank = model.n_layers / pp
    t_tp = 0.0
    if t > 1:
        full = tokens_mb * model.d_model
        passes = 3 if layout.recompute == "full" else 2          # forward, backward (+ recomputed forward)
        if layout.sp:
            n = layers_rank * passes * 2                          # 2 all-gathers + 2 reduce-scatters per block
            t_tp = dim_time(cloud, layout, "tp", "all_gather", full * training.residual_bytes, mb_traffic, n) \
                + dim_time(cloud, layout, "tp", "reduce_scatter", full * training.activation_bytes, mb_traffic, n)
        else:
            t_tp = dim_time(cloud, layout, "tp", "all_reduce", full * training.activation_bytes, mb_traffic,
                            layers_rank * passes * 2)
    # ---- expert parallel all-to-alls (per micro-batch)
    t_ep = 0.0
    if layout.ep > 1:
        d = model.d_model
        dispatch = {"fp8": d + 4 * math.ceil(d / 128), "bf16": 2 * d, "fp32": 4 * d}[layout.ep_dispatch]
        combine = 2 * d if layout.ep_dispatch == "fp8" else dispatch
        combine_grad = 2 * d if layout.ep_dispatch == "fp8" else dispatch
        # forward: dispatch, combine; backward: the combine's gradient (dispatch-shaped), the dispatch's gradient
        # (combine-shaped), as expert_parallel.Wires; a full recompute repeats the forward pair
        exchanges = [dispatch, combine, combine_grad, combine]
        if layout.recompute == "full":
            exchanges += [dispatch, combine]
        rows = tokens_mb / (t if layout.sp else 1) * model.top_k
        moe_rank = model.n_moe_layers / pp
        t_ep = sum(dim_time(cloud, layout, "ep", "all_to_all", rows * b, mb_traffic, moe_rank) for b in exchanges)
    # ---- pipeline p2p (per micro-batch: an activation forward and its gradient back, per stage held)
    t_p2p = 0.0
    # scatter/gather (Training.pp_scatter_gather): each tp rank sends its 1/tp slice, the receiver all-gathers them
    sg = training.pp_scatter_gather and t > 1 and not layout.sp
    if pp > 1:
        msg = tokens_mb * model.d_model * training.residual_bytes / (t if layout.sp or sg else 1)
        t_p2p = dim_time(cloud, layout, "pp", "p2p", msg, mb_traffic, count=2 * v)
        if sg:
            t_p2p += dim_time(cloud, layout, "tp", "all_gather", msg * t, mb_traffic, count=2 * v)

    # ---- FSDP2 gathers per micro-batch (forward and backward), exposed beyond the first unit
    sp_params = stage_params(model, layout)
    local = sp_params.total
    t_fsdp_mb = 0.0
    fsdp_gather_total = 0.0
    fsdp = fsdp_plan(cloud, layout, training) if layout.dp_shard > 1 else None
    units = fsdp_units(model, layout) if fsdp is not None else None
    calls = fsdp_calls(fsdp, units, layout) if fsdp is not None else {}   # its collectives, by role
    gather_codec_mb = 0.0
    if fsdp is not None:
        # forward's gather over the shard group (parallel.fsdp_gather's bytes), one per unit; backward's again of the
        # units resharded after forward (all), over the node's shard ranks at FSDP2's own dtype (node: hpZ), or none
        # (the weights kept from forward)
        n_u, regather = calls["gather_fwd"].count, units.regathered_params
        n_b = calls["gather_bwd"].count if "gather_bwd" in calls else 0.0
        ag_f = _fsdp_gather_time(cloud, layout, fsdp, local * fsdp.gather_bpe / n_u, mb_traffic, n_u)
        if "gather_bwd" not in calls:
            ag_b = 0.0
        elif fsdp.bwd_ranks >= layout.dp_shard:
            ag_b = _fsdp_gather_time(cloud, layout, fsdp, regather * fsdp.gather_bpe / n_b, mb_traffic, n_b)
        else:
            ag_b = collective_time(cloud, "all_gather", regather * training.gather_bytes / n_b, fsdp.bwd_ranks,
                                   fsdp.bwd_ranks, count=n_b)
        share = sp_params.unit / max(local, 1.0)
        fsdp_gather_total = ag_f + ag_b
        t_fsdp_mb = max(ag_f * share, ag_f - t_fwd) + (max(ag_b * share, ag_b - (t_bwd - t_extra)) if ag_b else 0.0) \
            if training.overlap_fsdp else ag_f + ag_b
        if layout.fsdp_gather != "fp32":   # each quantized gather encodes this rank's shard, decodes W parts
            gw = Wire("all_gather", fsdp.gather_bpe, compute_bytes=CODEC_COST[layout.fsdp_gather][0],
                      compute_bytes_per_peer=CODEC_COST[layout.fsdp_gather][1], codec=layout.fsdp_gather)
            gather_codec_mb = _codec_time(cloud, gw, local / layout.dp_shard, layout.dp_shard, n_u)
            if fsdp.bwd_ranks >= layout.dp_shard and n_b > 0:
                gather_codec_mb += _codec_time(cloud, gw, regather / layout.dp_shard, layout.dp_shard, n_b)
    # ---- per-kernel overheads (per micro-batch): the host issues every kernel (and every collective: tp, ep
    # all-to-alls, pipeline sends) at ``kernel_launch_s`` each at best (eager PyTorch's per-op host time: the
    # catalog's, or `--calibrate`'s measurement); the device runs them with kernel_gap_s between.
    # Each kernel takes the longer of its issue and its work (a kernel shorter than its issue leaves the device
    # idle: eager frameworks run ahead only across long kernels, and every collective re-aligns the ranks' hosts):
    # the excess over the device's work, kernel by kernel, is kernel_overhead.
    n_tp_calls = 0.0
    if t > 1:
        n_tp_calls = layers_rank * (3 if layout.recompute == "full" else 2) * (4 if layout.sp else 2)
    n_ep_calls = model.n_moe_layers / pp * (6 if layout.recompute == "full" else 4) if layout.ep > 1 else 0.0
    n_p2p_calls = 2 * v * (2 if sg else 1) if pp > 1 else 0.0
    n_kernels = kernels_per_microbatch(model, layout, training, M) + n_tp_calls + n_ep_calls + n_p2p_calls
    host_s = acc.kernel_launch_s
    t_kernel = n_kernels * acc.kernel_gap_s
    if host_s:
        gemms = gemm_kernel_times(acc, model, layout, tokens_mb, peak, eff)
        n_gemm = sum(c for c, _ in gemms)
        n_colls = n_tp_calls + n_ep_calls + n_p2p_calls
        n_other = max(n_kernels - n_gemm - n_colls, 1.0)
        t_kernel += sum(c * max(0.0, host_s - x) for c, x in gemms) + n_other * max(0.0, host_s - t_elem / n_other)
        if n_tp_calls:
            t_kernel += n_tp_calls * max(0.0, host_s - t_tp / n_tp_calls)
    # ---- gradient accumulation (Training.main_grad_hooks): each micro-batch's weight gradients added into the
    # step's sum, HBM-bound: read the new gradient, read and write the sum
    accumulations = M if training.main_grad_hooks else M - 1
    t_accum = accumulations * local * (training.weight_bytes + 2 * training.grad_bytes) / acc.hbm_bandwidth
    tau = t_fwd + t_bwd + t_tp + t_ep + t_fsdp_mb + t_kernel
    # Stage-to-stage sends are asynchronous (isend): in the steady state a micro-batch's activations and gradients
    # travel while the stage computes other micro-batches, so the link costs time only where it is slower than
    # the compute, plus one hop each way while the pipeline fills and drains.
    # (Training.overlap_p2p; Megatron-LM's schedule waits on each send/recv pair: every micro-batch pays it.)
    if not training.overlap_p2p:
        tau += t_p2p
        t_p2p_exposed = 0.0
    else:
        t_p2p_exposed = M * max(0.0, t_p2p - tau) + ((pp - 1) * t_p2p / v if pp > 1 else 0.0)
    if pp > 1:
        s = layout.pp_schedule
        bubble_units = (pp - 1) / (v if s in ("interleaved-1f1b", "looped-bfs") else 1) \
            if s in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs") else (pp - 1) / (3 * max(v, 1))
    else:
        bubble_units = 0.0
    # The busiest stage paces the steady state (its M - 1 micro-batches after the first); the fill and the drain
    # pass through every stage (the average). A stage's work scales with its layers, the head's (its GEMM and the
    # loss, averaged over the stages in tau) sits on the last stage (pipeline_imbalance)
    imbalance = 0.0
    if pp > 1:
        head_t = (head_flops * tokens_mb / t / (peak * eff)
                  + tokens_mb * model.vocab_size / t * training.loss_bytes_per_logit / acc.hbm_bandwidth)
        per_layer = max(tau - head_t / pp, 0.0) / (model.n_layers / pp)
        if per_layer > 0:
            head_layers = head_t / per_layer
            busiest = busiest_stage(model.n_layers, pp, head_layers, training.pp_end_layers)
            imbalance = max(0, M - 1) * per_layer * max(0.0, busiest - (model.n_layers + head_layers) / pp)
    # Workers that share compute units (the CPU lab: Accelerator.shared_by workers per core) compute at
    # 1/shared_by of their own speed when all are busy, as calibrated; a stage idle in the bubble or waiting on
    # the busiest stage lends its share to the busy ones, so the step is the longer of all ranks' work at the
    # shared speed (the units never idle) and the pipeline at its own speed: the idle time that is left, split
    # between the bubble and the imbalance in proportion
    share = max(1.0, acc.shared_by)
    idle = tau * bubble_units + imbalance
    if share > 1 and idle > 0:
        left = max(0.0, (tau * (M + bubble_units) + imbalance) / share - tau * M)
        bubble_units, imbalance = bubble_units * left / idle, imbalance * left / idle
    t_pipe = tau * (M + bubble_units) + imbalance + t_p2p_exposed
    traffic.inter_bytes += M * mb_traffic.inter_bytes
    traffic.inter_messages += M * mb_traffic.inter_messages

    # ---- data-parallel gradient sync (once per step). On a token-bucket link (the lab's tbf) the bucket refilled
    # while the step computed: that many of the sync's bytes pass at the host's speed (Fabric.burst_credit)
    if cloud.nodes > 1:
        traffic.burst_left = cloud.inter_node.nics_per_node * cloud.inter_node.burst_credit(t_pipe)
    wire = compressor_wire(layout.compress, model, training)
    sync = layout.sync                       # the parsed spec (None: every-step)
    sync_name = sync.method if sync is not None else EVERY_STEP
    dp_total = dp_exposed = compress_compute = sync_exposed = 0.0
    tensors = model.tensor_count() / pp      # gradient tensors of this rank's stage
    dense, expert = sp_params.dense, sp_params.expert
    if layout.dp > 1:
        if layout.dp_shard > 1:    # FSDP2 / HSDP: reduce-scatter in the reduce dtype, then the replicas' all-reduce
            name = layout.compress.name
            cast = name in FSDP_REDUCE_DTYPES and name != "none"    # FSDP2's own 16-bit reduce dtype
            red = 2.0 if cast else training.grad_reduce_bytes
            n_u = calls["reduce_node" if fsdp.reduce == "hierarchical" else "reduce"].count  # per unit: one codec call
            if fsdp.reduce == "flat":            # qgZ: quantized chunks by one all-to-all, an fp32 sum
                dp_total += dim_time(cloud, layout, "dp_shard", "all_to_all", local * fsdp.reduce_bpe / n_u, traffic,
                                     n_u)
                compress_compute += _codec_time(cloud, _reduce_wire(fsdp), local, 1, n_u)
            elif fsdp.reduce == "hierarchical":  # fp32 all-to-all inside the node, node sums quantized across:
                k, nodes_ = fsdp.shard_per_node, layout.dp_shard // fsdp.shard_per_node   # two collectives a unit
                n_x = calls["reduce_across"].count
                dp_total += collective_time(cloud, "all_to_all", local * training.grad_reduce_bytes / n_u, k, k,
                                            count=n_u)
                dp_total += collective_time(cloud, "all_to_all", local / k * fsdp.reduce_bpe / n_x, nodes_, 1, traffic,
                                            count=n_x)
                if nodes_ > 1:                   # (one node: nothing crosses, nothing is encoded)
                    compress_compute += _codec_time(cloud, _reduce_wire(fsdp), local / k, 1, n_u)
            else:
                dp_total += dim_time(cloud, layout, "dp_shard", "reduce_scatter", local * red / n_u, traffic, n_u)
            if layout.dp_replicate > 1 and sync_name not in (EVERY_STEP, "pipesgd"):
                # local steps over HSDP's replica groups: no per-step all-reduce across them; each rank's shard is
                # averaged with the other groups' every period
                one = _outer_step_time(cloud, layout, sync, local / layout.dp_shard, "dp_replicate", traffic)
                sync_exposed = max(0.0, one - sync.delay * t_pipe) / sync.period
            elif layout.dp_replicate > 1:
                shard = local / layout.dp_shard  # per unit: FSDP2's all-reduce, or the compressor as its hook
                n_r = calls["replicas"].count
                if cast or name == "none":
                    dp_total += dim_time(cloud, layout, "dp_replicate", "all_reduce", shard * red / n_r, traffic, n_r)
                else:
                    payload, raw = sync_bytes(shard, layout.dp_replicate, wire)
                    dp_total += dim_time(cloud, layout, "dp_replicate", wire.kind, payload / n_r, traffic, n_r)
                    dp_total += dim_time(cloud, layout, "dp_replicate", "all_reduce", raw / n_r, traffic, n_r)
                    compress_compute += _codec_time(cloud, wire, shard, layout.dp_replicate, tensors)
            overlap_window = t_bwd - t_extra if training.overlap_fsdp else 0.0
            last = dp_total * sp_params.unit / max(local, 1.0)
            dp_exposed = max(last, dp_total - overlap_window)
        elif layout.zero1:        # distributed optimizer: reduce-scatter the gradients, all-gather the weights
            dp_total += dim_time(cloud, layout, "dp", "reduce_scatter", dense * training.grad_reduce_bytes, traffic)
            dp_total += dim_time(cloud, layout, "dp", "all_gather", dense * training.weight_bytes, traffic)
            if expert:
                dp_total += dim_time(cloud, layout, "ep_replicate", "all_reduce", expert * training.grad_reduce_bytes,
                                     traffic)
            dp_exposed = _overlap(dp_total, training, layout, t_bwd - t_extra, local)
        elif sync_name == EVERY_STEP and _hierarchical(cloud, layout):
            # dist.hierarchical: fp32 reduce-scatter inside the node, the compressor across nodes on each local
            # rank's 1/per_node of every bucket (one group per local rank: every rank of the node sends at once),
            # fp32 all-gather inside the node (syncwise.compress.hierarchical)
            n_, _, pn = group(cloud, layout, "dp")
            nodes_, shard = n_ // pn, dense / pn
            dp_total += collective_time(cloud, "reduce_scatter", dense * 4, pn, pn)
            dp_total += collective_time(cloud, "all_gather", dense * 4, pn, pn)
            payload, raw = sync_bytes(shard, nodes_, wire)
            dp_total += collective_time(cloud, wire.kind, payload, nodes_, 1, traffic)
            dp_total += collective_time(cloud, "all_reduce", raw, nodes_, 1, traffic)
            buckets = max(1.0, local * 4 / training.bucket_bytes)
            dp_total += (buckets - 1) * (call_latency(cloud, wire.kind, nodes_, False) * wire.collectives_per_bucket
                                         + 2 * call_latency(cloud, "all_gather", pn, True))
            compress_compute += _codec_time(cloud, wire, shard, nodes_, tensors)
            dp_exposed = _overlap(dp_total, training, layout, t_bwd - t_extra, local)
        elif sync_name in (EVERY_STEP, "pipesgd"):
            n = layout.dp_replicate
            if sync_name == "pipesgd":
                wire = dataclasses.replace(wire, kind="all_reduce", bytes_per_element=4 if sync.dtype == "fp32" else 2)
            payload, raw = sync_bytes(dense, n, wire)
            dp_total += dim_time(cloud, layout, "dp", wire.kind, payload, traffic,
                                 count=1) + dim_time(cloud, layout, "dp", "all_reduce", raw, traffic)
            buckets = max(1.0, local * 4 / training.bucket_bytes)
            n_, _, pn = group(cloud, layout, "dp")
            lat = call_latency(cloud, wire.kind, n_, pn >= n_)
            dp_total += (buckets - 1) * lat * wire.collectives_per_bucket
            if expert:
                pe, re = sync_bytes(expert, max(1, layout.dp // layout.ep), wire)
                dp_total += dim_time(cloud, layout, "ep_replicate", wire.kind, pe, traffic)
                dp_total += dim_time(cloud, layout, "ep_replicate", "all_reduce", re, traffic)
            compress_compute += _codec_time(cloud, wire, local, n, tensors)
            if sync_name == "pipesgd":        # overlapped with the next step's compute
                dp_exposed = max(0.0, dp_total - t_pipe)
            else:
                dp_exposed = _overlap(dp_total, training, layout, t_bwd - t_extra, local)
        else:                                    # local SGD / DiLoCo: parameters averaged every H steps
            one = _outer_step_time(cloud, layout, sync, local, "dp", traffic)
            dp_total = one / sync.period
            sync_exposed = max(0.0, one - sync.delay * t_pipe) / sync.period
    compress_compute += M * gather_codec_mb
    t_opt = (local / layout.dp_shard) * training.optimizer_pass_bytes / acc.hbm_bandwidth
    breakdown = {
        "compute": M * (t_matmul + t_elem),
        "kernel_overhead": M * t_kernel,
        "recompute": M * t_extra,
        "tp_comm": M * t_tp,
        "ep_comm": M * t_ep,
        "pp_p2p": t_p2p_exposed if training.overlap_p2p else M * t_p2p,
        "pp_bubble": tau * bubble_units,
        "pp_imbalance": imbalance,
        "grad_accumulation": t_accum,
        "fsdp_comm_exposed": M * t_fsdp_mb,
        "dp_comm_exposed": dp_exposed,
        "sync_exposed": sync_exposed,
        "compress_compute": compress_compute,
        "optimizer": t_opt,
    }
    step = sum(breakdown.values())
    mem = memory_per_rank(model, layout, training, seq_len, mb, M)
    if fsdp is not None and fsdp.bwd_ranks < layout.dp_shard:
        # what a unit keeps between its forward and its backward: its weights sharded over the node's shard ranks
        # (fsdp_reshard=node) or whole (none), in FSDP2's all-gather dtype
        mem.parts["fsdp_forward_copies"] = local * training.gather_bytes / max(fsdp.bwd_ranks, 1)
    limit = acc.memory_bytes - acc.reserved_bytes
    world = cloud.world_size
    model_flops = f_tok * tokens_step
    hw_flops = (f_tok + recompute_tok) * tokens_step
    pred = Prediction(
        layout=dataclasses.replace(layout, micro_batch=mb, microbatches=M), step_time_s=step,
        tokens_per_s=tokens_step / step, tflops_per_gpu=model_flops / step / world / 1e12,
        mfu=model_flops / step / world / peak, hfu=hw_flops / step / world / peak,
        memory_gb_per_gpu=mem.total / GIB, memory_limit_gb=limit / GIB, fits=mem.total <= limit,
        breakdown=breakdown, dominant=max(breakdown, key=breakdown.get), micro_batch=mb, microbatches=M,
        memory={k: v / GIB for k, v in mem.parts.items()},
        inter_node_bytes=traffic.inter_bytes, inter_node_messages=traffic.inter_messages,
        info={"dp_comm_total": dp_total, "fsdp_gather_total_per_microbatch": fsdp_gather_total,
              **({"fsdp_bytes_per_step": fsdp_hop_bytes(fsdp, layout, training, local, M,
                                                         units.regathered_params / max(local, 1.0)),
                  "fsdp_collectives_per_step": fsdp_collectives(fsdp, units, layout, M)} if fsdp else {}),
              "layer_share_of_flops": layer_share, "flops_per_token": f_tok, "bubble_fraction":
              bubble_units / (M + bubble_units), "matmul_efficiency": eff, "training": training.name,
              "kernels_per_microbatch": n_kernels, "gemm_shape_s_per_microbatch": shape_fwd + shape_bwd})
    if syncwise_rules:
        why = syncwise_refusal(layout, model, world, M)
        pred.runnable, pred.not_runnable = why is None, why or ""
    return pred


def busiest_stage(layers: int, pp: int, head: float, end_layers: Optional[int]) -> float:
    """The busiest pipeline rank's work, in layers, when ``layers`` equal layers are split over ``pp`` ranks and
    the head's work (``head`` layers' worth) sits on the last: ``end_layers`` None balances by cost (the last
    stage's layers k chosen to minimise max(k + head, the other stages' ceil((layers - k) / (pp - 1))), as
    ``parallel.pipeline.split_layers``); k: the two end stages hold k fewer layers than the middle ones, the
    rest split evenly (a middle stage's layers rounded up)."""
    if pp <= 1:
        return layers + head
    if end_layers is None:
        return min(max(k + head, math.ceil((layers - k) / (pp - 1))) for k in range(1, max(2, layers - pp + 2)))
    middle = (layers + 2 * end_layers) / pp
    last = layers / 2 if pp == 2 else max(middle - end_layers, 1.0)
    return max(math.ceil(middle - 1e-9) if pp > 2 else 0.0, last + head)


def gemms_per_forward(model: ModelSpec, pp: int = 1) -> float:
    """GEMM kernels in one forward of a stage rank's share of the model (1/pp of the layers, the head once per
    model spread over the stages): one per weight matrix (a MoE layer's experts as one grouped GEMM per
    matrix: ``ModelSpec.matrices``' entries), two for the attention core (QKᵀ, AV)."""
    per_layer = sum(len(model.matrices(i)) + 2 for i in range(model.n_layers))
    return (per_layer + 1) / pp


def gemm_shapes(model: ModelSpec, layout: Layout, tokens: float) -> list[tuple[float, float, float, float]]:
    """(count, m, n, k) of the forward GEMMs one stage rank runs on a micro-batch of ``tokens`` tokens: every
    layer's weight matrices (1/pp of the layers each; the head's share 1/pp) with its tensor-parallel split —
    column-parallel matrices split their output (n / tp), the attention output and the MLP's last matrix (row
    parallel) their input (k / tp), as Megatron-LM's layers. A MoE layer's experts as this rank's grouped GEMM:
    n_routed / ep experts each of tokens × top_k × ep / n_routed rows (balanced routing). The attention core
    (QKᵀ, AV) is a fused kernel (flash attention) or a batched GEMM: left at the large-GEMM efficiency."""
    t, pp = layout.tp, layout.pp
    n_moe = model.n_moe_layers
    out: list[tuple[float, float, float, float]] = []
    attn = model.attention_matrices()
    for j, (a, b) in enumerate(attn):
        last = j == len(attn) - 1
        out.append((model.n_layers / pp, tokens, b if last else b / t, a / t if last else a))
    d = model.d_model
    if n_moe:
        out.append((n_moe / pp, tokens, model.n_routed_experts, d))                # router (replicated)
        for n_exp, routed in ((model.n_shared_experts, False), (model.n_routed_experts, True)):
            if not n_exp:
                continue
            local = n_exp / layout.ep if routed else n_exp
            rows = tokens * model.top_k * layout.ep / model.n_routed_experts if routed else tokens
            h = model.moe_hidden
            for _ in range(model.mlp_matrices - 1):
                out.append((n_moe * local / pp, rows, h / t, d))
            out.append((n_moe * local / pp, rows, d, h / t))
    if model.n_layers - n_moe:
        h = model.ffn_hidden
        for _ in range(model.mlp_matrices - 1):
            out.append(((model.n_layers - n_moe) / pp, tokens, h / t, d))
        out.append(((model.n_layers - n_moe) / pp, tokens, d, h / t))
    out.append((1 / pp, tokens, model.vocab_size / t, model.d_model))             # the head
    return out


def gemm_shape_excess(acc: Accelerator, model: ModelSpec, layout: Layout, tokens: float, peak: float,
                      eff: float) -> tuple[float, float]:
    """(forward, backward) seconds this rank's GEMMs take beyond FLOPs / (peak × eff) on one micro-batch:
    each forward GEMM (m, n, k), its backward dX (m, k, n) and dW (k, n, m) through ``cloud.gemm_time``. 0 for an
    accelerator without an SM count."""
    if not acc.sm_count:
        return 0.0, 0.0
    fwd = bwd = 0.0
    for c, m, n, k in gemm_shapes(model, layout, tokens):
        ideal = 2.0 * m * n * k / (peak * eff)
        fwd += c * (gemm_time(acc, m, n, k, peak, eff) - ideal)
        bwd += c * (gemm_time(acc, m, k, n, peak, eff) + gemm_time(acc, k, n, m, peak, eff) - 2 * ideal)
    return max(fwd, 0.0), max(bwd, 0.0)


def attention_core_excess(acc: Accelerator, model: ModelSpec, layout: Layout, micro_batch: int, seq_len: int,
                          peak: float, eff: float) -> tuple[float, float]:
    """(forward, backward) seconds the attention core's batched GEMMs take beyond FLOPs / (peak × eff) on one
    micro-batch, where no fused kernel runs it (Megatron-LM's baddbmm / bmm around its fused softmax): per layer
    of this stage, micro_batch × heads / tp GEMMs each of S = QKᵀ (s × s, inner d_qk) and O = PV (s × d_v, inner
    s) forward; dP = dO·Vᵀ (s × s, inner d_v), dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q (s × d, inner s) backward, at
    ``cloud.batched_gemm_time``: a head of 64 reads and writes the s × s scores for 64 multiply-adds each, below
    the A100's ridge point (HBM-bound), where 128 nearly reaches it. 0 without an SM count."""
    if not acc.sm_count:
        return 0.0, 0.0
    qk, v = model.qk_v_dims
    b, s = micro_batch * model.n_heads / layout.tp, seq_len
    layers = model.n_layers / layout.pp

    def excess(m: float, n: float, k: float) -> float:
        return batched_gemm_time(acc, b, m, n, k, peak, eff) - 2.0 * b * m * n * k / (peak * eff)
    fwd = excess(s, s, qk) + excess(s, v, s)
    bwd = excess(s, s, v) + excess(s, v, s) + excess(s, qk, s) + excess(s, qk, s)
    return max(layers * fwd, 0.0), max(layers * bwd, 0.0)


def gemm_kernel_times(acc: Accelerator, model: ModelSpec, layout: Layout, tokens: float, peak: float,
                      eff: float) -> list[tuple[float, float]]:
    """(count, seconds) of every GEMM kernel one stage rank runs on a micro-batch: each forward GEMM, its
    backward dX and dW, and the forward again under a full recompute (``cloud.gemm_time``)."""
    out = []
    again = 2 if layout.recompute == "full" else 1
    for c, m, n, k in gemm_shapes(model, layout, tokens):
        out += [(again * c, gemm_time(acc, m, n, k, peak, eff)), (c, gemm_time(acc, m, k, n, peak, eff)),
                (c, gemm_time(acc, k, n, m, peak, eff))]
    return out


def kernels_per_microbatch(model: ModelSpec, layout: Layout, training: Training, microbatches: int = 1) -> float:
    """CUDA kernels one stage rank launches for one micro-batch (forward + backward), counted from the model's
    structure as PyTorch / Megatron-LM run a block (collectives are counted by the caller). Forward, per block:
    one GEMM per weight matrix (bias in the GEMM's epilogue), 2 norms, 2 residual adds, 2 head split / merge
    copies, the MLP's activation (1; SwiGLU 2: SiLU and the product), the attention core (flash attention 1; else
    QKᵀ, fused scale-mask-softmax, AV, and dropout 1), RoPE on q and k (2, without learned positions), dropout
    after attention and MLP (2, where the recipe drops out); a MoE block also the router's softmax and top-k (2),
    the token permutation and its inverse (2 gathers, 2 scatters). Backward: 2 GEMMs per forward GEMM (dX, dW),
    1 kernel per other forward kernel, a bias's gradient as its own reduction (1 per bias: cuBLAS's GEMM does not
    write it), a norm's weight gradient as its own reduction (1 per norm, PyTorch's layer_norm / rms_norm backward),
    the residual stream's gradient summed where it forks into the branch and the skip (1 add per fork, 2 per
    block: autograd's accumulation), and under gradient accumulation one add per parameter tensor into .grad.
    The embedding (1, +2 for learned positions), head GEMM and loss (2) forward; the same backward, ×2 for the
    head. A full recompute runs the forward of every block again."""
    pp = layout.pp
    total = 0.0
    n_moe = model.n_moe_layers
    for moe, layers in ((False, model.n_layers - n_moe), (True, n_moe)):
        gemms = len(model.attention_matrices()) + model.mlp_matrices
        other = 2 + 2 + 2 + (2 if model.mlp == "swiglu" else 1)
        other += 1 if training.flash_attention else (3 + (1 if training.dropout else 0))
        other += 0 if model.learned_positions else 2
        other += 2 if training.dropout else 0
        params = gemms * (2 if model.biases else 1) + 2 * (2 if model.biases else 1)
        if moe:
            gemms += 1                                           # the router
            other += 2 + 4
        fwd = gemms + other
        reductions = (gemms if model.biases else 0) + 2 + 2       # bias grads, norm weight grads, residual forks
        bwd = 2 * gemms + other + reductions + (params if microbatches > 1 else 0)
        total += layers * (fwd + bwd + (fwd if layout.recompute == "full" else 0))
    edges_fwd = 1 + (2 if model.learned_positions else 0) + 1 + 2
    total += edges_fwd + edges_fwd + 2
    return total / pp


@dataclass(frozen=True)
class FsdpUnits:
    """FSDP2's units on one rank, as ``syncwise.parallel.fsdp.apply_fsdp`` wraps syncwise's models: one unit per
    child module holding a matrix — the embedding, each block, the output head (a head tied to the embedding stays
    with the root) — then the root (the final norm). Each unit issues one all-gather before its forward and one
    reduce-scatter after its backward (``fully_shard`` per unit: a collective per unit and pass, each paying its
    call's latency). The last unit and the root are not resharded after forward (apply_fsdp: backward needs them
    first), so backward re-gathers the others only: ``regathered`` units holding ``regathered_params`` parameters.
    Under pp a stage's share: its blocks, one end (embedding or head) and its root."""

    count: float
    regathered: float
    regathered_params: float


def fsdp_units(model: ModelSpec, layout: Layout) -> FsdpUnits:
    """:class:`FsdpUnits` of one rank of ``layout`` (this rank's stage, after tensor / expert splits)."""
    from .memory import _layer_split

    blocks = model.n_layers / layout.pp
    in_blocks = sum(sum(_layer_split(model, i, layout.tp, layout.ep)) for i in range(model.n_layers)) / layout.pp
    if layout.pp > 1:   # a stage: its blocks, one end (the embedding first, the head last), the root; the first
        # stage re-gathers its embedding but not its last block: taken as one block's worth either way
        return FsdpUnits(blocks + 2, blocks, in_blocks)
    if model.tie_embeddings:   # the tied embedding and head stay with the root: blocks and the root; the last block
        return FsdpUnits(blocks + 1, max(blocks - 1, 0.0), in_blocks * max(blocks - 1, 0.0) / max(blocks, 1.0))
    # the embedding, the blocks, the head, the root (final norm): the head and the root kept from forward
    return FsdpUnits(blocks + 3, blocks + 1, in_blocks + model.embedding_params() / layout.tp)


@dataclass(frozen=True)
class FsdpPlan:
    """How a dp_shard layout's FSDP2 collectives travel (``parallel.fsdp_gather`` / ``fsdp_reshard`` /
    ``--compress`` as the quantized reduce-scatter, ``dist.hierarchical``): bytes per element of forward's gather,
    the ranks backward re-gathers over (dp_shard: all; a node's shard ranks: node, at FSDP2's own dtype; 1: none),
    the reduce-scatter's form ('' FSDP2's own, 'flat' / 'hierarchical' quantized) and its bytes per element."""

    gather_bpe: float
    bwd_ranks: int
    shard_per_node: int
    reduce: str = ""
    reduce_bpe: float = 0.0
    codec: str = ""
    gather_hierarchical: bool = False


def fsdp_plan(cloud: CloudConfig, layout: Layout, training: Training) -> FsdpPlan:
    """:class:`FsdpPlan` of ``layout`` on ``cloud`` — the runtime's rules (``syncwise.layout``:
    ``fsdp_gather_bytes_per_element``, ``node_reshard``, ``fsdp_quantized_reduce``, ``hierarchical_applies``)."""
    from ..layout import (fsdp_gather_bytes_per_element, fsdp_node_ranks, fsdp_quantized_reduce,
                          fsdp_reduce_bytes_per_element)

    own = owner_layout(layout)
    _, _, k = group(cloud, layout, "dp_shard")
    bwd = {"all": layout.dp_shard, "none": 1}.get(layout.fsdp_reshard)
    if bwd is None:                      # node: the node's shard ranks (an uneven split runs as all: refused there)
        kn = fsdp_node_ranks(own, cloud.gpus_per_node)
        bwd = layout.dp_shard if kn in (0, layout.dp_shard) else kn
    c = layout.compress
    reduce, bpe = "", 0.0
    if fsdp_quantized_reduce(c, layout.dp_replicate, layout.dp_shard, layout.pp):
        bpe = fsdp_reduce_bytes_per_element(c)
        reduce = "hierarchical" if 1 < k and hierarchical_applies(own, cloud.nodes, cloud.gpus_per_node) else "flat"
    # the quantized gather over the whole shard group goes node-first with the hierarchical reduce (its groups)
    hier_gather = reduce == "hierarchical" and layout.fsdp_gather != "fp32" and layout.dp_shard // k > 1
    return FsdpPlan(fsdp_gather_bytes_per_element(layout.fsdp_gather, training.gather_bytes), bwd, k, reduce, bpe,
                    c.name if reduce else "", hier_gather)


def _reduce_wire(f: FsdpPlan) -> Wire:
    compute, per_peer, _ = CODEC_COST[f.codec]
    return Wire("all_to_all", f.reduce_bpe, compute_bytes=compute, compute_bytes_per_peer=per_peer, codec=f.codec)


def _fsdp_gather_time(cloud: CloudConfig, layout: Layout, f: FsdpPlan, nbytes: float, traffic: Traffic,
                      count: float) -> float:
    """Seconds of ``count`` gathers of ``nbytes`` (a unit's gathered bytes) over the shard group: one ring, or
    (``gather_hierarchical``) N ranks across nodes — one per node, the node's k such gathers at once — then the
    node's k ranks."""
    if not f.gather_hierarchical:
        return dim_time(cloud, layout, "dp_shard", "all_gather", nbytes, traffic, count)
    k = f.shard_per_node
    nodes = layout.dp_shard // k
    return (collective_time(cloud, "all_gather", nbytes / k, nodes, 1, traffic, count)
            + collective_time(cloud, "all_gather", nbytes, k, k, count=count))


@dataclass(frozen=True)
class FsdpCall:
    """One of FSDP2's collectives on a rank (:func:`fsdp_calls`): the op, the hop its group spans ('intra' inside
    one node, 'cross' spanning nodes, as ``comm.ops.hop_of``) and how many calls — per micro-batch for the gathers
    (``per_microbatch``), per step for the reductions."""

    op: str
    hop: str
    count: float
    per_microbatch: bool = False


def fsdp_calls(f: FsdpPlan, units: FsdpUnits, layout: Layout) -> dict[str, FsdpCall]:
    """FSDP2's collectives on one rank, by role — the one statement of how many calls each unit makes, which
    ``predict`` charges a latency each and :func:`fsdp_collectives` counts: ``gather_fwd`` forward's gather of every
    unit (:class:`FsdpUnits`) over the shard group; ``gather_bwd`` backward's of the resharded ones (over the shard
    group, or the node's shard ranks under fsdp_reshard=node; none under none); a hierarchical quantized gather
    (``FsdpPlan.gather_hierarchical``) is two, across nodes then ``gather_*_node`` inside; ``reduce`` one per
    unit — FSDP2's reduce-scatter or the quantized one's all-to-all —, hierarchical: ``reduce_node`` inside the
    node then ``reduce_across``; under HSDP ``replicas``, the replicas' all-reduce per unit (or the compressor's
    collective as its hook)."""
    W, k = layout.dp_shard, f.shard_per_node
    shard_hop = "cross" if k < W else "intra"
    out = {"gather_fwd": FsdpCall("all_gather", shard_hop, units.count, True)}
    if f.gather_hierarchical:    # across nodes first (one rank per node), then inside the node
        out["gather_fwd_node"] = FsdpCall("all_gather", "intra", units.count, True)
    if units.regathered > 0 and f.bwd_ranks >= W:
        out["gather_bwd"] = FsdpCall("all_gather", shard_hop, units.regathered, True)
        if f.gather_hierarchical:
            out["gather_bwd_node"] = FsdpCall("all_gather", "intra", units.regathered, True)
    elif units.regathered > 0 and f.bwd_ranks > 1:
        out["gather_bwd"] = FsdpCall("all_gather", "intra", units.regathered, True)
    if f.reduce == "flat":
        out["reduce"] = FsdpCall("all_to_all", shard_hop, units.count)
    elif f.reduce == "hierarchical":
        out["reduce_node"] = FsdpCall("all_to_all", "intra", units.count)
        out["reduce_across"] = FsdpCall("all_to_all", "cross" if W // k > 1 else "intra", units.count)
    else:
        out["reduce"] = FsdpCall("reduce_scatter", shard_hop, units.count)
    if layout.dp_replicate > 1 and (layout.sync is None or layout.sync.method in (EVERY_STEP, "pipesgd")):
        name = layout.compress.name
        kind = "all_reduce" if name in FSDP_REDUCE_DTYPES else layout.compress.spec.collective
        out["replicas"] = FsdpCall(kind, "cross", units.count)  # replicas span nodes (dp_shard inside)
    return out


def fsdp_collectives(f: FsdpPlan, units: FsdpUnits, layout: Layout, microbatches: int) -> dict[str, float]:
    """FSDP2's collective calls per step on one rank, ``'<op> <hop>'`` → calls (:func:`fsdp_calls`, the gathers once
    per micro-batch)."""
    out: dict[str, float] = {}
    for c in fsdp_calls(f, units, layout).values():
        n = c.count * (microbatches if c.per_microbatch else 1)
        if n > 0:
            out[f"{c.op} {c.hop}"] = out.get(f"{c.op} {c.hop}", 0.0) + n
    return out


def fsdp_hop_bytes(f: FsdpPlan, layout: Layout, training: Training, local: float, microbatches: int,
                   regathered: float = 1.0) -> dict[str, float]:
    """The bytes per step one rank's FSDP2 collectives put in, split by hop as the run's summary counts them
    (``hop_bytes_per_step_intra`` / ``_cross``: each collective's input payload, ``comm.ops.cross_share``): a ring
    over the shard group's W ranks, k per node, crosses on 1/k of its bytes (N_g / W) when it spans nodes; an
    all-to-all on (W − k) / W; a group inside one node not at all. Gathers (input: this rank's shard) per
    micro-batch — forward's of every unit, backward's of the ``regathered`` share of the parameters (the units
    resharded after forward: :class:`FsdpUnits`) —, the reduce-scatter (input: the whole unsharded gradient) once
    per step. A hierarchical quantized gather puts the shard into a gather across nodes (one rank per node: all of
    it crosses) and the N gathered shards into the node's."""
    W, k = layout.dp_shard, f.shard_per_node
    ring = 1.0 / k if k < W else 0.0
    out = {"intra": 0.0, "cross": 0.0}

    def add(nbytes: float, share: float, times: float = 1.0) -> None:
        out["cross"] += times * nbytes * share
        out["intra"] += times * nbytes * (1 - share)

    def gather(shard: float) -> None:
        if f.gather_hierarchical:      # the shard into the cross-node gather (all of it crosses), N into the node's
            add(shard, 1.0, microbatches)
            add(shard * W / k, 0.0, microbatches)
        else:
            add(shard, ring, microbatches)

    gather(local / W * f.gather_bpe)                                               # forward's gather
    if f.bwd_ranks >= W:
        gather(regathered * local / W * f.gather_bpe)                              # backward's, the same
    elif f.bwd_ranks > 1:
        add(regathered * local / f.bwd_ranks * training.gather_bytes, 0.0, microbatches)   # inside the node
    if f.reduce == "flat":
        add(local * f.reduce_bpe, (W - k) / W if k < W else 0.0)
    elif f.reduce == "hierarchical":
        nodes = W // k
        add(local * training.grad_reduce_bytes, 0.0)                               # the node's fp32 all-to-all
        add(local / k * f.reduce_bpe, (nodes - 1) / nodes)                        # one payload per node across
    else:
        name = layout.compress.name
        red = 2.0 if name in FSDP_REDUCE_DTYPES and name != "none" else training.grad_reduce_bytes
        add(local * red, ring)
    return out


def _outer_step_time(cloud: Any, layout: Any, sync: Any, shard: float, dim: str, traffic: Any) -> float:
    """Seconds of one outer step of a local-step strategy (localsgd / diloco / streaming / sparseloco) carrying
    ``shard`` parameters per rank across ``layout.dp_replicate`` replicas over mesh dimension ``dim``."""
    if sync.method == "sparseloco":      # top-k per chunk: int16 index + `bits` code, one fp32 scale, gathered
        per_element = (2 * sync.topk + sync.topk * sync.bits / 8 + 4) / sync.chunk
        return dim_time(cloud, layout, dim, "all_gather", shard * per_element * layout.dp_replicate, traffic)
    if sync.bits in (4, 8):              # bits-wide codes + one fp32 scale per OUTER_QBLOCK elements, gathered
        per_element = sync.bits / 8 + 4 / OUTER_QBLOCK
        return dim_time(cloud, layout, dim, "all_gather", shard * per_element * layout.dp_replicate, traffic)
    return dim_time(cloud, layout, dim, "all_reduce", shard * {"fp32": 4, "bf16": 2, "fp16": 2}[sync.dtype], traffic)


def _hierarchical(cloud: CloudConfig, layout: Layout) -> bool:
    """Whether syncwise's hierarchical gradient sync runs (the layout owner's rule, on the data-parallel group's
    nodes × ranks per node): only where the group spans nodes with more than one rank on each."""
    n, _, pn = group(cloud, layout, "dp")
    if pn <= 1 or n <= pn or n % pn:
        return False
    return hierarchical_applies(owner_layout(layout), n // pn, pn)


def _overlap(total: float, training: Training, layout: Layout, window: float, local: float) -> float:
    """Exposed part of a bucketed gradient sync: the last bucket always, the rest beyond the backward window
    (no overlap when the recipe does not overlap, or under pp in syncwise: StageGradientSync runs after the
    schedule)."""
    if not training.overlap_dp or (layout.pp > 1 and not training.overlap_dp_with_pp):
        return total
    last = total * min(1.0, training.bucket_bytes / max(local * 4, 1.0))
    return max(last, total - window)


def _codec_time(cloud: CloudConfig, wire: Wire, elements: float, n: int, tensors: float) -> float:
    """Seconds of a compressor's encode + decode for ``elements`` in ``tensors`` gradient tensors among ``n`` peers.
    Measured on this accelerator (``Accelerator.codec_cost``, for one peer: scaled to ``n`` by the decode's share
    of CODEC_COST's traffic) when ``syncwise plan --calibrate`` measured it, else CODEC_COST's memory traffic at
    the HBM bandwidth plus its FLOPs at half the peak."""
    acc = cloud.accelerator
    traffic = elements * (wire.compute_bytes + wire.compute_bytes_per_peer * n)
    measured = acc.codec(wire.codec)
    if measured is not None:
        one_peer = wire.compute_bytes + wire.compute_bytes_per_peer
        scale = (wire.compute_bytes + wire.compute_bytes_per_peer * n) / one_peer if one_peer else 1.0
        return (elements * measured[0] + tensors * measured[1]) * scale
    return traffic / acc.hbm_bandwidth + elements * wire.flops_per_element / (acc.peak_bf16_flops * 0.5)


def memory_only(model: ModelSpec, layout: Layout, training: Training, seq_len: int, micro_batch: int,
                microbatches: int) -> Memory:
    """The memory model alone (the search prunes with it before timing)."""
    return memory_per_rank(model, layout, training, seq_len, micro_batch, microbatches)
