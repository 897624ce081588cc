"""The one owner of what a layout is and which layouts syncwise can run (DESIGN.md §3.1b). Torch-free: a leaf.

A :class:`Layout` is the degrees (``pp × dp_replicate × dp_shard × tp`` = the world size, ``ep`` borrowed from
data parallel), the pipeline's schedule and microbatches, expert parallel's dispatch precision, the parsed
gradient compressor (:class:`Compress`, from the torch-free table :data:`COMPRESSORS`) and the parsed sync
strategy (:class:`SyncSpec`, None for every-step). Every rule between them is written once, here, with its
reason: :meth:`Layout.resolve` (the world size), :meth:`Layout.check` (compressor × sync × degrees) and
:meth:`Layout.check_model` (the model's shape). The command line (``syncwise.config``), the Python API
(``syncwise.parallel.parallelize``) and the planner (``syncwise.plan``) all ask it, so they accept and refuse the
same layouts with the same ``ConfigError`` (field names as in the config: ``parallel.*``, ``compress.method``).

The pipeline schedules' table and rules (:data:`SCHEDULE_SPECS`, :func:`check_pipeline_shape`) and the
compressors' wire and state data (:class:`CompressorSpec`) are here too, so the planner reads them without torch.
What stays elsewhere, because it needs torch or a layer above: whether the installed torch ships the schedule's
class and has fp8 for the expert dispatch (``parallel.mesh.check_torch_support``), and rules that need the data
(``data.batch_size`` against the pipeline's microbatches: ``syncwise.config``). The rules between the layout and
the step's training fields (dynamic batching, accumulation, fp16) are :func:`check_step`, asked by both doors.
``syncwise.parallel.ParallelSpec`` is this Layout under its torch-side name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import ConfigError
from .specs import (BOOL_ACCEPTED, check_keys, count, parse_spec, read_bool, read_float, read_int, read_value,
                    spec_name)

# ============================================================================================ compressor specs
#: Tensors with fewer elements than this (norms, biases) are sent uncompressed: the one default of every door's
#: ``min_numel`` (config, OptimizedTrainer, parallelize, the DDP hook, the integrations).
MIN_NUMEL = 4096
#: DDP's gradient bucket size in MB (torch's own default): the one default of every door's ``bucket_cap_mb``.
BUCKET_CAP_MB = 25.0
_SEED = ("int", 0, "base seed for random draws (same on all ranks)")


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor as plain data: its name, a one-line summary, options (key -> (type name, default, doc)),
    what crosses the wire and what it keeps. ``compress/`` builds instances from it (their ``Config`` is made from
    ``options``); the planner reads the wire and the state from it (:class:`Compress`'s properties).

    Wire: ``bytes_per_element`` when fixed; else ``element_bytes`` per sent element, of a ``kept_fraction`` option's
    share of the elements, plus one fp32 scale every ``scale_every`` option's elements; None for both when it
    depends on the tensors' shapes (PowerSGD). ``collective``: how the payload travels (``all_reduce`` or
    ``all_gather``), ``collectives_per_bucket``. State: fp32 residuals (error feedback) and ``state_options``,
    options whose non-zero value keeps one more fp32 buffer per element (top-k's DGC momentum)."""

    name: str
    summary: str
    options: dict = field(default_factory=dict)
    bytes_per_element: Optional[float] = None
    torch_hook: bool = False
    always_error_feedback: bool = False   # keeps residuals whatever its options say (PyTorch's PowerSGD hook)
    collective: str = "all_reduce"
    collectives_per_bucket: int = 1
    element_bytes: Optional[float] = None
    kept_fraction: str = ""
    scale_every: str = ""
    state_options: tuple = ()

    @property
    def error_feedback(self) -> bool:
        """Whether this compressor keeps error-feedback residuals by default."""
        return self.always_error_feedback or bool(self.options.get("error_feedback", (None, False))[1])


def _spec(name: str, summary: str, bpe: Optional[float] = None, torch_hook: bool = False, ef: bool = False,
          wire: tuple = (), **options: tuple) -> CompressorSpec:
    warm = {"warmup": _WARMUP} if name in _WARMUP_NAMES else {}
    return CompressorSpec(name, summary, {**({} if torch_hook else {"seed": _SEED}), **warm, **options}, bpe, torch_hook,
                          ef, **dict(wire))


# the lossy compressors that can send each tensor as fp32 for its first steps (PowerSGD has its own start_iter)
_WARMUP_NAMES = ("int8", "sign", "topk", "randomk", "demo")
_WARMUP = ("int", 0, "steps each tensor is sent as its fp32 mean before it is compressed")


def _gather(element_bytes: float, kept_fraction: str = "", scale_every: str = "", **more: Any) -> tuple:
    return (("collective", "all_gather"), ("element_bytes", element_bytes), ("kept_fraction", kept_fraction),
            ("scale_every", scale_every), *more.items())


