"""Compressor registry and the ``NAME[:key=value,...]`` spec parser used by config and CLI."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
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


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(spec: str, key: str, raw: str, typ: Any) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if typ is int:
            value = int(raw)
            if not -2**63 <= value < 2**63:  # what a torch tensor or generator can hold
                raise ValueError(raw)
            return value
        if typ is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(raw)
            return value
        return typ(raw)
    except ValueError:
        name = getattr(typ, "__name__", str(typ))
        name = {"int": "an int64", "float": "a finite float"}.get(name, f"a {name}")
        raise ConfigError("compress", spec, f"{key}= takes {name} value, got {raw!r}") from None


def parse_compress_spec(spec: str) -> Compressor:
    """Build a compressor from ``NAME[:key=value,...]``, e.g. ``powersgd:rank=4``, ``topk:ratio=0.01``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("compress", spec, _accepted())
    name, _, rest = spec.strip().partition(":")
    info = COMPRESSORS.get(name.strip().lower())
    if info is None:
        raise ConfigError("compress", spec, _accepted())
    hints = typing.get_type_hints(info.cls.Config)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in info.options:
            keys = ", ".join(info.options) or "(none)"
            raise ConfigError("compress", spec, f"options of {info.name}: {keys} (as key=value)")
        kwargs[key] = _convert(spec, key, raw.strip(), hints[key])
    return info.cls(**kwargs)
