"""Compressor registry and ``parse_compress_spec``: a ``NAME[:key=value,...]`` spec (``syncwise.specs``) to a compressor."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..specs import check_keys, parse_spec, read_value
from .base import Compressor
from .cast import BF16Compressor, FP8Compressor, FP16Compressor, NoneCompressor
from .powersgd import PowerSGDCompressor
from .quant import Int8Compressor, SignCompressor
from .sparse import RandomKCompressor, TopKCompressor


@dataclass(frozen=True)
class CompressorInfo:
    """A registry entry: the class, a one-line summary and its options (name -> (type, default, doc))."""

    name: str
    cls: type
    summary: str
    options: dict[str, tuple[str, Any, str]]


def _info(cls: type, summary: str) -> CompressorInfo:
    hints = typing.get_type_hints(cls.Config)
    opts = {f.name: (getattr(hints[f.name], "__name__", str(hints[f.name])), f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls.Config)}
    return CompressorInfo(cls.name, cls, summary, opts)


#: name -> CompressorInfo, in the order the CLI lists them
COMPRESSORS: dict[str, CompressorInfo] = {i.name: i for i in [
    _info(NoneCompressor, "fp32 all-reduce average (the DDP baseline), 4 B/element"),
    _info(FP16Compressor, "fp16 all-reduce, 2 B/element"),
    _info(BF16Compressor, "bf16 all-reduce (works on gloo too), 2 B/element"),
    _info(FP8Compressor, "fp8 e4m3 + fp32 scale per block, all-gather, ~1 B/element"),
    _info(Int8Compressor, "QSGD int8, stochastic rounding, per-chunk scales, all-gather, ~1 B/element"),
    _info(SignCompressor, "1-bit sign + per-tensor scale + error feedback, all-gather, 1/8 B/element"),
    _info(TopKCompressor, "top-k values+indices per tensor, error feedback, all-gather, 8 B/kept element"),
    _info(RandomKCompressor, "random-k with a shared seed, error feedback, all-reduce, 4 B/kept element"),
    _info(PowerSGDCompressor, "rank-r PowerSGD, warm start, error feedback, 2 all-reduces/bucket"),
]}


def describe_compressors() -> str:
    """Multi-line help text: every compressor, its options, their defaults and docs."""
    lines = []
    for info in COMPRESSORS.values():
        lines.append(f"{info.name:9s} {info.summary}")
        for key, (typ, default, doc) in info.options.items():
            lines.append(f"    {key}={default!s:<8} ({typ}) {doc}")
    return "\n".join(lines)


def _accepted() -> str:
    return "NAME[:key=value,...] with NAME in " + ", ".join(COMPRESSORS)


def parse_compress_spec(spec: str) -> Compressor:
    """Build a compressor from ``NAME[:key=value,...]``, e.g. ``powersgd:rank=4``, ``topk:ratio=0.01``.

    The text is split by ``syncwise.specs.parse_spec`` and each option read by its type's shared reader
    (booleans: yes/no, true/false, on/off, 1/0). The compressor's ``spec`` is the text as given (stripped).
    """
    name, raw_options = parse_spec(spec, "compress", _accepted())
    info = COMPRESSORS.get(name)
    if info is None:
        raise ConfigError("compress", spec, _accepted())
    keys = ", ".join(info.options) or "(none)"
    check_keys(raw_options, info.options, "compress", spec, f"options of {info.name}: {keys} (as key=value)")
    hints = typing.get_type_hints(info.cls.Config)
    kwargs: dict[str, Any] = {key: read_value(raw, hints[key], "compress", spec, key)
                              for key, raw in raw_options.items()}
    compressor = info.cls(**kwargs)
    compressor.spec = spec.strip()
    return compressor