_EF = "error_feedback"
#: name -> CompressorSpec, in the order the CLI lists them (syncwise's compressors, then PyTorch's hooks)
COMPRESSORS: dict[str, CompressorSpec] = {s.name: s for s in [
    _spec("none", "fp32 all-reduce average (the DDP baseline), 4 B/element", 4.0),
    _spec("fp16", "fp16 all-reduce, 2 B/element", 2.0),
    _spec("bf16", "bf16 all-reduce (works on gloo too), 2 B/element", 2.0),
    _spec("fp8", "fp8 e4m3 + fp32 scale per block, all-gather, ~1 B/element", wire=_gather(1.0, scale_every="block"),
          block=("int", 128, "elements per fp32 scale (DeepSeek-V3 uses 1x128 tiles)"),
          error_feedback=("bool", False, "keep the rounding error and add it to the next step's gradient")),
    _spec("int8", "QSGD int8, stochastic rounding, per-chunk scales, all-gather, ~1 B/element",
          wire=_gather(1.0, scale_every="chunk"),
          chunk=("int", 1024, "elements per fp32 scale (max |x| of the chunk)"),
          levels=("int", 127, "quantization levels per sign, 1..127 (QSGD's s)"),
          stochastic=("bool", True, "stochastic rounding (unbiased); false = round to nearest"),
          error_feedback=("bool", False, "keep the quantization error for the next step")),
    _spec("sign", "1-bit sign + per-tensor scale + error feedback, all-gather, 1/8 B/element", 0.125,
          wire=_gather(0.125),
          error_feedback=("bool", True, "keep what the sign dropped (EF-SignSGD); without it sign is biased")),
    _spec("topk", "top-k values+indices per tensor, error feedback, all-gather, 8 B/kept element",
          wire=_gather(8.0, kept_fraction="ratio", state_options=("momentum",)),
          ratio=("float", 0.01, "fraction of each tensor's elements sent (k = ceil(ratio * numel))"),
          error_feedback=("bool", True, "accumulate unsent values locally and add them next step"),
          momentum=("float", 0.0, "DGC momentum correction factor (0 = off; then use an optimizer without momentum)")),
    _spec("randomk", "random-k with a shared seed, error feedback, all-reduce, 4 B/kept element",
          wire=(("element_bytes", 4.0), ("kept_fraction", "ratio")),
          ratio=("float", 0.01, "fraction of each tensor's elements sent"),
          error_feedback=("bool", True, "accumulate unsent values locally and add them next step")),
    _spec("powersgd", "rank-r PowerSGD, warm start, error feedback, 2 all-reduces/bucket",
          wire=(("collectives_per_bucket", 2),),
          rank=("int", 4, "rank r of the approximation P @ Q^T"),
          ratio=("float", 0.0, "if > 0: per-tensor rank r = ratio*n*m/(n+m) (overrides rank)"),
          start_iter=("int", 10, "steps each tensor is sent uncompressed before PowerSGD starts"),
          min_compression_rate=("float", 2.0, "compress a tensor only if n*m / ((n+m)*r) exceeds this"),
          warm_start=("bool", True, "reuse last step's Q as the starting point of the power iteration"),
          error_feedback=("bool", True, "add last step's approximation error to the gradient"),
          batch_3d=("bool", True, "treat a 3-D tensor (E, n, m), e.g. MoE expert weights, as E matrices n x m")),
    _spec("demo", "DeMo decoupled momentum: top-k DCT coefficients per tile of the local momentum, all-gather, "
          "6 B/kept coefficient (~0.047 B/element at chunk 64, topk 32)",
          wire=_gather(6.0, kept_fraction="topk/chunk/chunk"),
          chunk=("int", 64, "DCT tile side: a 2-D view is cut into tiles of up to chunk x chunk (2..128)"),
          topk=("int", 32, "DCT coefficients sent per chunk x chunk tile (fewer for smaller tiles; at least 1)"),
          decay=("float", 0.9, "momentum decay: m = decay*m + g; what was sent is removed from m"),
          sign=("bool", True, "apply the sign of the decoded mean (DeMo's signSGD); false: the decoded mean")),
    # PyTorch's DDP comm hooks (the reference; parallel.data_parallel.TorchHookSpec reads their bounds)
    _spec("torch-allreduce", "PyTorch's default all-reduce hook, 4 B/element", 4.0, torch_hook=True),
    _spec("torch-fp16", "PyTorch's fp16_compress_hook, 2 B/element", 2.0, torch_hook=True),
    _spec("torch-bf16", "PyTorch's bf16_compress_hook, 2 B/element", 2.0, torch_hook=True),
    _spec("torch-powersgd", "PyTorch's PowerSGD hook (error feedback, warm start)", torch_hook=True, ef=True,
          wire=(("collectives_per_bucket", 2),),
          rank=("int", 4, "matrix_approximation_rank (syncwise's default; PyTorch's is 1)"),
          start_iter=("int", 10, "start_powerSGD_iter (syncwise's default; PyTorch's is 1000)"),
          min_compression_rate=("float", 2.0, "min_compression_rate")),
]}
#: compressors that FSDP2 runs as its own reduce dtype (a 16-bit reduce-scatter is FSDP's compressed sync)
FSDP_REDUCE_DTYPES = ("none", "bf16", "fp16")
#: compressors that become FSDP2's reduce-scatter itself when there is one replica (dp_shard > 1, dp_replicate = 1):
#: blockwise codes exchanged by all-to-all, summed in fp32 (syncwise.parallel.fsdp_quant; ZeRO++'s qgZ)
FSDP_QUANTIZED = ("int8", "fp8")
#: parallel.fsdp_gather: the precision of FSDP2's parameter all-gathers (fp32: FSDP2's own, in the param dtype)
FSDP_GATHER = ("fp32", "bf16", "fp8", "int8")
#: parallel.fsdp_reshard: what a unit keeps after its forward — all: resharded over every shard rank (ZeRO-3);
#: node: over the ranks of its node (backward's all-gather stays in the node: ZeRO++'s hpZ); none: unsharded to
#: its backward (ZeRO-2-like, most memory)
FSDP_RESHARD = ("all", "node", "none")
_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


#: ``--compress auto`` / ``--sync auto``: a parsed value (:data:`AUTO_COMPRESS`, :data:`AUTO_SYNC`), replaced before
#: any worker starts by the strategy predicted to reach fp32 DDP's loss soonest (``syncwise.plan.strategy``, the one
#: place it is resolved); :meth:`Layout.auto_choices` says what it chooses among and refuses a conflicting option.
AUTO = "auto"


def names_auto(text: Any) -> bool:
    """Whether a ``--compress`` / ``--sync`` value is ``auto`` (the one test; the parsers below use it)."""
    return isinstance(text, str) and text.strip().lower() == AUTO


#: the prefix of PyTorch's own DDP comm hooks among the compressors (``torch-powersgd``): :func:`names_torch_hook`
TORCH_HOOK_PREFIX = "torch-"


def names_torch_hook(text: Any) -> bool:
    """Whether a ``--compress`` value (or a compressor's name) names one of PyTorch's DDP comm hooks (the one test)."""
    return spec_name(text).startswith(TORCH_HOOK_PREFIX)


def compressors_accepted() -> str:
    return ("NAME[:key=value,...] with NAME in " + ", ".join(n for n, s in COMPRESSORS.items() if not s.torch_hook)
            + "; or auto (the strategy predicted to reach fp32 DDP's loss soonest on this cluster)")


@dataclass(frozen=True)
class Compress:
    """A parsed ``--compress`` spec: ``name``, the ``given`` options (typed, as written) and ``text`` (stripped)."""

    name: str = "none"
    given: dict = field(default_factory=dict)
    text: str = "none"

    @property
    def spec(self) -> CompressorSpec:
        """The table's entry (a user's own Compressor class, not in the table: no options, no residuals)."""
        return COMPRESSORS.get(self.name) or CompressorSpec(self.name, "a user compressor",
                                                            torch_hook=names_torch_hook(self.name))

    @property
    def options(self) -> dict[str, Any]:
        """Every option of the compressor, defaults filled in."""
        return {k: v[1] for k, v in self.spec.options.items()} | self.given

    @property
    def error_feedback(self) -> bool:
        """Whether the compressor keeps error-feedback residuals (fp32, one per gradient element)."""
        return self.name != "none" and (self.spec.always_error_feedback or bool(self.options.get(_EF, False)))

    @property
    def torch_hook(self) -> bool:
        return self.spec.torch_hook

    @property
    def bytes_per_element(self) -> Optional[float]:
        """Bytes on the wire per gradient element (of the part it compresses), from the table and the options;
        None where it depends on the tensors' shapes (PowerSGD: the planner's model of the matrices)."""
        sp, o = self.spec, self.options
        if sp.bytes_per_element is not None:
            return sp.bytes_per_element
        if sp.element_bytes is None:
            return None
        return sp.element_bytes * self.kept_fraction + (4 / o[sp.scale_every] if sp.scale_every else 0.0)

    @property
    def kept_fraction(self) -> float:
        """The fraction of the elements sent: the spec's ``kept_fraction`` option (top-k's ``ratio``), or a quotient
        of options (DeMo's ``topk/chunk/chunk``: coefficients kept per chunk × chunk tile); 1 when all are sent."""
        names = self.spec.kept_fraction.split("/") if self.spec.kept_fraction else []
        out = float(self.options[names[0]]) if names else 1.0
        for name in names[1:]:
            out /= self.options[name]
        return out

    @property
    def state_bytes_per_element(self) -> float:
        """Per-rank state, in bytes per gradient element it compresses: fp32 residuals with error feedback, one
        more fp32 buffer per ``state_options`` option that is on (top-k's DGC momentum)."""
        on = [k for k in self.spec.state_options if self.options.get(k)]
        return 4.0 * (int(self.error_feedback) + len(on))

    @property
    def is_none(self) -> bool:
        return self.name == "none"

    @property
    def is_auto(self) -> bool:
        """``auto``: not a compressor yet; resolved at start-up (``syncwise.plan.strategy.resolve_auto``)."""
        return self.name == AUTO

    def __hash__(self) -> int:  # (equal specs have equal text; ``given`` is a dict)
        return hash((self.name, self.text))

    def __str__(self) -> str:
        return self.text


