"""Run configuration: one dataclass per component, TOML/JSON files, ``--section.key=value`` overrides.

Every field is a ``syncwise.schema.Option`` (its default, documentation and accepted values; an option that
``OptimizedTrainer`` takes too is defined once, in ``syncwise.schema``, and both doors ask its rule), so
``syncwise train --help`` lists them and a bad value fails here — before any worker starts — with
one message naming the field, the value and what is accepted. Every number is finite and bounded:
a field's own bound is its Option's ``check``; rules between fields and rules that look outside the config
(presets, specs, the corpus, checkpoints, devices, memory) are in ``check_references``, which asks
each rule's owner (the spec parsers, the corpus loader, the batch loader, the checkpoint store) and
reports its answer under the config key, with the value as the user gave it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from .errors import ConfigError, SyncwiseError
from .layout import DISPATCH, FSDP_GATHER, FSDP_RESHARD, HIERARCHICAL, SCHEDULES, check_step
from .specs import parse_bool
from .profiling import check_pair
from .rundir import RunDir
from . import live_env, schema
from .schema import MAX_STEPS, TYPE_WORDS, one_of, option, option_of, type_of, within

if TYPE_CHECKING:
    from .devices import Placement

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


# Bounds (each documented in its field's `accepted` text).
_MAX_LOCAL_WORKERS = 4 * (os.cpu_count() or 1)
_MAX_SEQ_LEN = 2**20        # a sanity cap; the real limits are the corpus and memory (check_references)
_MAX_BATCH = 2**20
_MAX_NODES = 1024           # nodes of a torchrun job
_MAX_SECONDS = 1e9          # checkpoint interval and MTBF: ~32 years


def _seconds(v: float) -> str:
    return f"{v:,.0f} s"


def _interval_ok(v: str) -> bool:
    """What the checkpointer's own parse_interval accepts ('0' = only the final checkpoint), within bounds."""
    if len(v) > 32:
        return False
    from .checkpoint.interval import parse_interval  # the owner of the grammar (imported when used)

    try:
        kind, value = parse_interval(v)
    except (ConfigError, ValueError):
        return False
    return kind in ("dynamic", "final") or 0 < value <= (MAX_STEPS if kind == "steps" else _MAX_SECONDS)


_NNODES_RE = re.compile(r"^([1-9][0-9]{0,3})(?::([1-9][0-9]{0,3}))?$")


def _nnodes(v: str) -> Optional[tuple[int, int]]:
    m = _NNODES_RE.match(v)
    if not m:
        return None
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    return (lo, hi) if lo <= hi <= _MAX_NODES else None


def _preset_names() -> str:
    """The accepted model presets, read from the models package when --help is printed (not at import)."""
    from .models import PRESETS
    from .models.hf import supported_list

    return ("one of: " + ", ".join(PRESETS) + f", or hf:FOLDER (a local Hugging Face model folder with config.json "
            f"and optional *.safetensors weights; families: {supported_list()})")


def _run_dir_ok(v: str) -> bool:
    """'' or a directory that exists (writable) or can be created: read-only, nothing is made here."""
    if v == "":
        return True
    try:
        p = Path(v)  # as the run uses it: no '~' expansion (a shell does that)
        if "\0" in v or any(len(os.fsencode(part)) > 255 for part in p.parts):
            return False
        if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in v):
            return False  # control characters, bidi overrides (U+202E), zero-width characters: a name that lies
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
        for parent in p.absolute().parents:  # the nearest existing ancestor is where it would be made
            if parent.exists():
                return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    except (OSError, ValueError):  # a loop of links, a NUL byte
        pass
    return False


@dataclass
class ModelSection:
    """[model] which network to train."""

    preset: str = option("small", "model preset: the network's size and shape, or hf:FOLDER for a Hugging Face "
                         "model (--model hf:FOLDER)", lambda: _preset_names())
    attention: str = option("default", "attention kind: 'default' (the preset's), 'mha', or 'mla' "
                            "(multi-head latent attention)", *one_of("default", "mha", "mla"))
    moe_impl: str = option("auto", "how MoE experts compute (same result, different speed): auto (grouped matmul "
                           "where the device has a sync-free kernel, else padded bmm), grouped, padded, loop "
                           "(the per-expert reference)", *one_of("auto", "grouped", "padded", "loop"))


@dataclass
class DataSection:
    """[data] what to train on and how it is batched."""

    corpus: str = option("stdlib", "'stdlib' (this machine's Python standard library sources, no download), a "
                         "text file or folder, or a folder with nanoGPT train.bin/val.bin",
                         "'stdlib', a non-empty text file, a folder with text files, or a folder with train.bin")
    seq_len: int = option(128, "tokens per sequence (the model's context: RoPE, no fixed maximum)",
                          f"an integer from 2 to {_MAX_SEQ_LEN:,}; one step's batch_size × workers windows of "
                          "seq_len + 1 tokens must fit the corpus' train and val streams, and the step must fit "
                          "this machine's memory per worker", within(2, _MAX_SEQ_LEN))
    batch_size: int = option(8, "sequences per micro-batch per worker",
                             f"an integer from 1 to {_MAX_BATCH:,} (and fitting the corpus and memory, as "
                             "data.seq_len)", within(1, _MAX_BATCH))
    val_fraction: float = option(0.05, "share of the corpus held out for validation", "a number in (0, 0.5]",
                                 lambda v: 0 < v <= 0.5)
    tokenizer: str = option("", "a Hugging Face tokenizer (tokenizer.json or its folder): data.corpus is then JSON "
                            "lines, parquet, text or a `datasets` folder, tokenized once into cached memory-mapped "
                            "token shards (docs/data.md); '' = byte-level text",
                            "'' or a tokenizer.json file / a folder holding one")
    text_column: str = option("text", "the text field of JSON lines / the column of parquet and `datasets` sources "
                              "(with data.tokenizer)", "a non-empty field name", lambda v: bool(v.strip()))
    tokenize_workers: int = option(0, "processes that tokenize data.corpus the first time (with data.tokenizer; "
                                   "the cached shards do not depend on it); 0 = one per CPU core up to 8, or 1 for a "
                                   "source under 8 MiB", "an integer from 0 to 256", within(0, 256))
    prefetch: int = option(2, "batches prefetched by a background thread (0 = off)",
                           "an integer from 0 to 64 (batches held in memory ahead of the step)", within(0, 64))


@dataclass
class TrainSection:
    """[train] the optimisation loop (the options shared with ``OptimizedTrainer`` are ``syncwise.schema``'s)."""

    steps: int = option(200, "optimizer steps to run", f"an integer from 1 to {MAX_STEPS:,}", within(1, MAX_STEPS))
    lr: float = option(2e-3, "peak learning rate (AdamW)",
                       "a number from 1e-9 to 10 (AdamW moves every weight by about lr per step: more always "
                       "diverges, less moves nothing a float32 weight can hold)", within(1e-9, 10))
    min_lr_ratio: float = option(0.1, "final LR of the cosine decay, as a fraction of the peak", "a number in [0, 1]",
                                 within(0, 1))
    warmup_steps: int = option(20, "linear LR warm-up steps", f"an integer from 0 to {MAX_STEPS:,}",
                               within(0, MAX_STEPS))
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)",
                                 "a number in [0, 10] with lr × weight_decay < 1 (AdamW scales the weights by "
                                 "1 − lr × weight_decay every step)", within(0, 10))
    grad_accum: int = schema.GRAD_ACCUM.field()
    clip_grad: float = schema.CLIP_GRAD.field()
    mixed_precision: str = schema.MIXED_PRECISION.field()
    compile: bool = schema.COMPILE.field()
    dynamic_batch: bool = option(False, "find the largest micro-batch (≤ data.batch_size) that fits in memory and "
                                 "accumulate micro-batches up to data.batch_size (the loss curve is unchanged); "
                                 "back off on out-of-memory (docs/dynamic-batch.md)", "true or false",
                                 rule="dynamic_batch")
    memory_threshold: float = schema.MEMORY_THRESHOLD.field()
    activation_checkpointing: bool = schema.ACTIVATION_CHECKPOINTING.field()
    seed: int = option(1337, "random seed (model init and data order)",
                       "an integer from 0 to 4,294,967,295 (2³² − 1: numpy's seed range)", within(0, 2**32 - 1))
    val_interval: int = schema.VAL_INTERVAL.field()
    val_batches: int = option(4, "batches per validation", "an integer from 1 to 10,000", within(1, 10_000))
    log_interval: int = schema.LOG_INTERVAL.field()
    deterministic: bool = option(False, "deterministic algorithms (bit-exact resume)", "true or false")


