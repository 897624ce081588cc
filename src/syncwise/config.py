"""Run configuration: one dataclass per component, TOML/JSON files, ``--section.key=value`` overrides.

Every field carries its documentation and its accepted values in the field metadata, so
``syncwise train --help`` lists them and a bad value fails here — before any worker starts — with
one message naming the field, the value and what is accepted.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def option(default: Any, doc: str, accepted: str = "", check: Optional[Callable[[Any], bool]] = None):
    """A documented config field; ``check(value)`` False means the value is rejected with ``accepted``."""
    meta = {"doc": doc, "accepted": accepted, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _one_of(*choices: str) -> tuple[str, Callable[[Any], bool]]:
    return "one of: " + ", ".join(choices), lambda v: v in choices


_INTERVAL_RE = re.compile(r"^(0|[1-9]\d*|[1-9]\d*(\.\d+)?s|dynamic)$")
_FAULT_RE = re.compile(r"^(kill:rank=\d+,step=[1-9]\d*|kill:step=[1-9]\d*,rank=\d+|"
                       r"nan:step=[1-9]\d*(,rank=\d+)?|nan:rank=\d+,step=[1-9]\d*)$")
_MAX_LOCAL_WORKERS = 4 * (os.cpu_count() or 1)


@dataclass
class ModelSection:
    """[model] which network to train."""

    preset: str = option("small", "model preset (see `syncwise models`): tiny, tiny-moe, small, medium, large, ...")
    attention: str = option("default", "attention kind: 'default' (the preset's), 'mha', or 'mla' "
                            "(multi-head latent attention)", *_one_of("default", "mha", "mla"))


@dataclass
class DataSection:
    """[data] what to train on and how it is batched."""

    corpus: str = option("stdlib", "'stdlib' (this machine's Python standard library sources, no download), a "
                         "text file or folder, or a folder with nanoGPT train.bin/val.bin")
    seq_len: int = option(128, "tokens per sequence", "an integer ≥ 2", lambda v: v >= 2)
    batch_size: int = option(8, "sequences per micro-batch per worker", "a positive integer", _positive)
    val_fraction: float = option(0.05, "share of the corpus held out for validation", "a number in (0, 0.5]",
                                 lambda v: 0 < v <= 0.5)
    prefetch: int = option(2, "batches prefetched by a background thread (0 = off)", "an integer ≥ 0",
                           _non_negative)


@dataclass
class TrainSection:
    """[train] the optimisation loop."""

    steps: int = option(200, "optimizer steps to run", "a positive integer", _positive)
    lr: float = option(2e-3, "peak learning rate (AdamW)", "a positive number", _positive)
    min_lr_ratio: float = option(0.1, "final LR of the cosine decay, as a fraction of the peak", "a number in [0, 1]",
                                 lambda v: 0 <= v <= 1)
    warmup_steps: int = option(20, "linear LR warm-up steps", "an integer ≥ 0", _non_negative)
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)", "a number ≥ 0", _non_negative)
    grad_accum: int = option(1, "micro-batches per optimizer step (only the last one communicates)",
                             "a positive integer", _positive)
    clip_grad: float = option(1.0, "gradient-norm clipping threshold (0 = off)", "a number ≥ 0", _non_negative)
    mixed_precision: str = option("none", "autocast dtype: none, bf16, fp16 (GPU, with GradScaler), auto",
                                  *_one_of("none", "bf16", "fp16", "auto"))
    compile: bool = option(False, "torch.compile the model (kernel fusion)", "true or false")
    activation_checkpointing: bool = option(False, "recompute each block's activations in backward",
                                            "true or false")
    seed: int = option(1337, "random seed (model init and data order)", "an integer ≥ 0", _non_negative)
    val_interval: int = option(50, "validate every N steps (0 = only at the end)", "an integer ≥ 0",
                               _non_negative)
    val_batches: int = option(4, "batches per validation", "a positive integer", _positive)
    deterministic: bool = option(False, "deterministic algorithms (bit-exact resume)", "true or false")


@dataclass
class DistSection:
    """[dist] workers and the process group."""

    nproc: int = option(2, "local worker processes (started by torchrun's elastic agent)",
                        f"an integer from 1 to {_MAX_LOCAL_WORKERS} (4 × this machine's cores)",
                        lambda v: 1 <= v <= _MAX_LOCAL_WORKERS)
    backend: str = option("auto", "process-group backend: auto (nccl on GPU, else gloo), gloo, nccl",
                          *_one_of("auto", "gloo", "nccl"))
    bucket_cap_mb: float = option(25.0, "DDP gradient bucket size in MB", "a positive number", _positive)
    timeout_s: float = option(300.0, "a collective that takes longer fails with a message", "a positive number",
                              _positive)
    lab: bool = option(False, "run across the network lab's nodes (`syncwise cluster up` first)", "true or false")
    max_restarts: int = option(0, "worker-group restarts torchrun's agent may do after a failure (each resumes "
                               "from the newest valid checkpoint)", "an integer ≥ 0", _non_negative)
    nnodes: str = option("1", "nodes of the elastic job, 'N' or 'MIN:MAX' as torchrun's --nnodes",
                         "'N' or 'MIN:MAX' with 1 ≤ MIN ≤ MAX",
                         lambda v: bool(re.match(r"^[1-9]\d*(:[1-9]\d*)?$", v)) and
                         int(v.split(":")[0]) <= int(v.split(":")[-1]))


@dataclass
class CompressSection:
    """[compress] gradient communication."""

    method: str = option("none", "gradient compression NAME[:key=value,...], e.g. fp16, powersgd:rank=4, "
                         "topk:ratio=0.01 (list below); torch-fp16, torch-powersgd:rank=4 ... use PyTorch's own hooks")
    min_numel: int = option(4096, "tensors with fewer elements (norms, biases) are sent uncompressed",
                            "an integer ≥ 0", _non_negative)
    sync: str = option("every-step", "how often replicas synchronise: every-step (gradient all-reduce), or local SGD "
                       "/ DiLoCo every H steps: localsgd:period=16, diloco:period=16,delay=4,dtype=bf16, "
                       "torch-localsgd:period=16 (PyTorch's averager), pipesgd[:dtype=fp16] (all-reduce overlapped "
                       "with the next step); see docs/compression.md")


@dataclass
class CheckpointSection:
    """[ckpt] saving and resuming."""

    interval: str = option("dynamic", "save every N steps, every Ns seconds, or 'dynamic' (Young/Daly from the "
                           "measured save cost and mtbf_s); 0 = only at the end",
                           "an integer ≥ 0, a duration like '300s', or 'dynamic'",
                           lambda v: bool(_INTERVAL_RE.match(str(v))))
    keep: int = option(3, "checkpoints kept (the newest valid one is never deleted)", "a positive integer",
                       _positive)
    async_save: bool = option(True, "write checkpoints in the background while training goes on", "true or false")
    compression: bool = option(False, "compress checkpoint files", "true or false")
    mtbf_s: float = option(14400.0, "mean time between failures for the 'dynamic' interval", "a positive number",
                           _positive)


@dataclass
class RunConfig:
    """Everything one `syncwise train` run needs."""

    run_dir: str = option("", "directory for metrics.jsonl, summary.json, checkpoints (default: a new runs/DATE-TIME)")
    resume: str = option("none", "'auto' (newest valid checkpoint in run_dir, if any), a checkpoint path, or 'none'")
    inject_fault: list = option([], "fault injections for tests/demos, e.g. kill:rank=1,step=30 or nan:step=5",
                                "a list of 'kill:rank=R,step=S' or 'nan:step=S[,rank=R]' with S ≥ 1",
                                lambda v: all(_FAULT_RE.match(s) for s in v))
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    dist: DistSection = field(default_factory=DistSection)
    compress: CompressSection = field(default_factory=CompressSection)
    ckpt: CheckpointSection = field(default_factory=CheckpointSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved configuration as JSON (workers on other nodes read it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


def _type_of(cls: type, name: str) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[name]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def _coerce(path: str, value: Any, typ: type, from_text: bool) -> Any:
    """Convert ``value`` to ``typ``; text from the command line is parsed, TOML values must already fit."""
    accepted = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                list: "a list"}[typ]
    if from_text and isinstance(value, str):
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
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
        return float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(path, value, accepted)
    return value


def _validate(path: str, f: dataclasses.Field, value: Any) -> None:
    check = f.metadata.get("check")
    if check is not None and not check(value):
        raise ConfigError(path, value, f.metadata.get("accepted") or "see `syncwise train --help`")


def _set(cfg: RunConfig, key: str, value: Any, from_text: bool) -> None:
    parts = key.split(".")
    sections = _sections()
    if len(parts) == 1:
        target, name = cfg, parts[0]
    elif len(parts) == 2 and parts[0] in sections:
        target, name = getattr(cfg, parts[0]), parts[1]
    else:
        raise ConfigError(key, value, "a key like section.name with section one of: " + ", ".join(sections))
    fields = {f.name: f for f in dataclasses.fields(target) if f.name not in sections}
    if name not in fields:
        where = f"[{parts[0]}]" if len(parts) == 2 else "the top level"
        raise ConfigError(key, value, f"a key of {where}: " + ", ".join(fields))
    typ = _type_of(type(target), name)
    value = _coerce(key, value, typ, from_text)
    if typ is list and from_text and name == "inject_fault":  # repeatable flag: append
        value = getattr(target, name) + value
    _validate(key, fields[name], value)
    setattr(target, name, value)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON, as written by ``RunConfig.save``) file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", str(path), "an existing .toml or .json file")
    try:
        if p.suffix == ".json":
            return json.loads(p.read_text())
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("--config", str(path), f"a valid {p.suffix.lstrip('.').upper()} file ({e})") from None


def build_config(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults ← file values ← command-line overrides (text), each validated as it is applied."""
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
    check_references(cfg)
    return cfg