def parse_compress(text: Any, field_name: str = "compress") -> Compress:
    """``NAME[:key=value,...]`` → :class:`Compress`, checked against :data:`COMPRESSORS` (name, keys, types).
    The compressor's own value bounds are its constructor's (``compress/``) or TorchHookSpec's."""
    if isinstance(text, Compress):
        return text
    if text is None:
        return NO_COMPRESS
    if names_auto(text):
        return AUTO_COMPRESS
    torch_hook = names_torch_hook(text)
    accepted = (compressors_accepted() if not torch_hook else
                "torch-allreduce, torch-fp16, torch-bf16, torch-powersgd[:rank=R,start_iter=N,min_compression_rate=X]")
    name, raw = parse_spec(text, field_name, accepted)
    spec = COMPRESSORS.get(name)
    if spec is None or spec.torch_hook != torch_hook:
        raise ConfigError(field_name, text, accepted)
    keys = ", ".join(spec.options) or "(none)"
    check_keys(raw, spec.options, field_name, text,
               f"options of {name}: {keys} (as key=value)" if not torch_hook else accepted)
    given = {k: read_value(v, _TYPES[spec.options[k][0]], field_name, text, k) for k, v in raw.items()}
    return Compress(name, given, text.strip())


NO_COMPRESS = Compress()
AUTO_COMPRESS = Compress(AUTO, {}, AUTO)

# ============================================================================================ sync specs
EVERY_STEP = "every-step"
SYNC_DTYPES = ("fp32", "bf16", "fp16")
# Bounds: an average at least every MAX_PERIOD steps, warm-up within train.steps' own bound, and an outer step
# of at most MAX_OUTER_LR x the averaged pseudo-gradient (DiLoCo uses 0.7; far above 1 every average overshoots).
MAX_PERIOD = 1_000_000
MAX_WARMUP = 1_000_000_000
MAX_OUTER_LR = 10.0
MAX_CHUNK = 32768  # sparseloco: an index within a chunk fits an int16
# method -> defaults; DiLoCo's outer optimizer follows the paper (lr 0.7, Nesterov momentum 0.9).
METHODS = {
    "localsgd": {"period": 16, "outer_lr": 1.0, "momentum": 0.0, "nesterov": False, "delay": 0,
                 "dtype": "fp32", "warmup": 0, "bits": 32},
    "diloco": {"period": 16, "outer_lr": 0.7, "momentum": 0.9, "nesterov": True, "delay": 0,
               "dtype": "fp32", "warmup": 0, "bits": 32},
    "torch-localsgd": {"period": 16, "warmup": 0},
    "pipesgd": {"dtype": "fp32"},
    # SparseLoCo (arXiv 2508.15706): chunked top-k + 2-bit pseudo-gradient, error feedback (decay) for outer momentum
    # Streaming DiLoCo (arXiv 2501.18512): DiLoCo per parameter fragment, the fragments' syncs staggered
    "streaming": {"period": 16, "fragments": 4, "outer_lr": 0.7, "momentum": 0.9, "nesterov": True, "delay": 0,
                  "dtype": "fp32", "warmup": 0, "bits": 32},
    "sparseloco": {"period": 16, "outer_lr": 1.0, "decay": 0.95, "chunk": 4096, "topk": 64, "bits": 2, "delay": 0,
                   "warmup": 0},
}
#: ``bits=`` of localsgd / diloco / streaming: 4 or 8 quantize the outer gradient (per block of OUTER_QBLOCK elements,
#: one fp32 scale each, error feedback) and all-gather it; 16 and 32 leave it unquantized (``dtype=`` casts to 16 bits)
OUTER_BITS = (4, 8, 16, 32)
OUTER_QBLOCK = 256
#: the sync strategies that run over HSDP's replica groups (an outer step per shard across dp_replicate)
HSDP_SYNC = ("localsgd", "diloco", "streaming", "sparseloco")
#: state a sync strategy keeps per parameter, in fp32 copies of the model (anchor; DiLoCo: + outer momentum)
SYNC_STATE_COPIES = {"localsgd": 1, "diloco": 2, "torch-localsgd": 1, "pipesgd": 0, "sparseloco": 2, "streaming": 2}
SYNC_ACCEPTED = ("every-step (DDP all-reduce each step); auto (the strategy predicted to reach fp32 DDP's loss "
                 "soonest on this cluster); localsgd[:period=H,delay=D,dtype=fp32|bf16|fp16,warmup=W,"
                 "outer_lr=X,momentum=M,nesterov=yes|no,bits=4|8|16|32]; diloco[:...same keys; defaults outer_lr=0.7,"
                 "momentum=0.9,"
                 "nesterov=yes]; torch-localsgd[:period=H,warmup=W] (PyTorch's PeriodicModelAverager); "
                 "pipesgd[:dtype=fp32|bf16|fp16] (gradient all-reduce overlapped with the next step); "
                 "streaming[:fragments=F,...diloco's keys] (Streaming DiLoCo: F fragments synced in turn); "
                 "sparseloco[:period=H,outer_lr=X,decay=B,chunk=C,topk=K,bits=2|32,delay=D,warmup=W] (top-k of each "
                 "chunk + 2-bit pseudo-gradient, error feedback)")


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
    decay: float = 0.95   # sparseloco: error-feedback decay (stands in for the outer momentum)
    chunk: int = 4096     # sparseloco: elements per top-k chunk
    topk: int = 64        # sparseloco: elements sent per chunk
    bits: int = 2         # sparseloco: bits per sent value (2, or 32 = fp32)
    fragments: int = 1    # streaming: parameter fragments, synced in turn
    options: dict = field(default_factory=dict)  # what the user wrote, for the spec string
    text: str = field(default="", compare=False)  # the spec as written (stripped)

    @property
    def spec(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return self.method + (f":{opts}" if opts else "")

    @property
    def is_auto(self) -> bool:
        """``auto``: not a strategy yet; resolved at start-up (``syncwise.plan.strategy.resolve_auto``)."""
        return self.method == AUTO

    @property
    def state_copies(self) -> int:
        """fp32 copies of the model the strategy keeps (:data:`SYNC_STATE_COPIES`)."""
        return SYNC_STATE_COPIES[self.method]

    def __hash__(self) -> int:
        return hash(self.spec)

    def __str__(self) -> str:
        return self.text or self.spec

    @staticmethod
    def parse(spec: str, field_name: str = "parallel.sync") -> "Optional[SyncSpec]":
        """None for ``every-step``; a spec otherwise; anything malformed raises ConfigError naming it."""
        method, raw_options = parse_spec(spec, field_name, SYNC_ACCEPTED)
        if method == EVERY_STEP and not raw_options:
            return None
        if method == AUTO and not raw_options:
            return AUTO_SYNC
        if method not in METHODS:
            raise ConfigError(field_name, spec, SYNC_ACCEPTED)
        values: dict[str, Any] = dict(METHODS[method])
        check_keys(raw_options, values, field_name, spec,
                   f"keys of {method}: {', '.join(values)} ({SYNC_ACCEPTED})")
        options: dict[str, Any] = {}
        for key, text in raw_options.items():
            options[key] = values[key] = _coerce(field_name, spec, key, text, values[key])
        out = SyncSpec(method, options=options, text=spec.strip(), **values)
        checks = [(1 <= out.period <= MAX_PERIOD, "period", f"an integer ≥ 1 and ≤ {MAX_PERIOD:,}"),
                  (0 <= out.delay <= out.period, "delay", f"an integer in [0, period] = [0, {out.period}]"),
                  (0 <= out.warmup <= MAX_WARMUP, "warmup", f"an integer in [0, {MAX_WARMUP:,}]"),
                  (0 < out.outer_lr <= MAX_OUTER_LR, "outer_lr", f"a number in (0, {MAX_OUTER_LR:g}]"),
                  (0 <= out.momentum < 1, "momentum", "a number in [0, 1)"),
                  (out.dtype in SYNC_DTYPES, "dtype", "one of " + ", ".join(SYNC_DTYPES)),
                  (0 <= out.decay < 1, "decay", "a number in [0, 1)"),
                  (2 <= out.chunk <= MAX_CHUNK, "chunk", f"an integer in [2, {MAX_CHUNK}]"),
                  (1 <= out.topk <= out.chunk, "topk", f"an integer in [1, chunk] = [1, {out.chunk}]"),
                  ("bits" not in values or (out.bits in (2, 32) if method == "sparseloco" else out.bits in OUTER_BITS),
                   "bits",
                   "2 or 32" if method == "sparseloco" else
                   "4 or 8 (quantized outer gradients), 16 or 32 (not quantized; dtype= casts to 16 bits)"),
                  ("bits" not in values or method == "sparseloco" or out.bits >= 16 or out.dtype == "fp32", "bits",
                   f"16 or 32 with dtype={out.dtype} (bits=4|8 quantize the fp32 outer gradient; dtype= casts it: "
                   "pick one)"),
                  (1 <= out.fragments <= out.period, "fragments", f"an integer in [1, period] = [1, {out.period}]")]
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


AUTO_SYNC = SyncSpec(AUTO, text=AUTO)


def parse_sync(text: Any, field_name: str = "parallel.sync") -> Optional[SyncSpec]:
    """A sync spec (text, a SyncSpec, or None for every-step) as a SyncSpec or None."""
    if text is None or isinstance(text, SyncSpec):
        return text
    if names_auto(text):
        return AUTO_SYNC
    return SyncSpec.parse(text, field_name)


# ============================================================================================ the layout
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: the mesh's order
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "ep")
DISPATCH = ("fp8", "bf16", "fp32")


