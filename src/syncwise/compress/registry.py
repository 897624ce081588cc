"""Compressor registry and ``parse_compress_spec``: a ``NAME[:key=value,...]`` spec, parsed by the torch-free
table ``syncwise.layout.COMPRESSORS``, to a compressor instance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..layout import COMPRESSORS as SPECS, Compress, compressors_accepted, names_torch_hook, parse_compress
from .base import Compressor
from .demo import DeMoCompressor
from .cast import BF16Compressor, FP8Compressor, FP16Compressor, NoneCompressor
from .powersgd import PowerSGDCompressor
from .quant import Int8Compressor, SignCompressor
from .sparse import RandomKCompressor, TopKCompressor


@dataclass(frozen=True)
class CompressorInfo:
    """A registry entry: the class, a one-line summary and its options (name -> (type, default, doc)), as the
    torch-free table ``syncwise.layout.COMPRESSORS`` holds them (each class's ``Config`` is made from the same
    entry: ``base.config_class``)."""

    name: str
    cls: type
    summary: str
    options: dict[str, tuple[str, Any, str]]


_CLASSES = [NoneCompressor, FP16Compressor, BF16Compressor, FP8Compressor, Int8Compressor, SignCompressor,
            TopKCompressor, RandomKCompressor, PowerSGDCompressor, DeMoCompressor]
#: name -> CompressorInfo, in the order the CLI lists them (the table's syncwise compressors)
COMPRESSORS: dict[str, CompressorInfo] = {
    cls.name: CompressorInfo(cls.name, cls, SPECS[cls.name].summary, dict(SPECS[cls.name].options)) for cls in _CLASSES}


def describe_compressors() -> str:
    """Multi-line help text: every compressor, its options, their defaults and docs."""
    lines = []
    for info in COMPRESSORS.values():
        lines.append(f"{info.name:9s} {info.summary}")
        for key, (typ, default, doc) in info.options.items():
            lines.append(f"    {key}={default!s:<8} ({typ}) {doc}")
    return "\n".join(lines)


def build_compressor(spec: Compress) -> Compressor:
    """A compressor instance of a parsed spec (``syncwise.layout.Compress``); its ``spec`` is the text and
    ``parsed`` the spec itself (``parallelize`` reads the layout's rules from it: no parse again)."""
    info = COMPRESSORS.get(spec.name)
    if info is None:  # a torch-* hook: parallel.data_parallel.TorchHookSpec builds those
        raise ConfigError("compress", spec.text, compressors_accepted())
    compressor = info.cls(**spec.given)
    compressor.spec, compressor.parsed = spec.text, spec  # the text for records, the parsed spec for the layout
    return compressor


def parse_compress_spec(spec: str) -> Compressor:
    """Build a compressor from ``NAME[:key=value,...]``, e.g. ``powersgd:rank=4``, ``topk:ratio=0.01``.

    The text is parsed by ``syncwise.layout.parse_compress`` (the torch-free table: names, keys, types; the
    shared yes/no vocabulary) and the instance built here. The compressor's ``spec`` is the text as given (stripped).
    """
    if names_torch_hook(spec):
        raise ConfigError("compress", spec, compressors_accepted())
    return build_compressor(parse_compress(spec, "compress"))