@dataclass
class DistSection:
    """[dist] workers and the process group."""

    nproc: int = option(2, "local worker processes (started by torchrun's elastic agent); 2 on any machine, so the "
                        "default job is data-parallel with the same global batch everywhere: with fewer GPUs than "
                        "workers they share the GPUs over gloo (--nproc = the GPU count for NCCL)",
                        f"an integer from 1 to {_MAX_LOCAL_WORKERS} (4 × this machine's cores); with "
                        "dist.backend=nccl at most the visible GPUs", within(1, _MAX_LOCAL_WORKERS))
    device: str = option("auto", "where workers compute: auto (CUDA when a GPU is visible, else the CPU), cpu, cuda; "
                         "local worker r uses GPU r mod (visible GPUs)",
                         "one of: auto, cpu, cuda (cuda only where a GPU is visible)",
                         lambda v: v in ("auto", "cpu", "cuda"))
    backend: str = option("auto", "process-group backend: auto (nccl when every local worker has a GPU of its own, "
                          "else gloo: ranks sharing a GPU, or the CPU), gloo, nccl",
                          "one of: auto, gloo, nccl (nccl only on CUDA with one GPU per local worker)",
                          lambda v: v in ("auto", "gloo", "nccl"))
    bucket_cap_mb: float = schema.BUCKET_CAP.field()
    hierarchical: str = option("auto", "gradient sync across nodes: on = reduce inside each node at full precision, "
                               "run compress.method only across nodes (each local rank owns part of every bucket), "
                               "gather inside the node; auto = on when the job has > 1 node and > 1 worker per node "
                               "and a syncwise compressor that all-gathers (fp8, int8, sign, topk, demo) runs every "
                               "step on DDP replicas; off = the flat sync (docs/compression.md)", *one_of(*HIERARCHICAL))
    timeout_s: float = schema.COLLECTIVE_TIMEOUT.field()
    lab: bool = option(False, "run across the network lab's nodes (`syncwise cluster up` first)", "true or false")
    max_restarts: int = option(0, "worker-group restarts torchrun's agent may do after a failure (each resumes "
                               "from the newest valid checkpoint)", "an integer from 0 to 1,000", within(0, 1000))
    nnodes: str = option("1", "nodes of the elastic job, 'N' or 'MIN:MAX' as torchrun's --nnodes",
                         f"'N' or 'MIN:MAX' with 1 ≤ MIN ≤ MAX ≤ {_MAX_NODES}; MIN = 1 on a local run (no other "
                         "node can join it) and '1' with --lab (the lab sets its nodes)",
                         lambda v: _nnodes(v) is not None)


@dataclass
class ParallelSection:
    """[parallel] how the replicas are laid out and kept in step (``syncwise.parallel``)."""

    sync: str = option("every-step", "how often replicas synchronise: every-step (gradient all-reduce), or local SGD "
                       "/ DiLoCo every H steps (auto: the one predicted to reach fp32 DDP's loss soonest, chosen at start-up): localsgd:period=16, diloco:period=16,delay=4,dtype=bf16, "
                       "torch-localsgd:period=16 (PyTorch's averager), pipesgd[:dtype=fp16] (all-reduce overlapped "
                       "with the next step), sparseloco:period=16 (top-k + 2-bit pseudo-gradients, error feedback), "
                       "streaming:period=16,fragments=4 (Streaming DiLoCo); see docs/compression.md. Formerly "
                       "compress.sync (still read, with a note)",
                       "a sync spec (see docs/compression.md)", rule="sync")
    dp_replicate: int = option(0, "data-parallel replicas: DDP (with syncwise's compressed gradient sync), or HSDP's "
                               "replica groups when dp_shard > 1; 0 = the ranks dp_shard × tp leave",
                               "an integer from 0 to 65,536 (dp_replicate × dp_shard × tp = the world size)",
                               within(0, 65536))
    dp_shard: int = option(1, "fully-sharded data parallel (FSDP2): parameters, gradients and AdamW state split over "
                           "this many ranks; all-gathered per block in forward and backward",
                           "an integer from 1 to 65,536", within(1, 65536))
    tp: int = option(1, "tensor (+ sequence) parallel: attention heads, MLP widths, embedding and head split over "
                     "this many neighbouring ranks (the innermost dimension: keep it within a node)",
                     "an integer from 1 to 65,536 dividing the model's heads and widths", within(1, 65536))
    pp: int = option(1, "pipeline parallel: the model's layers cut into this many stages (balanced by FLOPs; the "
                     "embedding on the first, norm + head + loss on the last), the outermost dimension",
                     "an integer from 1 to 65,536, at most the model's layers", within(1, 65536))
    pp_schedule: str = option("1f1b", "the pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, "
                              "interleaved-1f1b, looped-bfs (need stages_per_rank ≥ 2), interleaved-zb, zbv, dualpipev "
                              "(zero-bubble / DualPipe-style; zbv and dualpipev: stages_per_rank = 2); all run on "
                              "gloo with torch 2.13 (docs/parallelism.md)",
                              *one_of(*SCHEDULES))
    microbatches: int = option(0, "pipeline microbatches per step (each rank's batch is split into them; they "
                               "replace train.grad_accum under pp); 0 = 2 × pp × stages_per_rank",
                               "an integer from 0 to 65,536 dividing the per-rank batch (1f1b: ≥ pp)", within(0, 65536))
    stages_per_rank: int = option(1, "pipeline stages each rank holds (interleaving: fewer bubbles, more messages)",
                                  "an integer from 1 to 64 (the schedule's rule: docs/parallelism.md)", within(1, 64))
    ep: int = option(1, "expert parallel: each MoE layer's routed experts split over this many data-parallel ranks "
                     "(borrowed from dp_replicate, not extra ranks); tokens travel by all-to-all",
                     "an integer from 1 to 65,536 dividing the routed experts and dp_replicate", within(1, 65536))
    ep_dispatch: str = option("fp32", "precision of expert parallel's token dispatch: fp8 (e4m3, 1x128 scales, "
                              "DeepSeek-V3's choice, bf16 combine), bf16, fp32 (exact)",
                              *one_of(*DISPATCH))
    fsdp_gather: str = option("fp32", "precision of FSDP2's parameter all-gathers (dp_shard > 1): fp32 = FSDP2's own "
                              "(in the parameter dtype); bf16 = a cast; fp8 / int8 = blocks of 128 with an fp32 scale "
                              "each (ZeRO++'s qwZ), dequantized into FSDP2's buffer; master weights stay fp32 and "
                              "sharded (docs/parallelism.md)", *one_of(*FSDP_GATHER))
    fsdp_reshard: str = option("all", "what each FSDP2 unit keeps after its forward (dp_shard > 1): all = resharded "
                               "over every shard rank (ZeRO-3); node = over its node's ranks, so backward's "
                               "all-gather never crosses nodes (ZeRO++'s hpZ); none = unsharded until its backward",
                               *one_of(*FSDP_RESHARD))