@dataclass(frozen=True)
class ScheduleSpec:
    """What syncwise knows about one of torch's pipeline schedules (plain data; ``parallel/pipeline.py`` maps
    ``torch_name`` to the class the installed torch ships)."""

    name: str                 # syncwise's name (``--parallel.pp_schedule``)
    torch_name: str           # the class in torch.distributed.pipelining
    stages_per_rank: str      # "1", ">=2" or "2" (V shape)
    microbatches: str         # the rule on M, in words (checked by ``microbatch_error``)
    refused: tuple[tuple[str, str], ...] = ()   # (backend, why) pairs where the schedule cannot run

    @property
    def multi_stage(self) -> bool:
        """Several stages per rank (torch's ``PipelineScheduleMulti``: a list of stages)."""
        return self.stages_per_rank != "1"

    @property
    def v_shape(self) -> bool:
        """Stages placed in a V (rank r holds stages r and 2·pp−1−r): the first and the last stage share rank 0."""
        return self.stages_per_rank == "2"

    def microbatch_error(self, pp: int, microbatches: int) -> Optional[str]:
        """Why ``microbatches`` cannot run at ``pp`` ranks (None: it can). The rules are torch's own (2.13)."""
        m, stages = microbatches, pp * (2 if self.v_shape else 1)
        if self.name == "1f1b" and m < pp:
            return f"at least pp ({pp}) microbatches for 1f1b (torch's Schedule1F1B: its warm-up fills every stage)"
        if self.name == "dualpipev" and m < stages:
            return f"at least 2 × pp ({stages}) microbatches for dualpipev (one per stage of the V)"
        if self.name in ("interleaved-1f1b", "interleaved-zb") and m % max(1, m // pp):
            rounds = max(1, m // pp)
            return (f"a multiple of the number of rounds max(1, M // pp) = {rounds} for {self.name} "
                    f"(e.g. {rounds * (m // rounds)} or {rounds * (m // rounds + 1)})")
        return None

    def check_stages_per_rank(self, stages_per_rank: int) -> None:
        ok = {"1": stages_per_rank == 1, ">=2": stages_per_rank >= 2, "2": stages_per_rank == 2}[self.stages_per_rank]
        if not ok:
            accepted = {"1": f"1 for {self.name}, a single-stage schedule (interleave with interleaved-1f1b, "
                             "looped-bfs, interleaved-zb, zbv or dualpipev)",
                        ">=2": f"≥ 2 for {self.name} (with 1 stage per rank use 1f1b or gpipe)",
                        "2": f"exactly 2 for {self.name}: its stages form a V (rank r holds stages r and 2·pp−1−r)"}
            raise ConfigError("parallel.stages_per_rank", stages_per_rank, accepted[self.stages_per_rank])


#: syncwise's name -> ScheduleSpec, for every schedule syncwise drives (which ones the installed torch ships:
#: ``parallel.pipeline.torch_schedules``)
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", "ScheduleGPipe", "1", "any M ≥ 1"),
    ScheduleSpec("1f1b", "Schedule1F1B", "1", "M ≥ pp"),
    ScheduleSpec("interleaved-1f1b", "ScheduleInterleaved1F1B", ">=2", "M a multiple of max(1, M // pp)"),
    ScheduleSpec("looped-bfs", "ScheduleLoopedBFS", ">=2", "any M ≥ 1"),
    ScheduleSpec("interleaved-zb", "ScheduleInterleavedZeroBubble", ">=2", "M a multiple of max(1, M // pp)"),
    ScheduleSpec("zbv", "ScheduleZBVZeroBubble", "2", "any M ≥ 1"),
    ScheduleSpec("dualpipev", "ScheduleDualPipeV", "2", "M ≥ 2 × pp"),
)}
SCHEDULES = tuple(SCHEDULE_SPECS)


def schedule_spec(schedule: Any) -> ScheduleSpec:
    """The table's entry for ``schedule``, or a ConfigError naming ``parallel.pp_schedule``."""
    spec = SCHEDULE_SPECS.get(schedule) if isinstance(schedule, str) else None
    if spec is None:
        raise ConfigError("parallel.pp_schedule", schedule, "one of: " + ", ".join(SCHEDULE_SPECS))
    return spec


def check_pipeline_shape(n_layers: int, pp: int, schedule: str, microbatches: int, stages_per_rank: int = 1
                         ) -> ScheduleSpec:
    """The pipeline's rules that need no torch: a known schedule; ``stages_per_rank`` the schedule can hold
    (gpipe / 1f1b: 1; interleaved-1f1b / looped-bfs / interleaved-zb: ≥ 2; zbv / dualpipev: exactly 2, in a V);
    at most one stage per layer; a microbatch count the schedule takes (``ScheduleSpec.microbatch_error``). With
    ``pp == 1`` only the values themselves are checked (nothing is pipelined)."""
    pp = count("parallel.pp", pp)
    microbatches = count("parallel.microbatches", microbatches)
    stages_per_rank = count("parallel.stages_per_rank", stages_per_rank)
    spec = schedule_spec(schedule)
    if pp == 1:
        return spec
    spec.check_stages_per_rank(stages_per_rank)
    stages = pp * stages_per_rank
    if stages > n_layers:
        fld = "parallel.pp" if pp > n_layers else "parallel.stages_per_rank"
        raise ConfigError(fld, pp if fld == "parallel.pp" else stages_per_rank,
                          f"a layout with at most one stage per layer: pp × stages_per_rank = {stages} stages "
                          f"for {n_layers} layers")
    why = spec.microbatch_error(pp, microbatches)
    if why:
        raise ConfigError("parallel.microbatches", microbatches, why)
    return spec


#: dist.hierarchical's values
HIERARCHICAL = ("auto", "on", "off")