def check_references(cfg: RunConfig) -> None:
    """Checks that look outside the config itself: presets, compressor specs, data paths, devices."""
    from .models import PRESETS  # imported here: config must stay importable without torch work at import

    if cfg.model.preset not in PRESETS:
        raise ConfigError("model.preset", cfg.model.preset, "one of: " + ", ".join(PRESETS))
    if cfg.data.corpus != "stdlib" and not Path(cfg.data.corpus).expanduser().exists():
        raise ConfigError("data.corpus", cfg.data.corpus,
                          "'stdlib' or the path of an existing text file, text folder, or folder with train.bin")
    from .compress import parse_compress_spec
    from .parallel import SyncSpec, TorchHookSpec

    # These raise ConfigError naming the spec.
    TorchHookSpec.parse(cfg.compress.method) or parse_compress_spec(cfg.compress.method)
    sync = SyncSpec.parse(cfg.compress.sync)
    if sync is not None and cfg.compress.method != "none":
        raise ConfigError("compress.sync", cfg.compress.sync, "every-step when compress.method is set (local SGD "
                          f"sends pseudo-gradients, not gradients; got compress.method={cfg.compress.method})")
    if sync is not None and sync.method == "pipesgd" and cfg.train.mixed_precision == "fp16":
        raise ConfigError("compress.sync", cfg.compress.sync, "every-step or localsgd/diloco with fp16 mixed "
                          "precision (a loss-scaled gradient applied one step late would meet another scale)")
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).expanduser().exists():
        raise ConfigError("resume", cfg.resume, "'auto', 'none', or the path of an existing checkpoint directory")
    for spec in cfg.inject_fault:
        if spec.startswith("kill") and cfg.dist.max_restarts == 0:
            raise ConfigError("inject_fault", spec, "a kill only with --max-restarts ≥ 1 (else the run just dies)")
    if cfg.train.mixed_precision == "fp16":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.mixed_precision", "fp16", "none, bf16 or auto on a machine without a GPU "
                              "(fp16 needs CUDA and a GradScaler)")