@dataclass
class CompressSection:
    """[compress] gradient communication."""

    method: str = option("none", "gradient compression NAME[:key=value,...], e.g. fp16, powersgd:rank=4, "
                         "topk:ratio=0.01 (list below); torch-fp16, torch-powersgd:rank=4 ... use PyTorch's own hooks; auto = the one "
                         "predicted to reach fp32 DDP's loss soonest on this cluster (docs/plan.md), chosen at start-up",
                         "a compressor spec (list below)")
    min_numel: int = schema.MIN_NUMEL_OPTION.field()
    auto_cluster: str = option("", "with compress.method or parallel.sync = auto: the cluster TOML the strategies are "
                               "priced on (`syncwise plan --calibrate` writes one); '' = this job's: the catalog's "
                               "CPU worker over loopback, or the running network lab's link rate with --lab",
                               "'' or a cluster TOML file (examples/clusters/*.toml)")
    auto_probe: int = option(8, "with compress.method or parallel.sync = auto on the built-in (not calibrated) "
                             "cluster: before the run, train fp32 DDP and the catalog's top 3 for about this many "
                             "steps each (whole sync periods, after their warm-up) on this job's workers and rank "
                             "by the measured step times (syncwise train only; 0 = rank by the catalog's figures)",
                             "an integer from 0 to 1,000", within(0, 1000))


@dataclass
class CheckpointSection:
    """[ckpt] saving and resuming."""

    interval: str = option("dynamic", "save every N steps, every '300s' / '5m' / '2h', or 'dynamic' (Young/Daly "
                           "from the measured save cost and mtbf_s); 0 = only at the end",
                           f"0, N steps, a duration like '300s', '5m' or '2h' (at most {MAX_STEPS:,} steps or "
                           f"{_seconds(_MAX_SECONDS)}), or 'dynamic'", _interval_ok)
    keep: int = option(3, "checkpoints kept (the newest valid one is never deleted)", "an integer from 1 to 1,000",
                       within(1, 1000))
    async_save: bool = option(True, "write checkpoints in the background while training goes on", "true or false")
    compression: bool = option(False, "compress checkpoint files", "true or false")
    mtbf_s: float = option(14400.0, "mean time between failures for the 'dynamic' interval",
                           f"a number of seconds from 1 to {_seconds(_MAX_SECONDS)}", within(1, _MAX_SECONDS))
    preempt_grace_s: float = schema.PREEMPT_GRACE.field()


@dataclass
class MetricsSection:
    """[metrics] live monitoring (docs/monitoring.md); metrics.jsonl is always written."""

    prometheus_port: int = option(0, "serve the per-step metrics at http://HOST:PORT/metrics (Prometheus), one "
                                  "endpoint per node, from its local rank 0; 0 = off",
                                  "0 (off) or a TCP port from 1024 to 65535", lambda v: v == 0 or 1024 <= v <= 65535)
    prometheus_bind: str = option("127.0.0.1", "the address the Prometheus endpoint listens on: loopback (a scraper "
                                  "on the same machine); a node's own address to be scraped from elsewhere "
                                  "(docs/security.md: it has no authentication; never 0.0.0.0 on a shared network)",
                                  "an IPv4/IPv6 address of this machine, or localhost", lambda v: _address_ok(v))
    wandb: bool = option(False, "log the per-step metrics and the resolved config to Weights & Biases from rank 0 "
                         "(WANDB_MODE=offline keeps the run on disk under RUN_DIR/wandb)", "true or false")
    wandb_project: str = option("syncwise", "the W&B project", "a non-empty string", lambda v: bool(v.strip()))


@dataclass
class ProfileSection:
    """[profile] torch profiler traces of chosen steps on every rank, into RUN_DIR/traces (docs/doctor.md); off by
    default."""

    steps: str = schema.PROFILE_STEPS.field()
    every: int = schema.PROFILE_EVERY.field()


def _address_ok(v: str) -> bool:
    """An IP address literal (or localhost): what a listening socket can bind to."""
    import ipaddress

    if v == "localhost":
        return True
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return False


def _host_port_ok(v: str) -> bool:
    """'' or HOST:PORT (an optional http:// in front), the port 1..65535."""
    if v == "":
        return True
    rest = v.split("://", 1)[1] if v.startswith(("http://", "https://")) else v
    host, sep, port = rest.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535 and "/" not in rest)


@dataclass
class FaultToleranceSection:
    """[ft] live recovery: a lost data-parallel replica is replaced while the others train on (torchft;
    docs/live-recovery.md)."""

    replicas: int = option(0, "replica groups, each a whole copy of the model (its own torchrun job of dist.nproc DDP "
                           "workers); when one is lost the others train on and a restarted replica heals from a live "
                           "peer (no checkpoint read); 0 = off", "0 (off) or an integer from 2 to 1,024",
                           lambda v: v == 0 or 2 <= v <= 1024)
    min_replicas: int = option(1, "replica groups that must take part for a step to commit (fewer: the step waits "
                               "and is redone)", "an integer from 1 to ft.replicas", within(1, 1024))
    lighthouse: str = option("", "the torchft lighthouse (quorum server) as HOST:PORT; '' = syncwise train starts "
                             "one next to the replica groups", "'' or HOST:PORT", _host_port_ok)
    quorum_timeout_s: float = option(60.0, "how long a replica waits for the others to form a step's quorum",
                                     "a number of seconds from 1 to 86,400", within(1, 86_400))
    heartbeat_timeout_s: float = option(1.0, "how late a replica group's heartbeat (torchft's manager beats every 0.1 "
                                        "s) may be before the lighthouse drops it from the next quorum: the survivors "
                                        "of a killed replica wait this long (at most ft.timeout_s)",
                                        "a number of seconds from 0.2 to 600", within(0.2, 600))
    timeout_s: float = option(30.0, "the cross-replica all-reduce's and the healing transfer's timeout: a replica "
                              "stopped (not dead) this long is dropped from the step",
                              "a number of seconds from 1 to 86,400", within(1, 86_400))
    replica_restarts: int = option(3, "how often each replica group's torchrun restarts its workers after a failure "
                                   "(each restart rejoins and heals from a live peer)", "an integer from 0 to 1,000",
                                   within(0, 1000))