def hierarchical_applies(lay: "Layout", nodes: int, procs_per_node: int) -> bool:
    """Whether the hierarchical gradient sync runs for checked layout ``lay`` on ``nodes`` × ``procs_per_node``
    ranks: 'on' always (a one-node or one-rank-per-node topology degenerates to one of the hops); 'auto' when
    there is a slow hop to spare (> 1 node, > 1 rank per node) and a syncwise compressor that all-gathers runs
    every step on DDP replicas. Where it pays (benchmarks/RESULTS.md §2, 2 lab nodes × 2 ranks at 100 Mbit/s,
    ``small``): a flat all-gather pushes (nodes − 1) × ranks-per-node payloads over each node's link, the
    hierarchical one about one — fp8 1.63× faster at the same loss; top-k 1 % 1.03× (its payload is already
    small). An all-reducing compressor only trades the ring's 1.5 payloads for one and pays the fp32 hops inside
    the node: PowerSGD rank 4 was 0.93×, so auto leaves it (and the casts, randomk) flat; 'on' still applies.
    fp32 'none' keeps DDP's built-in all-reduce under auto: the baseline stays PyTorch's.

    FSDP2's quantized reduce-scatter (:func:`fsdp_quantized_reduce`) is hierarchical — fp32 inside a node, quantized
    across nodes (ZeRO++'s hierarchical qgZ) — under 'auto' when its shard group spans nodes with more than one of
    its ranks on each (:func:`fsdp_node_ranks`): the cross-node all-to-all then carries one payload per node instead
    of one per rank of every other node; 'on' wherever the shard group fills whole nodes (one node: an exact fp32
    sum; one rank per node: the flat path)."""
    if fsdp_quantized_reduce(lay.compress, lay.dp_replicate, lay.dp_shard, lay.pp):
        k = fsdp_node_ranks(lay, procs_per_node)
        if lay.hierarchical == "on":
            return k > 0
        return lay.hierarchical == "auto" and 1 < k < lay.dp_shard
    if lay.hierarchical == "on":
        return True
    return (lay.hierarchical == "auto" and nodes > 1 and procs_per_node > 1 and lay.replicas_only
            and lay.sync is None and not lay.compress.is_none and not lay.compress.torch_hook
            and lay.compress.spec.collective == "all_gather")