def describe_fields() -> str:
    """Every field with its default and documentation, for ``--help``."""
    lines = []
    for f in dataclasses.fields(RunConfig):
        if f.name in _sections():
            section = f.default_factory()
            lines.append(f"[{f.name}]")
            for sf in dataclasses.fields(section):
                flag = f"--{f.name}.{sf.name}={getattr(section, sf.name)}"
                lines.append(f"  {flag:<38} {sf.metadata.get('doc', '')}")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            flag = f"--{f.name}={default}"
            lines.append(f"  {flag:<38} {f.metadata.get('doc', '')}")
    return "\n".join(lines)


# Named flags of `syncwise train` and the config key each one sets.
FLAG_KEYS = {"nproc": "dist.nproc", "steps": "train.steps", "preset": "model.preset", "run_dir": "run_dir",
             "compress": "compress.method", "sync": "compress.sync", "resume": "resume",
             "max_restarts": "dist.max_restarts",
             "inject_fault": "inject_fault", "lab": "dist.lab", "nnodes": "dist.nnodes",
             "deterministic": "train.deterministic"}


def add_train_arguments(parser) -> None:
    """The named flags shared by `syncwise train` and `python -m syncwise.train`."""
    parser.add_argument("--config", help="TOML file with [section] tables (or a JSON written by syncwise)")
    parser.add_argument("--nproc", help="local worker processes (dist.nproc)")
    parser.add_argument("--steps", help="optimizer steps (train.steps)")
    parser.add_argument("--preset", help="model preset (model.preset)")
    parser.add_argument("--run-dir", dest="run_dir", help="run directory (run_dir)")
    parser.add_argument("--compress", help="gradient compression NAME[:key=value,...] (compress.method)")
    parser.add_argument("--sync", help="every-step | localsgd:period=H | diloco:period=H,delay=D,... (compress.sync)")
    parser.add_argument("--resume", help="auto | PATH | none (resume)")
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