@dataclass
class RunConfig:
    """Everything one `syncwise train` run needs."""

    run_dir: str = option("", "directory for metrics.jsonl, summary.json, checkpoints (default: a new runs/DATE-TIME)",
                          "'' (a new runs/DATE-TIME) or a writable directory, existing or creatable (not a file), "
                          "whose name has no control, bidi-override or zero-width characters",
                          _run_dir_ok)
    resume: str = option("none", "'auto' (newest valid checkpoint in run_dir, if any), a checkpoint path, or 'none'",
                         "'auto', 'none', or a published checkpoint directory (RUN_DIR/checkpoints/step_N)")
    inject_fault: list = option([], "fault injections for tests/demos, e.g. kill:rank=1,step=30, nan:step=5, "
                                "slow:rank=1,factor=2, slowdata:ms=200 or skew:experts=2 (docs/doctor.md)",
                                "a list of 'kill:rank=R,step=S', 'nan:step=S[,rank=R]', 'slow:rank=R,factor=F[,step=S]', "
                                "'slowdata:ms=M[,rank=R][,step=S]' or 'skew:experts=K' with 1 ≤ S ≤ train.steps and "
                                "R < the job's workers", lambda v: all(isinstance(s, str) for s in v))
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    dist: DistSection = field(default_factory=DistSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    compress: CompressSection = field(default_factory=CompressSection)
    ckpt: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    ft: FaultToleranceSection = field(default_factory=FaultToleranceSection)
    profile: ProfileSection = field(default_factory=ProfileSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved configuration as JSON (workers on other nodes read it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def specs(self) -> "RunSpecs":
        """The run's spec strings parsed by their owners' parsers (``syncwise.specs`` syntax), typed: what
        workers hand to the trainer. Each call builds fresh objects (a compressor carries per-run state); a
        bad spec raises its owner's ConfigError under this config's key, with the value as given."""
        # The torch-free parsers first (compress.method and parallel.sync in syncwise.layout, the fault specs), so
        # that a misspelt spec is refused in well under a second; then the compressor's instance, which needs torch.
        lay = run_layout(self)
        from .train.faults import Fault

        faults = []
        for spec in self.inject_fault:
            with _as_field("inject_fault", spec):
                faults.append(Fault.parse(spec))
        from .parallel.data_parallel import compressor_of

        with _as_field("compress.method", self.compress.method):  # the instance: the compressor's own bounds
            compress = compressor_of(lay.compress)
        return RunSpecs(compress, lay.sync, faults, lay)


@dataclass
class RunSpecs:
    """A run's parsed specs: ``compress`` a Compressor or a TorchHookSpec built from the layout's parsed
    ``compress.method``, ``sync`` a SyncSpec or None for every-step (``parallel.sync``), ``faults`` the Faults of
    ``inject_fault``, ``layout`` the ``[parallel]`` layout holding both specs (``syncwise.layout.Layout``,
    unresolved)."""

    compress: Any
    sync: Any
    faults: list
    layout: Any = None


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


#: The training fields ``layout.check_step`` involves, as config keys ({rule: 'section.field'}): read off the
#: sections' fields whose Option carries that rule (``schema.rule_fields``; the Python API's: ``train.options``).
CLI_STEP_FIELDS = schema.rule_fields(_sections(), qualified=True)


def _coerce(path: str, value: Any, typ: type, from_text: bool, accepted: str) -> Any:
    """Convert ``value`` to ``typ``; text from the command line is parsed, TOML values must already fit (refused
    with ``accepted``, the field's own text)."""
    if from_text and isinstance(value, str):
        text = value.strip()
        try:
            if typ is bool:
                flag = parse_bool(text)  # the one yes/no vocabulary (syncwise.specs)
                if flag is None:
                    raise ValueError
                return flag
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
            if typ is list:
                return [s for s in text.split(";") if s] if text else []
            return text
        except ValueError:
            raise ConfigError(path, value, accepted) from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            raise ConfigError(path, value, "a finite number") from None
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(path, value, accepted)
    return value


def _set(cfg: RunConfig, key: str, value: Any, from_text: bool) -> None:
    parts = key.split(".")
    sections = _sections()
    if len(parts) == 1:
        target, name = cfg, parts[0]
    elif len(parts) == 2 and parts[0] in sections:
        target, name = getattr(cfg, parts[0]), parts[1]
    else:
        if parts[0] not in sections:
            raise ConfigError(key, value, _unknown_key(parts[0], cfg))
        raise ConfigError(key, value, f"a key of the form section.name (one dot), e.g. {parts[0]}.{parts[1]}")
    fields = {f.name: f for f in dataclasses.fields(target) if f.name not in sections}
    if name not in fields:
        if len(parts) == 1 and name in sections:
            raise ConfigError(key, value, f"a [{name}] table of its keys, not a single value: "
                              + ", ".join(f.name for f in dataclasses.fields(sections[name])))
        if len(parts) == 1:
            raise ConfigError(key, value, _unknown_key(name, cfg))
        hint = difflib.get_close_matches(name, fields, n=1)
        raise ConfigError(key, value, f"a key of [{parts[0]}]: " + ", ".join(fields)
                          + (f" (did you mean {parts[0]}.{hint[0]}?)" if hint else ""))
    opt = option_of(fields[name])
    typ = type_of(type(target), name)[0]
    value = _coerce(key, value, typ, from_text, opt.accepted_text() or TYPE_WORDS[typ])
    if typ is list and from_text and name == "inject_fault":  # repeatable flag: append
        value = getattr(target, name) + value
    setattr(target, name, opt.validate(key, value))  # its one rule (schema.Option), as the Python API asks it


def _unknown_key(name: str, cfg: RunConfig) -> str:
    """What is accepted where ``name`` is neither a section nor a top-level key: both lists, and a near miss."""
    sections = _sections()
    top = [f.name for f in dataclasses.fields(cfg) if f.name not in sections]
    flag = difflib.get_close_matches(name.replace("-", "_"), list(FLAG_KEYS), n=1)  # --stpes: --steps
    hint = difflib.get_close_matches(name, [*sections, *top], n=1)
    guess = (f" (did you mean --{flag[0].replace('_', '-')}?)" if flag else
             f" (did you mean {'[' + hint[0] + ']' if hint[0] in sections else hint[0]}?)" if hint else "")
    return ("a section " + ", ".join(f"[{s}]" for s in sections) + " (a [section] table in a file, "
            "--section.key=value on the command line) or a top-level key: " + ", ".join(top) + guess)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON, as written by ``RunConfig.save``) file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", str(path), "an existing .toml or .json file")
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        values = json.loads(p.read_text()) if kind == "JSON" else tomllib.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad syntax, bad UTF-8, a 5,000-digit number
        raise ConfigError("--config", str(path), f"a readable, valid {kind} file ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError("--config", str(path), f"a {kind} file of [section] tables (an object at the top)")
    return values


# Keys that moved to the section that owns them: old key -> new key. The old key is still read (TOML files, a
# run's saved config.json under --resume), with one note per process; the same file or the same flags may not
# set both to different values.
MOVED_KEYS = {"compress.sync": "parallel.sync"}
_noted: set[str] = set()


def upgrade_moved_keys(values: dict[str, Any] | None, source: str = "the configuration") -> dict[str, Any] | None:
    """``values`` (nested [section] tables, or flat ``section.key`` overrides) with every moved key under its new
    name; a copy, the input is left alone."""
    if not values:
        return values
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    for old, new in MOVED_KEYS.items():
        (old_section, old_name), (new_section, new_name) = old.split("."), new.split(".")
        if old in out:  # flat overrides: --compress.sync=...
            value = out.pop(old)
            table, key = out, new
        elif isinstance(out.get(old_section), dict) and old_name in out[old_section]:  # a [compress] table
            value = out[old_section].pop(old_name)
            table, key = out.setdefault(new_section, {}), new_name
            if not isinstance(table, dict):
                raise ConfigError(new_section, table, f"a [{new_section}] table of its keys")
        else:
            continue
        if table.get(key, value) != value:
            raise ConfigError(old, value, f"only {new} ({old} is its old name; {source} sets both, {new}="
                              f"{table[key]!r})")
        table[key] = value
        if old not in _noted:
            _noted.add(old)
            print(f"syncwise: note: {old} is now {new} (in {source}); read as {new} = {value!r}. Write {new} "
                  f"(--{new}=... or [{new_section}] {new_name} = ...) from now on", file=sys.stderr, flush=True)
    return out


def build_config(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 *, here: bool = True, probe: Optional[Callable] = None, announce: bool = True) -> RunConfig:
    """Defaults ← file values ← command-line overrides (text), each validated as it is applied (a moved key
    under its old name, see ``MOVED_KEYS``, is read as its new one). ``here=False``: the job runs on another
    machine (``syncwise launch``), so what only that machine can answer is left to it (see check_references).
    ``probe``: auto's start-up probe (``resolve_auto``), given by the command that is about to start the job;
    ``announce=False``: auto's line is not printed (a configuration built only to read its run directory)."""
    file_values = upgrade_moved_keys(file_values, "the configuration file")
    overrides = upgrade_moved_keys(overrides, "the command line")
    cfg = RunConfig()
    sections = _sections()
    for key, value in (file_values or {}).items():
        if key in sections and isinstance(value, dict):
            for sub, v in value.items():
                _set(cfg, f"{key}.{sub}", v, from_text=False)
        else:
            _set(cfg, key, value, from_text=False)
    for key, value in (overrides or {}).items():
        _set(cfg, key, value, from_text=True)
    resolve_auto(cfg, probe, announce)
    check_references(cfg, here)
    return cfg


_auto_said: set = set()


def resolve_auto(cfg: RunConfig, probe: Optional[Callable] = None, announce: bool = True) -> str:
    """``compress.method = auto`` / ``parallel.sync = auto``: replace them, before anything else is checked and any
    worker starts, by the strategy ``syncwise.plan.strategy`` predicts reaches fp32 DDP's loss soonest on this job's
    cluster, and say so in one line on stderr (returned; '' when neither is auto). The cluster: ``compress.
    auto_cluster`` (a calibrated TOML), else this job's (``plan.strategy.job_cloud``). ``probe(cfg, ranked)``
    (``syncwise train``: ``commands.train.probe``): on the built-in cluster with ``compress.auto_probe`` steps, the
    measured step times (``plan.strategy.Measured`` by spec) of fp32 DDP and the catalog's top candidates and the
    seconds they took, which then rank them instead of the catalog's figures (``plan.strategy.probed``); None when
    it does not run."""
    from .layout import names_auto

    if not (names_auto(cfg.compress.method) or names_auto(cfg.parallel.sync)):
        return ""   # (nothing parsed here: the specs are parsed once, by check_references)
    chosen, line, _ = auto_ranking(cfg, probe)
    cfg.compress.method = chosen.compress.text
    cfg.parallel.sync = str(chosen.sync) if chosen.sync is not None else "every-step"
    if announce and line not in _auto_said:
        _auto_said.add(line)
        print(f"syncwise: {line}", file=sys.stderr, flush=True)
    return line


#: candidates auto's start-up probe runs beside fp32 DDP (the catalog's best first)
PROBE_TOP = 3


def probe_applies(cfg: RunConfig) -> bool:
    """Whether auto's start-up probe runs for this job: steps asked for, the built-in cluster (a calibrated one was
    measured already), more than one worker, no live recovery (its replica groups are jobs of their own)."""
    return bool(cfg.compress.auto_probe and not cfg.compress.auto_cluster and not cfg.ft.replicas
                and _workers(cfg)[2] > 1)


def _probed(cfg: RunConfig, job: "_AutoJob", ranked: list, probe: Callable) -> Optional[tuple[Any, str, list]]:
    """Run ``probe`` on fp32 DDP and the catalog's top :data:`PROBE_TOP` candidates; (the chosen layout, the line,
    the candidates re-ranked by their measured steps), or None when there is nothing to compare or the probe did
    not run."""
    from .plan.strategy import PROBE_ERROR, Basis, choose, explain, probed

    top = [r for r in ranked if not r.why_not and r.spec != "none"][:PROBE_TOP]
    none = next((r for r in ranked if r.spec == "none"), None)
    if none is None or not top:   # nothing to compare: the catalog's line stands
        return None
    got = probe(cfg, [none, *top])
    if got is None:   # the probe did not run (the run directory said why not): the catalog's line stands
        return None
    measured, seconds = got
    ranked = probed(ranked, measured)
    best = choose(ranked)
    steps = "/".join(str(n) for n in sorted({m.steps for m in measured.values()}))
    basis = Basis(calibrated=False, probe=f"step times probed on this job's workers ({len(measured)} strategies, "
                  f"{steps} steps each after their warm-up, {seconds:.0f} s; each ratio "
                  f"±{100 * PROBE_ERROR:.0f} % or its spread)")
    return (dataclasses.replace(job.layout, compress=best.compress, sync=best.sync),
            explain(ranked, job.cloud, job.table, basis, cfg.train.steps, job.replicas), ranked)


@dataclass(frozen=True)
class _AutoJob:
    """What auto prices a job on: its layout, cluster and the cluster's basis, model, global batch, data-parallel
    replicas and the convergence model."""
    layout: Any
    cloud: Any
    basis: Any
    model: Any
    global_batch: int
    replicas: int
    table: Any = None


def _auto_job(cfg: RunConfig) -> _AutoJob:
    lay = run_layout(cfg)   # auto is a parsed value of the layout owner; a conflicting option is refused there
    lay.auto_choices()
    from .plan import load_cluster, load_model
    from .plan.strategy import Basis, basis_of, host_cores, job_cloud, load_convergence

    local, _, world = _workers(cfg)
    if cfg.compress.auto_cluster:
        with _as_field("compress.auto_cluster", cfg.compress.auto_cluster):
            cloud = load_cluster(cfg.compress.auto_cluster)
        if cloud.world_size != world:
            raise ConfigError("compress.auto_cluster", cfg.compress.auto_cluster, f"a cluster of this job's {world} "
                              f"worker(s) (it has {cloud.nodes} × {cloud.gpus_per_node})")
        basis = basis_of(cloud)
    else:
        if cfg.dist.device == "cuda" or (cfg.dist.device == "auto" and _visible_gpus()):
            raise ConfigError("compress.auto_cluster", "", "a calibrated cluster TOML (`syncwise plan --calibrate "
                              "--out cluster.toml`) for auto on GPU workers: the built-in cluster is the CPU lab's")
        inter, burst = None, 0.0
        if cfg.dist.lab:
            from .lab.cluster import status

            state = status()
            if state is None:
                raise ConfigError("dist.lab", True, "a running lab (`syncwise cluster up`) for auto, which prices "
                                  "the strategies on its link rate")
            inter, burst = state.inter_node_bps, state.burst
        # the lab's nodes all compute on this machine's cores; a plain job's workers on this host's
        basis = Basis(calibrated=False, workers_per_host=world if cfg.dist.lab else local, cores=host_cores())
        cloud = job_cloud(world // local, local, inter, burst_bytes=burst, basis=basis)
    with _as_field("model.preset", cfg.model.preset):
        model = load_model(cfg.model.preset, cfg.data.seq_len)
    inner = lay.dp_shard * lay.tp * lay.pp
    dp = (lay.dp_replicate or max(1, world // inner)) * lay.dp_shard
    return _AutoJob(lay, cloud, basis, model, cfg.data.batch_size * cfg.train.grad_accum * dp, dp,
                    load_convergence())


def auto_ranking(cfg: RunConfig, probe: Optional[Callable] = None) -> tuple[Any, str, list]:
    """What ``auto`` resolves to for this job, without changing ``cfg``: (the layout with the chosen compressor and
    sync strategy, the start-up line, the ranked candidates: ``syncwise.plan.strategy.Ranked``). The one pricing of
    a job's auto (``resolve_auto``; ``benchmarks/auto_choice.py`` asks it too); with ``probe`` where it applies
    (:func:`probe_applies`), the catalog's top candidates re-ranked by their probed step times."""
    from .plan.strategy import resolve_auto as choose

    job = _auto_job(cfg)
    lay, line, ranked = choose(job.layout, job.cloud, job.model, job.global_batch, cfg.data.seq_len, job.table,
                               micro_batch=cfg.data.batch_size, microbatches=cfg.train.grad_accum, basis=job.basis,
                               horizon=cfg.train.steps, replicas=job.replicas)
    if probe is not None and probe_applies(cfg):
        return _probed(cfg, job, ranked, probe) or (lay, line, ranked)
    return lay, line, ranked


def _visible_gpus() -> bool:
    from .devices import visible_gpus

    return visible_gpus() > 0


@contextlib.contextmanager
def _as_field(key: str, text: Any):
    """Report an owner's ConfigError (a spec parser's, the corpus loader's ...) under the config key ``key``,
    with the value as the user gave it (``text``), keeping the owner's description of what is accepted."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(key, text, e.accepted) from None


def _get(cfg: RunConfig, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _blame(cfg: RunConfig, *keys: str) -> str:
    """Of fields that break a rule together, the first one set away from its default (else the first)."""
    default = RunConfig()
    return next((k for k in keys if _get(cfg, k) != _get(default, k)), keys[0])


def _workers(cfg: RunConfig) -> tuple[int, int, int]:
    """(workers on this machine, fewest and most workers in the job) of the job ``cfg`` describes."""
    try:  # a worker of a running torchrun job: it knows the job
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
        if world >= 1 and 1 <= local <= world:
            return local, world, world
    except (KeyError, ValueError):
        pass
    if cfg.dist.lab and cfg.ft.replicas >= 2:  # live recovery: a replica group (one per node) is its own job
        return cfg.dist.nproc, cfg.dist.nproc, cfg.dist.nproc
    if cfg.dist.lab:  # the lab's node count is the running lab's (any count up to MAX_NODES when none runs yet)
        from .lab.cluster import MAX_NODES, status

        try:
            state = status()
        except (OSError, SyncwiseError):
            state = None
        if state is not None:
            world = cfg.dist.nproc * len(state.nodes)
            return cfg.dist.nproc, world, world
        return cfg.dist.nproc, cfg.dist.nproc, cfg.dist.nproc * MAX_NODES
    return cfg.dist.nproc, cfg.dist.nproc, cfg.dist.nproc


def placement(cfg: RunConfig) -> "Placement":
    """Where the job's workers on this machine compute and over which backend (``syncwise.devices``' rule, on this
    machine's GPUs), or the ConfigError that stops the run before any worker starts."""
    from . import devices

    local = _workers(cfg)[0]
    try:
        return devices.plan_here(cfg.dist.device, cfg.dist.backend, local, lab=cfg.dist.lab)
    except ConfigError as e:
        if e.field != "dist.nproc":
            raise
        key = _blame(cfg, "dist.nproc", "dist.backend")  # nccl with more workers than GPUs: either one
        raise ConfigError(key, _get(cfg, key), e.accepted) from None


def _memory_per_worker(cfg: RunConfig, local_workers: int, where: "Placement") -> tuple[int, str]:
    """Bytes one worker can have: its GPU's memory (shared by the workers on it), or this machine's memory (or
    cgroup limit) shared."""
    if where.device_type == "cuda":
        from .devices import gpu_memory_bytes

        share = where.ranks_per_gpu
        return gpu_memory_bytes(0) // share, ("GPU memory" if share == 1 else
                                              f"GPU memory (cuda:0 shared by {share} workers)")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total // local_workers, f"memory ({total / 2**30:.1f} GiB shared by {local_workers} worker(s))"


def check_references(cfg: RunConfig, here: bool = True) -> None:
    """Rules between fields and rules that look outside the config: presets, specs (by their own parsers),
    faults, checkpoints, devices, nodes, the corpus (does a step's batch fit it) and memory (does it fit).
    Nothing is written and no worker is started; the corpus loader reads at most its byte cap. ``here=False``
    (a job for a cluster) skips what depends on this machine: the resume path, devices, the corpus, memory."""
    from .models import PRESETS  # imported here: config must stay importable without torch work at import

    from .models.hf import is_hf, read_hf_model

    if is_hf(cfg.model.preset):
        read_hf_model(cfg.model.preset)  # a folder with a config.json of a supported family
        _check_hf_run(cfg)
    elif cfg.model.preset not in PRESETS:
        raise ConfigError("model.preset", cfg.model.preset, _preset_names())
    specs = cfg.specs()  # each spec by its owner's parser
    check_pair(cfg.profile.steps, cfg.profile.every, ("profile.steps", "profile.every"))
    if cfg.train.warmup_steps > cfg.train.steps and cfg.train.warmup_steps != TrainSection().warmup_steps:
        # (the default warm-up, 20, is kept for short runs, as it always was: only a warm-up someone set is held
        # to the run's length)
        raise ConfigError("train.warmup_steps", cfg.train.warmup_steps, f"an integer ≤ train.steps (warmup_steps="
                          f"{cfg.train.warmup_steps:,}, steps={cfg.train.steps:,}: the learning rate would never "
                          "reach its peak)")
    if cfg.train.lr * cfg.train.weight_decay >= 1:
        key = _blame(cfg, "train.weight_decay", "train.lr")
        raise ConfigError(key, _get(cfg, key), f"lr × weight_decay < 1 (AdamW scales the weights by 1 − lr × "
                          f"weight_decay every step; lr={cfg.train.lr:g}, weight_decay={cfg.train.weight_decay:g})")
    local, fewest, most = _workers(cfg)
    _check_layout(cfg, specs.layout, fewest, most)
    if cfg.ft.replicas:
        _check_live_recovery(cfg, specs, most)
        most *= cfg.ft.replicas  # fault ranks count over every replica group's workers
    for spec, fault in zip(cfg.inject_fault, specs.faults):
        if fault.step > cfg.train.steps:
            raise ConfigError("inject_fault", spec, f"a step S ≤ train.steps ({cfg.train.steps}): a fault at a "
                              "later step would never fire")
        if fault.rank is not None and fault.rank >= most:
            raise ConfigError("inject_fault", spec, f"a rank R below the job's {most} worker(s) (dist.nproc × "
                              "nodes): no worker has that rank")
        if fault.kind == "healkill" and not cfg.ft.replicas:
            raise ConfigError("inject_fault", spec, "healkill only with ft.replicas ≥ 2 (it fires during live "
                              "recovery's healing transfer)")
        if fault.kind == "kill" and cfg.dist.max_restarts == 0 and not (cfg.ft.replicas and cfg.ft.replica_restarts):
            raise ConfigError("inject_fault", spec, "a kill only with --max-restarts ≥ 1 (else the run just dies)")
    if here and cfg.resume not in ("none", "auto"):
        from .checkpoint.storage import verify_checkpoint  # the checkpoint store's own rule (no checksums here)

        try:
            problem = verify_checkpoint(Path(cfg.resume), checksums=False)  # the path as the loader takes it
        except (OSError, ValueError) as e:
            problem = str(e)
        if problem:
            path = Path(cfg.resume)
            run = path.parent if path.name == "checkpoints" and RunDir(path.parent).config.exists() else path
            if RunDir(run).holds_a_run():
                problem = (f"{cfg.resume} is a run directory, not one of its checkpoints; to continue that run: "
                           f"--run-dir {run} --resume auto")  # (not "manifest.json is missing")
            raise ConfigError("resume", cfg.resume, "'auto', 'none', or a published checkpoint directory "
                              f"(RUN_DIR/checkpoints/step_N with its manifest.json): {problem}")
    min_nodes = _nnodes(cfg.dist.nnodes)[0]
    if cfg.dist.lab and cfg.dist.nnodes != "1":
        raise ConfigError("dist.nnodes", cfg.dist.nnodes, "'1' with --lab: the lab's nodes are the ones "
                          "`syncwise cluster up --nodes N` made")
    if not cfg.dist.lab and min_nodes > 1 and "WORLD_SIZE" not in os.environ:
        raise ConfigError("dist.nnodes", cfg.dist.nnodes, "'1' or '1:MAX' on a local run: its rendezvous is on "
                          "127.0.0.1, so no other node can ever join and it would wait forever for MIN nodes "
                          "(multi-node: --lab, or torchrun on every node)")
    where = placement(cfg) if here else None  # dist.device, dist.backend, dist.nproc against this machine's GPUs
    if where is not None and cfg.ft.replicas and where.device_type == "cuda" and live_env.REPLICA not in os.environ:
        from .devices import replica_gpus

        # the launcher's view (a replica group's worker sees only its own GPUs): every replica group GPUs of its own
        replica_gpus(0, cfg.ft.replicas, cfg.dist.nproc, where.gpus)
    if where is not None and cfg.train.mixed_precision == "fp16" and where.device_type != "cuda":
        raise ConfigError("train.mixed_precision", "fp16", "none, bf16 or auto when the workers run on the CPU "
                          f"(dist.device={cfg.dist.device} resolves to the CPU here; fp16 needs CUDA and a GradScaler)")
    _check_data_and_memory(cfg, local, fewest, where, specs.layout)


def _check_live_recovery(cfg: RunConfig, specs: Any, group_world: int) -> None:
    """Live recovery ([ft], docs/live-recovery.md): each replica group is a DDP or FSDP2 copy of the model (torchft
    is the replicate dimension across groups: HSDP), or one local-SGD / DiLoCo worker; on one machine's processes or
    a cluster's."""
    ft = cfg.ft
    if ft.min_replicas > ft.replicas:
        raise ConfigError("ft.min_replicas", ft.min_replicas, f"an integer from 1 to ft.replicas ({ft.replicas})")
    from .layout import check_live_compress, check_live_layout, check_live_sync

    if cfg.metrics.prometheus_port and not cfg.dist.lab:
        raise ConfigError("metrics.prometheus_port", cfg.metrics.prometheus_port, f"0 (off) with ft.replicas="
                          f"{ft.replicas} on one machine: every replica group's local rank 0 would serve the same "
                          "port, and all but one would die on 'Address already in use'")
    check_live_layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    check_live_sync(specs.sync, cfg.parallel.sync, group_world, cfg.parallel.dp_shard)
    check_live_compress(cfg.compress.method, group_world)
    if cfg.dist.lab:  # one replica group per lab node (syncwise.launch.ft_lab), the lighthouse on node 0
        from .lab.cluster import status

        try:
            state = status()
        except (OSError, SyncwiseError):
            state = None
        if state is not None and ft.replicas > len(state.nodes):
            raise ConfigError("ft.replicas", ft.replicas, f"at most the lab's {len(state.nodes)} nodes with --lab "
                              "(one replica group per node)")
    if cfg.dist.nnodes != "1":
        raise ConfigError("dist.nnodes", cfg.dist.nnodes, "'1' with ft.replicas ≥ 2: each replica group is one "
                          "node's torchrun job (more nodes: more replica groups)")
    if cfg.dist.max_restarts:
        raise ConfigError("dist.max_restarts", cfg.dist.max_restarts, "0 with ft.replicas ≥ 2: a replica group's "
                          "restarts are ft.replica_restarts (each rejoins from a live peer, not a checkpoint)")
    if cfg.resume not in ("none", "auto"):
        raise ConfigError("resume", cfg.resume, "'none' or 'auto' with ft.replicas ≥ 2 (replicas that find no live "
                          "peer load the newest checkpoint of RUN_DIR/checkpoints themselves)")
    from .train.live_recovery import require_torchft

    require_torchft()


def _check_hf_run(cfg: RunConfig) -> None:
    """What a Hugging Face model (``hf:FOLDER``) can do here: tensor parallel through transformers' own plan
    (``base_model_tp_plan``) for the families whose plan is column/row-wise layers, alone or under data parallel
    (DDP, FSDP2, HSDP: tests/test_hf_models.py checks losses and the clipped gradient norm); syncwise's pipeline split and
    expert dispatch are written for its own model; its attention is the model's own."""
    from .models.hf import check_hf_tp, read_hf_model

    preset = cfg.model.preset
    if cfg.parallel.tp > 1:
        check_hf_tp(read_hf_model(preset), preset, cfg.parallel.tp)
    for name, what in (("pp", "pipeline parallel"), ("ep", "expert parallel")):
        value = getattr(cfg.parallel, name)
        if value > 1:
            raise ConfigError(f"parallel.{name}", value, f"1 with model.preset={preset}: {what} is not supported for "
                              "Hugging Face models yet (syncwise's pipeline split and expert dispatch are written for "
                              "its own model); data parallel is: DDP with any compressor, FSDP2, HSDP")
    if cfg.model.attention != "default":
        raise ConfigError("model.attention", cfg.model.attention, f"'default' with model.preset={preset}: a Hugging "
                          "Face model's attention is set in its config.json")


def model_overrides(cfg: RunConfig, vocab_size: int) -> dict[str, Any]:
    """What the run changes in its model preset: the worker builds the model with these, and the checks
    before start validate the same shape."""
    out: dict[str, Any] = {"vocab_size": vocab_size, "seq_len": cfg.data.seq_len, "moe_impl": cfg.model.moe_impl}
    if cfg.model.attention != "default":
        out["attention"] = cfg.model.attention
    return out


def run_layout(cfg: RunConfig) -> Any:
    """The ``[parallel]`` layout with ``compress.method`` and ``parallel.sync``, as the one owner of the layout's
    rules sees it (``syncwise.layout.Layout``, unresolved: dp_replicate may be 0)."""
    from .layout import Layout, parse_compress

    with _as_field("compress.method", cfg.compress.method):
        compress = parse_compress(cfg.compress.method, "compress.method")
    # [parallel]'s keys are the Layout's field names (the section adds the command line's docs and bounds)
    return Layout.of(compress=compress, hierarchical=cfg.dist.hierarchical, **dataclasses.asdict(cfg.parallel))


def _check_model(lay: Any, model_config: Any) -> None:
    """The layout against the model's shape and what it needs from this torch (the pipeline schedule's class,
    float8 for an fp8 dispatch): ``syncwise.parallel.mesh.check_torch_support``, as ``parallelize`` asks it."""
    from .parallel.mesh import check_torch_support

    check_torch_support(lay, model_config)


def _check_layout(cfg: RunConfig, lay: Any, fewest: int, most: int) -> None:
    """The layout's rules (``syncwise.layout.Layout.check``: the world size, compressor × sync × degrees) for
    every size an elastic job may have, then the rules that involve training fields."""
    worlds = sorted({fewest, most}) if not (cfg.dist.lab and fewest != most) else []
    for world in worlds or [None]:  # (a lab job before its lab is up: the world is checked when workers start)
        try:
            lay.check(world)
        except ConfigError as e:  # the value as the user wrote it
            if e.field in ("parallel.sync", "compress.method"):
                raise ConfigError(e.field, _get(cfg, e.field), e.accepted) from None
            raise
    check_step(lay, dynamic_batch=cfg.train.dynamic_batch, grad_accum=cfg.train.grad_accum,
               fp16=cfg.train.mixed_precision == "fp16", names=CLI_STEP_FIELDS,
               given={k: _get(cfg, key) for k, key in CLI_STEP_FIELDS.items()})
    if lay.replicas_only:
        return
    microbatches = lay.microbatches_per_step
    if lay.pp > 1 and cfg.data.batch_size % microbatches:
        key = "parallel.microbatches" if lay.microbatches else "data.batch_size"
        raise ConfigError(key, _get(cfg, key), f"data.batch_size ({cfg.data.batch_size}) split evenly into "
                          f"{microbatches} pipeline microbatches (parallel.microbatches; 0 = 2 × pp × stages_per_rank)")


def _check_data_and_memory(cfg: RunConfig, local: int, fewest: int, where: "Placement", lay: Any) -> None:
    """Does one step's batch fit the corpus (the batch loader's rule, from token counts) and this machine?"""
    from .data import check_fits, corpus_sizes
    from .models import resolve_config, train_memory_bytes

    from .models.hf import check_hf_shape, hf_train_memory_bytes, is_hf, read_hf_model

    hf = read_hf_model(cfg.model.preset) if is_hf(cfg.model.preset) else None
    if where is None:  # a job for another machine (check_references(here=False)): the model's shape only
        if hf is not None:
            check_hf_shape(hf, cfg.model.preset, 256 if not cfg.data.tokenizer else 0, cfg.data.seq_len)
            return
        key = _blame(cfg, "model.attention", "model.preset")
        with _as_field(key, _get(cfg, key)):
            _check_model(lay, resolve_config(cfg.model.preset, **model_overrides(cfg, 256)))
        return
    d = cfg.data
    if hf is not None and hf.max_positions is not None and d.seq_len > hf.max_positions:
        check_hf_shape(hf, cfg.model.preset, 0, d.seq_len)  # the cause, before the corpus's windows are counted
    try:
        train_tokens, val_tokens, vocab = corpus_sizes(d.corpus, d.val_fraction, tokenizer=d.tokenizer,
                                                       text_column=d.text_column, tokenize_workers=d.tokenize_workers)
    except ConfigError as e:  # the loader's errors are data.corpus's, but for the tokenizer's own fields
        if e.field in ("data.tokenizer", "data.text_column", "data.tokenize_workers"):
            raise
        raise ConfigError("data.corpus", d.corpus, e.accepted) from None
    rules = [((train_tokens, None), ("data.seq_len", "data.batch_size", "dist.nproc", "data.corpus")),
             ((None, val_tokens), ("data.val_fraction", "data.seq_len", "data.batch_size", "dist.nproc", "data.corpus"))]
    for (train, val), keys in rules:
        try:
            check_fits(train, val, d.batch_size, d.seq_len, fewest)
        except ConfigError as e:
            key = _blame(cfg, *keys)
            raise ConfigError(key, _get(cfg, key), e.accepted) from None
    fp32 = cfg.train.mixed_precision == "none" or (cfg.train.mixed_precision == "auto" and where.device_type != "cuda")
    rows = 1 if cfg.train.dynamic_batch else d.batch_size  # with dynamic_batch only one row has to fit
    if hf is not None:  # the planner's description of the Hugging Face config (plan.model.from_hf_config)
        check_hf_shape(hf, cfg.model.preset, vocab or 256, d.seq_len)
        try:
            spec = hf_model_spec(hf, d.seq_len)
        except ConfigError as e:  # a field the planner needs, missing or wrong in config.json
            raise ConfigError("model.preset", cfg.model.preset, f"a complete config.json: {e.field} must be "
                              f"{e.accepted} (got {e.value!r})") from None
        need = hf_train_memory_bytes(spec, rows, 4 if fp32 else 2, cfg.train.activation_checkpointing)
    else:
        overrides = model_overrides(cfg, vocab or 256)
        key = _blame(cfg, "model.attention", "model.preset")
        with _as_field(key, _get(cfg, key)):  # the model's own validation of this shape
            model = resolve_config(cfg.model.preset, **overrides)
        _check_model(lay, model)  # tp divides the heads and widths, the pipeline fits the layers
        need = train_memory_bytes(model, rows, 4 if fp32 else 2, cfg.train.activation_checkpointing)
    have, what = _memory_per_worker(cfg, local, where)
    if need > have:
        key = _blame(cfg, "data.seq_len", "data.batch_size", "model.preset", "dist.nproc")
        raise ConfigError(key, _get(cfg, key), f"a step that fits: {cfg.model.preset} at batch_size {d.batch_size} × "
                          f"seq_len {d.seq_len} needs at least {need / 2**30:,.1f} GiB per worker (weights, AdamW "
                          f"state, activations), more than the {have / 2**30:,.1f} GiB of {what}; lower "
                          "batch_size or seq_len, or turn on train.activation_checkpointing")


def format_config(cfg: RunConfig, keys: Optional[Iterable[str]] = None,
                  header: str = "syncwise train: resolved configuration (validated; nothing was started or written)"
                  ) -> str:
    """The configuration as TOML, every key named by its field: what `syncwise train --check` prints (all of it),
    `syncwise plan --emit-config` writes (``keys``: only those, 'section.field' or a top-level field, in the
    config's order; a section none is in is left out) and `--config` reads back. ``header``: a comment."""
    sections = _sections()
    wanted = None if keys is None else set(keys)
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{f.name} = {_toml(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
              if f.name not in sections and (wanted is None or f.name in wanted)]
    for name in sections:
        section = getattr(cfg, name)
        table = [f"{f.name} = {_toml(getattr(section, f.name))}" for f in dataclasses.fields(section)
                 if wanted is None or f"{name}.{f.name}" in wanted]
        lines += ["", f"[{name}]"] + table if table else []
    return "\n".join(lines).lstrip("\n")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # floats are finite here: repr is a TOML float
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    out = []
    for ch in str(value):  # a TOML basic string; control and line-breaking characters escaped
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or ch in "\u2028\u2029" or 0xD800 <= ord(ch) <= 0xDFFF:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def describe_fields() -> str:
    """Every field with its default and documentation, for ``--help``."""
    lines = []
    for f in dataclasses.fields(RunConfig):
        if f.name in _sections():
            section = f.default_factory()
            lines.append(f"[{f.name}]")
            for sf in dataclasses.fields(section):
                flag = f"--{f.name}.{sf.name}={getattr(section, sf.name)}"
                lines.append(f"  {flag:<38} {_help(sf)}")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            flag = f"--{f.name}={default}"
            lines.append(f"  {flag:<38} {_help(f)}")
    return "\n".join(lines)


def _help(f: dataclasses.Field) -> str:
    opt = option_of(f)
    accepted = opt.accepted_text()
    return f"{opt.doc} [{accepted}]" if accepted and accepted != "true or false" else opt.doc


# Named flags of `syncwise train` and the config key each one sets.
FLAG_KEYS = {"nproc": "dist.nproc", "steps": "train.steps", "preset": "model.preset", "model": "model.preset",
             "run_dir": "run_dir",
             "compress": "compress.method", "sync": "parallel.sync", "resume": "resume",
             "max_restarts": "dist.max_restarts",
             "inject_fault": "inject_fault", "lab": "dist.lab", "nnodes": "dist.nnodes",
             "deterministic": "train.deterministic"}


def add_train_arguments(parser) -> None:
    """The named flags shared by `syncwise train` and the worker entry point
    (`python -m syncwise.commands.worker`, alias `python -m syncwise.train`)."""
    parser.add_argument("--config", help="TOML file with [section] tables (or a JSON written by syncwise)")
    parser.add_argument("--nproc", help="local worker processes (dist.nproc)")
    parser.add_argument("--steps", help="optimizer steps (train.steps)")
    parser.add_argument("--preset", help="model preset (model.preset)")
    parser.add_argument("--model", help="model preset or hf:FOLDER, a Hugging Face model folder (model.preset)")
    parser.add_argument("--run-dir", dest="run_dir", help="run directory (run_dir)")
    parser.add_argument("--compress", help="gradient compression NAME[:key=value,...] or auto (compress.method)")
    parser.add_argument("--sync", help="every-step | auto | localsgd:period=H | diloco:period=H,delay=D,... | sparseloco:period=H "
                        "| streaming:period=H,fragments=F (parallel.sync)")
    parser.add_argument("--resume", help="auto | PATH | none (resume). The layout may change at resume: giving any "
                        "--parallel.{dp_replicate,dp_shard,tp,pp,ep} replaces the saved layout as a whole (degrees "
                        "not given take their defaults), not merged degree by degree (docs/resume.md)")
    parser.add_argument("--max-restarts", dest="max_restarts", help="elastic restarts (dist.max_restarts)")
    parser.add_argument("--nnodes", help="elastic node range N or MIN:MAX (dist.nnodes)")
    parser.add_argument("--inject-fault", dest="inject_fault", action="append",
                        help="kill:rank=R,step=S or nan:step=S (repeatable)")
    parser.add_argument("--lab", action="store_const", const="true", help="run across the network lab (dist.lab)")
    parser.add_argument("--deterministic", action="store_const", const="true",
                        help="deterministic algorithms (train.deterministic)")


def overrides_from_args(args, extra: list[str]) -> dict[str, Any]:
    """Named flags plus ``--section.key=value`` / ``--section.key value`` words, as text overrides."""
    overrides: dict[str, Any] = {}
    if getattr(args, "preset", None) is not None and getattr(args, "model", None) is not None:
        raise ConfigError("--model", args.model, f"--model or --preset, not both (each sets model.preset; --preset "
                          f"{args.preset} was given too)")
    for name, key in FLAG_KEYS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        overrides[key] = ";".join(value) if isinstance(value, list) else value
    i = 0
    while i < len(extra):
        word = extra[i]
        if not word.startswith("--"):
            raise ConfigError(word, word, "options of the form --section.key=value (see --help)")
        key, eq, value = word[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise ConfigError(key, None, "a value: --section.key=value")
            value, i = extra[i + 1], i + 1
        overrides[key.replace("-", "_") if "." not in key else key] = value
        i += 1
    return overrides


def config_from_argv(argv: list[str]) -> RunConfig:
    """Parse `syncwise train` arguments (without --help handling) into a validated RunConfig."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    file_values = load_file(args.config) if args.config else None
    return build_config(file_values, overrides_from_args(args, extra))


def hf_model_spec(info: Any, seq_len: int) -> Any:
    """The planner's description (plan.model.from_hf_config) of a Hugging Face model read by
    models.hf.read_hf_model, at the training length: memory checks and the FLOPs per token behind MFU."""
    from .plan.model import from_hf_config

    return from_hf_config(info.values, info.folder.name or "hf", str(info.folder / "config.json")).with_seq_len(seq_len)