@dataclass(frozen=True)
class Layout:
    """How a job is laid out; ``dp_replicate=0`` means "every rank left over" until :meth:`resolve`.
    Build one with :meth:`of` (which parses spec strings) and ask :meth:`check` whether syncwise runs it."""

    dp_replicate: int = 0
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 0       # 0: 2 × pp × stages_per_rank
    stages_per_rank: int = 1
    ep_dispatch: str = "fp32"   # fp8 is DeepSeek-V3's choice (with a bf16 combine)
    compress: Compress = NO_COMPRESS   # (text is parsed on construction)
    sync: Optional[SyncSpec] = None    # None: every-step
    # dist.hierarchical: reduce inside a node at full precision, compress only the inter-node hop (auto: when the
    # job has > 1 node and > 1 rank per node, which only the workers know; see compress.hierarchical)
    hierarchical: str = "auto"
    fsdp_gather: str = "fp32"   # FSDP_GATHER
    fsdp_reshard: str = "all"   # FSDP_RESHARD

    def __post_init__(self) -> None:
        if self.hierarchical not in HIERARCHICAL:
            raise ConfigError("dist.hierarchical", self.hierarchical, "one of: " + ", ".join(HIERARCHICAL))
        for name, accepted in (("fsdp_gather", FSDP_GATHER), ("fsdp_reshard", FSDP_RESHARD)):
            if getattr(self, name) not in accepted:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "one of: " + ", ".join(accepted))
        # Specs given as text are parsed here, once (a parsed spec passes through as it is).
        if not isinstance(self.compress, Compress):
            object.__setattr__(self, "compress", parse_compress(self.compress, "compress.method"))
        if self.sync is not None and not isinstance(self.sync, SyncSpec):
            object.__setattr__(self, "sync", parse_sync(self.sync))
        # Degrees are counts (a bool is not); dp_replicate 0 stands for "the rest".
        for name in DEGREES:
            v = getattr(self, name)
            lowest = 0 if name == "dp_replicate" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
                raise ConfigError(f"parallel.{name}", v, f"an integer ≥ {lowest}"
                                  + (" (0: the ranks dp_shard × tp leave)" if name == "dp_replicate" else ""))

    @classmethod
    def of(cls, compress: Any = "none", sync: Any = None, **degrees: Any) -> "Layout":
        """A Layout from degrees and pipeline/expert settings plus ``compress`` / ``sync`` as spec text (or
        parsed; None: none / every-step); spec errors name ``compress.method`` / ``parallel.sync``."""
        return cls(compress=NO_COMPRESS if compress is None else compress, sync=sync, **degrees)

    # ------------------------------------------------------------------------------------ auto
    @property
    def auto(self) -> bool:
        """``compress.method`` or ``parallel.sync`` is ``auto`` (not resolved yet)."""
        return self.compress.is_auto or (self.sync is not None and self.sync.is_auto)

    def auto_choices(self) -> tuple[bool, bool]:
        """(whether ``auto`` chooses the compressor, whether it chooses the sync strategy). ``compress.method=auto``
        chooses among the every-step compressors (parallel.sync every-step), ``parallel.sync=auto`` among the sync
        strategies and fp32 every-step (compress.method none), both auto among all of them. An explicit choice
        that rules out what auto would choose among is a ConfigError, not silently dropped."""
        ca, sa = self.compress.is_auto, self.sync is not None and self.sync.is_auto
        # A gradient compressor runs every step; local SGD / DiLoCo send pseudo-gradients, not gradients.
        if ca and not sa and self.sync is not None:
            raise ConfigError("compress.method", AUTO, f"a compressor spec, or auto with parallel.sync every-step or "
                              f"auto (compressors run every step; got parallel.sync={self.sync})")
        if sa and not ca and not self.compress.is_none:
            raise ConfigError("parallel.sync", AUTO, f"a sync spec, or auto with compress.method none or auto (the "
                              f"sync strategies send uncompressed pseudo-gradients; got compress.method="
                              f"{self.compress.text})")
        return ca, sa

    # ------------------------------------------------------------------------------------ derived
    @property
    def microbatches_per_step(self) -> int:
        """The pipeline's microbatches per step: ``microbatches``, or by default 2 × pp × stages_per_rank."""
        return self.microbatches or 2 * self.pp * self.stages_per_rank

    @property
    def dp(self) -> int:
        return max(self.dp_replicate, 1) * self.dp_shard

    @property
    def replicas_only(self) -> bool:
        """Every rank holds the whole model: no FSDP2 sharding, no tensor, pipeline or expert parallel."""
        return self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.ep == 1

    @property
    def fsdp(self) -> bool:
        """FSDP2 holds the data-parallel ranks: sharded, or replicas of a tensor-parallel model."""
        return self.dp_shard > 1 or self.tp > 1

    @property
    def sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def describe(self) -> str:
        """e.g. 'dp_replicate 2 × tp 2' (size-1 dimensions left out; 'single process' for 1)."""
        parts = [f"{n} {getattr(self, n)}" for n in DIMS + ("ep",) if getattr(self, n) > 1]
        return " × ".join(parts) or "single process"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension, in the mesh's rank order (``tp`` innermost, ``pp`` outermost):
        rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t."""
        t = rank % self.tp
        s = (rank // self.tp) % self.dp_shard
        r = (rank // (self.tp * self.dp_shard)) % max(self.dp_replicate, 1)
        p = rank // (self.tp * self.dp_shard * max(self.dp_replicate, 1))
        return {"pp": p, "dp_replicate": r, "dp_shard": s, "tp": t}

    def dp_rank(self, rank: int) -> int:
        """This rank's index among the data-parallel ranks (which batch shard it reads)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def _split_by(self) -> str:
        """The first dimension that splits a replica (for messages)."""
        return next(f"parallel.{n}={getattr(self, n)}" for n in ("dp_shard", "tp", "pp", "ep") if getattr(self, n) > 1)

    # ------------------------------------------------------------------------------------ the rules
    def resolve(self, world_size: int) -> "Layout":
        """The layout with ``dp_replicate`` (and the microbatch count) filled in for ``world_size`` ranks."""
        # pp × dp_replicate × dp_shard × tp is the world: each rank has one place on the mesh.
        inner = self.pp * self.dp_shard * self.tp
        replicate = self.dp_replicate or (world_size // inner if world_size % inner == 0 else 0)
        if replicate * inner != world_size:
            fld = "parallel.dp_replicate" if self.dp_replicate else "parallel.pp" if self.pp > 1 else \
                "parallel.dp_shard" if self.dp_shard > 1 else "parallel.tp"
            raise ConfigError(fld, getattr(self, fld.split(".")[1]),
                              f"a layout whose product pp × dp_replicate × dp_shard × tp equals the world size "
                              f"({world_size}); got {self.pp} × {self.dp_replicate or '(rest)'} × {self.dp_shard} × "
                              f"{self.tp}")
        out = dataclasses.replace(self, dp_replicate=replicate, microbatches=self.microbatches_per_step)
        # Expert parallel is built with replicas (and pp) so far; not yet with FSDP2 or tensor parallel.
        if self.ep > 1 and out.fsdp:
            other = "parallel.dp_shard" if self.dp_shard > 1 else "parallel.tp"
            raise ConfigError("parallel.ep", self.ep, f"1 with {other}={getattr(self, other.split('.')[1])}: expert "
                              "parallel composes with data-parallel replicas (dp_replicate) and pp so far; with "
                              "FSDP2 or tensor parallel it is not built yet")
        # Expert parallel borrows its ranks from data parallel: groups of ep neighbours among the dp ranks.
        if out.dp % self.ep:
            raise ConfigError("parallel.ep", self.ep, f"a divisor of the data-parallel ranks dp_replicate × dp_shard "
                              f"= {out.dp}: expert parallel borrows its ranks from data parallel; divisors: "
                              f"{divisors(out.dp)}")
        return out

    def check(self, world_size: Optional[int] = None) -> "Layout":
        """Every rule between the degrees, the compressor and the sync strategy; the resolved layout (self when
        ``world_size`` is None: the world is not known yet, only the rules that do not need it are checked)."""
        c, s = self.compress, self.sync
        if self.auto:
            # auto is a choice still to make (before any worker starts), not a strategy a worker can build.
            field_name = "compress.method" if c.is_auto else "parallel.sync"
            self.auto_choices()
            raise ConfigError(field_name, AUTO, "a strategy resolved before the layout is checked: syncwise train "
                              "and build_config resolve auto at start-up (syncwise.plan.strategy.resolve_auto, with "
                              "a CloudConfig)")
        # Local SGD / DiLoCo / Pipe-SGD average parameters (pseudo-gradients), not gradients: a gradient
        # compressor would have nothing to compress.
        if s is not None and not c.is_none:
            raise ConfigError("parallel.sync", _text(s), "every-step when compress.method is set (local SGD sends "
                              f"pseudo-gradients, not gradients; got compress.method={c.text})")
        lay = self.resolve(world_size) if world_size is not None else self
        if self.hierarchical == "on":
            # The hierarchical sync replaces DDP's per-bucket gradient average: whole replicas, every step, with a
            # syncwise compressor (or none: an fp32 hierarchical all-reduce); PyTorch's hooks issue their own.
            # FSDP2's qgZ: node first (dp_replicate 0: not resolved yet, the replica rule is checked once it is)
            quantized = fsdp_quantized_reduce(c, lay.dp_replicate or 1, lay.dp_shard, lay.pp)
            why = ("parallel.sync=" + _text(s) if s is not None else f"compress.method={c.text}" if c.torch_hook
                   else lay._split_by() if not (lay.replicas_only or quantized) else "")
            if why:
                raise ConfigError("dist.hierarchical", "on", f"auto or off with {why}: the hierarchical gradient sync "
                                  "needs DDP replicas synced every step with a syncwise compressor (or none), or "
                                  "FSDP2's quantized reduce-scatter (int8 / fp8, dp_shard > 1, one replica)")
        lay._check_fsdp_options()
        if lay.replicas_only:
            return lay
        # The reduced-sync strategies average whole replicas; sharded, tensor, pipeline and expert parallel split
        # a replica over ranks.
        if s is not None:
            lay._check_hsdp_sync(s)
            return lay
        if c.is_none:
            return lay
        if lay.fsdp:
            check_fsdp_compress(c, lay.dp_replicate, "compress.method", f" (with {lay._split_by()} FSDP2 reduces the "
                                "gradients)", dp_shard=lay.dp_shard, pp=lay.pp)
        elif lay.pp > 1 and c.torch_hook and lay.dp_replicate > 1:
            # A pipeline stage runs several backwards per step, which DDP (and so its comm hooks) cannot take.
            raise ConfigError("compress.method", c.text, "a syncwise compressor (or none) with pp > 1: PyTorch's DDP "
                              "comm hooks need DDP, which a pipeline stage's several backwards per step break")
        return lay

    def _check_fsdp_options(self) -> None:
        """``parallel.fsdp_gather`` / ``fsdp_reshard`` other than their defaults change FSDP2's parameter
        all-gathers, which only sharded parameters have (dp_shard > 1). (fsdp_reshard=node's own rule, a node's
        ranks dividing dp_shard, needs the topology: ``node_reshard``, where the workers start.)"""
        for name, default in (("fsdp_gather", "fp32"), ("fsdp_reshard", "all")):
            v = getattr(self, name)
            if v != default and self.dp_shard < 2:
                raise ConfigError(f"parallel.{name}", v, f"{default} with parallel.dp_shard = 1: only FSDP2's sharded "
                                  "parameters are all-gathered (set parallel.dp_shard ≥ 2)")

    def _check_hsdp_sync(self, s: SyncSpec) -> None:
        """A reduced-sync strategy on a layout that splits a replica: it runs over HSDP's replica groups (FSDP2 inside
        each dp_shard group every step, an outer step per shard across dp_replicate every period), nowhere else."""
        split = self.tp > 1 or self.pp > 1 or self.ep > 1
        if split or s.method not in HSDP_SYNC:
            dim = next((n for n in ("tp", "pp", "ep") if getattr(self, n) > 1), "")
            why = (f"with parallel.{dim}={getattr(self, dim, '')} (local steps run over whole replicas or HSDP's "
                   "replica groups: dp_shard × dp_replicate only)"
                   if split else f"{s.method} with dp_shard > 1 (over HSDP's replica groups only "
                   f"{', '.join(HSDP_SYNC)} run: PyTorch's averager and Pipe-SGD need whole replicas)")
            raise ConfigError("parallel.sync", _text(s), f"every-step {why}")
        if self.dp_replicate == 1:
            raise ConfigError("parallel.sync", _text(s), f"every-step with parallel.dp_shard={self.dp_shard} and "
                              "dp_replicate = 1: pure FSDP2 holds one replica, so there is nothing for an outer step "
                              "to average across; set parallel.dp_replicate ≥ 2 (HSDP) to run local steps")

    def check_model(self, model_config: Any) -> None:
        """The model-shape rules, torch-free: the pipeline's (``check_pipeline_shape``: the schedule, stages per
        rank and microbatches against the layers); the expert dispatch precision is one of :data:`DISPATCH` and
        ``ep`` divides the routed experts; ``tp`` divides every dimension tensor parallel splits (attention heads,
        the vocabulary, the dense SwiGLU width where a dense block exists, the fused shared-expert width of MoE
        blocks; MLA's latent ranks stay replicated) and ``seq_len`` (sequence parallel). What the installed torch
        ships (the schedule's class, fp8) is ``syncwise.parallel.mesh.check_torch_support``'s."""
        if model_config is None:
            return
        c = model_config
        if self.pp > 1:
            check_pipeline_shape(c.n_layers, self.pp, self.pp_schedule, self.microbatches_per_step,
                                 self.stages_per_rank)
        if self.ep > 1:
            if self.ep_dispatch not in DISPATCH:
                raise ConfigError("parallel.ep_dispatch", self.ep_dispatch, "one of: " + ", ".join(DISPATCH))
            moe = hasattr(c, "layer_is_moe") and any(c.layer_is_moe(i) for i in range(c.n_layers))
            check_expert_count(getattr(c, "n_routed_experts", 0) if moe else 0, self.ep)
        if self.tp == 1:
            return
        sizes = {"model.n_heads": c.n_heads, "model.vocab_size": c.vocab_size, "model.seq_len": c.seq_len}
        moe_blocks = [c.layer_is_moe(i) for i in range(c.n_layers)] if hasattr(c, "layer_is_moe") else []
        if not all(moe_blocks):
            sizes["model.ffn_hidden"] = c.ffn_hidden
        if any(moe_blocks) and getattr(c, "n_shared_experts", 0):
            sizes["model.moe_hidden × model.n_shared_experts"] = c.moe_hidden * c.n_shared_experts
        for name, size in sizes.items():
            if size % self.tp:
                raise ConfigError("parallel.tp", self.tp, f"a divisor of {name} ({size}): tensor parallel splits "
                                  f"it evenly across the tp ranks; divisors: {divisors(size)}")


def fsdp_quantized_reduce(c: Compress, dp_replicate: int, dp_shard: int, pp: int = 1) -> bool:
    """Whether ``c`` runs as FSDP2's reduce-scatter itself (quantized blocks by all-to-all, an fp32 sum:
    ``syncwise.parallel.fsdp_quant``): an int8 / fp8 spec, sharded parameters (dp_shard > 1), one replica and no
    pipeline (pipeline stages as FSDP2 roots are not tested with it yet). With replicas (HSDP) the compressor runs
    across them instead (the all-reduce hook), where the slow links are."""
    return c.name in FSDP_QUANTIZED and dp_shard > 1 and dp_replicate == 1 and pp == 1


def fsdp_reduce_bytes_per_element(c: Compress) -> float:
    """Bytes per gradient element FSDP2's quantized reduce-scatter sends (``parallel.fsdp_quant.codec_of``'s codec):
    int8 codes (4-bit, two per byte, with ``levels`` ≤ 7) plus one fp32 scale per ``chunk``; fp8 one byte plus one
    scale per ``block``. Torch-free (the planner prices it)."""
    o = c.options
    if c.name == "int8":
        return (0.5 if int(o["levels"]) <= 7 else 1.0) + 4 / int(o["chunk"])
    if c.name == "fp8":
        return 1.0 + 4 / int(o["block"])
    raise ValueError(f"no quantized reduce-scatter for {c.name!r}")


#: parallel.fsdp_gather's blocks (``parallel.fsdp_quant.gather_codec``: one fp32 scale per 128 weights)
FSDP_GATHER_BLOCK = 128


def fsdp_gather_bytes_per_element(gather: str, param_bytes: float) -> float:
    """Bytes per weight element a ``parallel.fsdp_gather`` all-gather sends, FSDP2's all-gather dtype being
    ``param_bytes`` wide (4: fp32, 2: bf16 mixed precision): fp32 → that dtype, bf16 → 2, int8 / fp8 → 1 + one fp32
    scale per block of 128."""
    if gather == "fp32":
        return param_bytes
    if gather == "bf16":
        return min(2.0, param_bytes)
    return 1.0 + 4 / FSDP_GATHER_BLOCK


def check_fsdp_compress(c: Compress, dp_replicate: int, field_name: str = "compress.method", why: str = "",
                        dp_shard: int = 1, pp: int = 1) -> bool:
    """The compressor a layout that FSDP2 holds (dp_shard > 1 or tp > 1) can run: True when it runs across the
    replica groups as FSDP2's all-reduce hook, False when it is FSDP2's own reduce dtype (none, bf16, fp16) or
    FSDP2's quantized reduce-scatter (:func:`fsdp_quantized_reduce`). ``dp_replicate`` 0: not known yet (the
    replica rule is checked once it is)."""
    # PyTorch's DDP comm hooks rewrite DDP's buckets; FSDP2 has none.
    if c.torch_hook:
        raise ConfigError(field_name, c.text, "a syncwise compressor (or none) with dp_shard > 1 or tp > 1: PyTorch's "
                          "DDP comm hooks need DDP's gradient buckets, and FSDP2 reduces gradients itself" + why)
    if c.name in FSDP_REDUCE_DTYPES:
        return False
    if fsdp_quantized_reduce(c, dp_replicate, dp_shard, pp):
        # FSDP2's reduce-scatter keeps no state between steps (each unit's buffer is new every backward): no
        # residuals to feed back, no per-tensor warm-up count.
        o = c.options
        if o.get(_EF):
            raise ConfigError(field_name, c.text, f"{c.name} without error_feedback as FSDP2's quantized "
                              "reduce-scatter (dp_shard > 1, dp_replicate = 1): it keeps no residuals; its blockwise "
                              "scales and the fp32 sum bound the error instead" + why)
        if o.get("warmup"):
            raise ConfigError(field_name, c.text, f"{c.name} with warmup=0 as FSDP2's quantized reduce-scatter "
                              "(dp_shard > 1, dp_replicate = 1): it counts no steps" + why)
        return False
    # Other compressors run as FSDP2's all-reduce hook across the replica groups; with one replica FSDP2's
    # reduce-scatter is the only gradient collective, and only int8 / fp8 replace it.
    if dp_replicate and dp_replicate < 2:
        quantized = " or int8 / fp8 with dp_shard > 1 and pp = 1 (FSDP2's quantized reduce-scatter)"
        raise ConfigError(field_name, c.text, f"none, bf16 or fp16{quantized} with dp_replicate = 1 under FSDP2 / "
                          f"tensor parallel: {c.name} compresses the all-reduce across replicas (FSDP2's all-reduce "
                          "hook), and with one replica FSDP2's reduce-scatter is the only gradient collective; set "
                          "parallel.dp_replicate ≥ 2 to run it" + why)
    return True


def fsdp_node_ranks(lay: "Layout", procs_per_node: int) -> int:
    """How many ranks of one dp_shard group share a node (tp is innermost: procs_per_node / tp, at most dp_shard);
    0 when they do not fill whole nodes evenly (tp not dividing the node, or that count not dividing dp_shard)."""
    if procs_per_node < 1 or procs_per_node % lay.tp:
        return 0
    k = min(procs_per_node // lay.tp, lay.dp_shard)
    return k if lay.dp_shard % k == 0 else 0


def node_reshard(lay: "Layout", procs_per_node: int) -> "bool | int":
    """FSDP2's ``reshard_after_forward`` for ``parallel.fsdp_reshard`` on nodes of ``procs_per_node`` ranks: all →
    True, none → False, node → the shard ranks of one node (procs_per_node / tp: tp is the innermost dimension),
    which must divide dp_shard (True when one node holds every shard rank, False when it holds one)."""
    if lay.fsdp_reshard != "node":
        return lay.fsdp_reshard == "all"
    k = procs_per_node // lay.tp if procs_per_node % lay.tp == 0 else 0
    if k < 1 or lay.dp_shard % k:
        raise ConfigError("parallel.fsdp_reshard", "node", f"all or none on nodes of {procs_per_node} ranks: node "
                          f"reshards to a node's shard ranks (ranks per node / tp = {procs_per_node}/{lay.tp}), which "
                          f"must be a whole number dividing parallel.dp_shard ({lay.dp_shard})")
    return True if k >= lay.dp_shard else False if k == 1 else k


def check_expert_count(n_routed_experts: int, ep: int) -> None:
    """``ep`` ≥ 1 divides the routed experts per layer (each ep rank holds the same number of experts)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError("parallel.ep", ep, "an integer ≥ 1")
    if ep == 1:
        return
    if n_routed_experts <= 0:
        raise ConfigError("parallel.ep", ep, "1 for a model without routed experts (model.n_routed_experts = 0)")
    if n_routed_experts % ep:
        divs = ", ".join(str(d) for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0)
        raise ConfigError("parallel.ep", ep, f"a divisor of model.n_routed_experts ({n_routed_experts}): each ep "
                          f"rank holds the same number of experts; divisors: {divs}")


def _text(sync: SyncSpec) -> str:
    return str(sync)


def divisors(n: int) -> str:
    small = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    return ", ".join(map(str, small)) + (" …" if n > 64 else "")


# ----------------------------------------------------------------------------------- live recovery (ft.replicas)
# Why each reduced-sync strategy is or is not a live-recovery worker (docs/live-recovery.md): under ft.replicas a
# local-SGD / DiLoCo *worker* is a whole replica group of one process; its round starts with a torchft quorum and
# ends with an outer all-reduce that commits (every replica applies it) or is discarded (back to the last outer step).
_LIVE_SYNC_REFUSED = {
    "torch-localsgd": "PyTorch's PeriodicModelAverager all-reduces on a fixed process group, not torchft's "
                      "reconfigurable one (use localsgd: the same average)",
    "pipesgd": "every gradient is applied one step late, so a step could not be committed or discarded on its own",
    "sparseloco": "its top-k pseudo-gradients are all-gathered (torchft's manager offers only an all-reduce) and its "
                  "per-replica error feedback would need a rollback of its own on a discarded round",
    "streaming": "its fragments sync at staggered steps, each needing its own quorum, commit and rollback "
                 "(torchft's DiLoCo with fragments does this; not wired into syncwise's seam)",
}


def check_live_layout(tp: int, pp: int, ep: int, field: Optional[str] = None) -> None:
    """The layouts live recovery covers: a replica group is DDP or FSDP2 (``dp_shard``; HSDP with torchft as the
    replicate dimension across groups). Tensor, pipeline and expert groups inside a replica are refused in one
    ConfigError line: per field (``parallel.tp``, the command line's) or under ``field`` (the Python API's
    ``parallel``, naming the degree)."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if value > 1:
            raise ConfigError(field or f"parallel.{name}", value if field is None else f"{name}={value}",
                              "1 with ft.replicas ≥ 2: a replica group may be DDP or FSDP2 (parallel.dp_shard, HSDP "
                              "across replica groups); tensor, pipeline and expert groups inside a replica are not "
                              "covered (docs/live-recovery.md)")


def check_live_sync(sync: Optional[SyncSpec], given: Any, group_world: int, dp_shard: int) -> None:
    """The sync strategies live recovery covers: every-step (DDP or FSDP2 inside a replica group, torchft across
    groups), and localsgd / diloco with one process per replica group, ``delay=0``, ``warmup=0``, ``dtype=fp32``.
    Everything else: one ConfigError line naming the field, the value and what is accepted, with the reason."""
    if sync is None:
        return
    accepted = "every-step, or localsgd / diloco (delay=0, warmup=0, dtype=fp32, bits=32) with ft.replicas ≥ 2"
    if sync.method in _LIVE_SYNC_REFUSED:
        raise ConfigError("parallel.sync", given, f"{accepted}: {sync.method} is not covered: "
                          f"{_LIVE_SYNC_REFUSED[sync.method]} (docs/live-recovery.md)")
    if dp_shard > 1 or group_world > 1:
        raise ConfigError("dist.nproc", group_world, f"1 (and parallel.dp_shard 1) with parallel.sync={given} and "
                          "ft.replicas ≥ 2: each local-SGD / DiLoCo worker is one replica group of one process "
                          "(torchft connects the groups; workers inside a group would need a second, per-step sync)")
    for key, ok, why in (("delay", sync.delay == 0, "the outer step must commit or be discarded before the next "
                          "round's quorum; an average in flight across a quorum change cannot be undone consistently"),
                         ("warmup", sync.warmup == 0, "warm-up steps would need a quorum and a commit every step; "
                          "not built"),
                         ("dtype", sync.dtype == "fp32", "the low-precision cast's error feedback is not carried "
                          "through torchft's all-reduce yet"),
                         ("bits", getattr(sync, "bits", 32) in (16, 32), "the quantized outer gradient is all-gathered; "
                          "torchft's manager only all-reduces")):
        if not ok:
            raise ConfigError("parallel.sync", given, f"{accepted}: {key}={getattr(sync, key)} is not covered: {why} "
                              "(docs/live-recovery.md)")


#: compress.method values live recovery takes: the cross-replica all-reduce sends the gradients as they are (none)
#: or cast to 16 bits (train/live_buckets.py; inside a replica group, DDP's hook casts too).
LIVE_COMPRESS = ("none", "fp16", "bf16")


def check_live_compress(compress: Any, group_world: int = 1, field: str = "compress.method") -> None:
    """compress.method under live recovery. The cross-replica all-reduce (torchft's manager: it only all-reduces)
    takes :data:`LIVE_COMPRESS` (a 16-bit cast). Another compressor applies only inside a replica group of several
    DDP workers (its hook; its state heals with the rest), the cross-replica hop staying uncompressed; with one
    worker per group it would compress nothing: one ConfigError line."""
    name = "none" if compress in (None, False) else str(getattr(compress, "text", compress))
    if name not in LIVE_COMPRESS and group_world <= 1:
        raise ConfigError(field, name, f"{', '.join(LIVE_COMPRESS)} with ft.replicas ≥ 2 and one worker per replica "
                          "group: live recovery's cross-replica all-reduce goes through torchft's manager, which only "
                          "all-reduces (top-k, PowerSGD, ... need all-gathers or per-replica state a heal would have to "
                          "reconcile); with dist.nproc > 1 they apply inside each replica group (docs/live-recovery.md)")


# ============================================================================================ the step's rules
#: The training fields :func:`check_step` involves, by their ``schema.Option.rule``. Each door's spelling is read off
#: the dataclass fields that carry those options: ``config.CLI_STEP_FIELDS`` (``train.grad_accum``, ...) and
#: ``train.options.API_STEP_FIELDS`` (``grad_accum_steps``, ...). Both doors ask the same rules; only the names in
#: the message differ.
STEP_FIELDS = ("dynamic_batch", "grad_accum", "mixed_precision", "sync")


def check_step(lay: Layout, *, dynamic_batch: Any, grad_accum: int, fp16: bool, given: dict[str, Any],
               names: dict[str, str]) -> None:
    """The rules between a layout and the step's training fields, written once and asked by the command line
    (``syncwise.config``, ``names=config.CLI_STEP_FIELDS``) and the Python API (``OptimizedTrainer``,
    ``train.options.API_STEP_FIELDS``). ``names`` maps each of :data:`STEP_FIELDS` to the field as that door
    spells it; ``given`` holds the values as the caller wrote them (echoed in the error), keyed like ``names``;
    ``fp16`` is whether the mixed precision resolves to fp16."""
    if fp16 and lay.sync is not None and lay.sync.method == "pipesgd":
        raise ConfigError(names["sync"], given["sync"], "every-step or localsgd/diloco with fp16 mixed precision (a "
                          "loss-scaled gradient applied one step late would meet another scale)")
    if fp16 and lay.pp > 1:
        raise ConfigError(names["mixed_precision"], given["mixed_precision"], "bf16 or none with pipeline parallel: "
                          "fp16 needs GradScaler's loss scaling, which cannot wrap the schedule's own backward")
    if lay.replicas_only:
        return
    degree = next(n for n in ("dp_shard", "tp", "pp", "ep") if getattr(lay, n) > 1)
    if dynamic_batch:
        raise ConfigError(names["dynamic_batch"], given["dynamic_batch"], f"off with parallel.{degree}="
                          f"{getattr(lay, degree)}: every forward there is collective, so one rank cannot probe or "
                          "redo a micro-batch alone")
    if lay.pp > 1 and grad_accum != 1:
        raise ConfigError(names["grad_accum"], given["grad_accum"], f"1 with parallel.pp={lay.pp}: the pipeline's "
                          "microbatches are its accumulation (set parallel.microbatches)")
