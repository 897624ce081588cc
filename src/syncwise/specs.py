"""The one parser of syncwise's ``NAME[:key=value,...]`` mini-language and its typed readers.

``--compress`` (compressors and PyTorch's reference hooks), ``--sync`` and ``--inject-fault`` are all
written this way; each owner (``compress.registry``, ``parallel.sync_spec``, ``parallel.data_parallel``,
``train.faults``) splits its text here, reads each value with the readers below and keeps only its own
names, keys, defaults and bounds. So every spec has the same syntax (a case-insensitive name; options
separated by commas; blanks around names, keys and values ignored; the last of a repeated key wins), the
same yes/no vocabulary and the same error: a ``ConfigError`` naming the field and the value as written
and saying what is accepted. A leaf module: it imports only the standard library and ``syncwise.errors``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from .errors import ConfigError

#: the yes/no vocabulary of every spec option and every boolean config value (case-insensitive)
YES = ("yes", "true", "on", "1")
NO = ("no", "false", "off", "0")
BOOL_ACCEPTED = "yes/no, true/false, on/off or 1/0"
INT64 = (-2**63, 2**63 - 1)  # what a torch tensor or generator can hold


def count(name: str, value: Any, minimum: int = 1) -> int:
    """An integer value ≥ ``minimum`` (bools are not counts), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"an integer ≥ {minimum}")
    return value


def spec_name(text: Any) -> str:
    """The lower-case NAME of ``NAME[:key=value,...]`` text, as :func:`parse_spec` reads it, options unchecked
    ('' for anything but a string): for text parsed once already, or a table's key (``fp8:block=32`` → ``fp8``)."""
    return text.strip().partition(":")[0].strip().lower() if isinstance(text, str) else ""


def parse_spec(text: Any, field: str, accepted: str) -> tuple[str, dict[str, str]]:
    """Split ``NAME[:key=value,...]`` into (lower-case name, {key: raw value text}).

    ``accepted`` describes the owner's whole language; it is what the ConfigError for ``field`` says when
    ``text`` is not a non-empty string or an option is not of the form key=value.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, text, accepted)
    name, rest = spec_name(text), text.partition(":")[2]
    if not name:
        raise ConfigError(field, text, accepted)
    options: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(field, text, f"options as key=value ({accepted})")
        options[key] = raw.strip()
    return name, options


def parse_bool(raw: Any) -> Optional[bool]:
    """True or False for a word of the yes/no vocabulary (or a bool), None for anything else."""
    if isinstance(raw, bool):
        return raw
    if not isinstance(raw, str):
        return None
    low = raw.strip().lower()
    return True if low in YES else False if low in NO else None


def read_bool(raw: str, field: str, text: Any, key: str, accepted: Optional[str] = None) -> bool:
    """Option ``key`` of spec ``text`` as a bool (the shared yes/no vocabulary)."""
    value = parse_bool(raw)
    if value is None:
        raise ConfigError(field, text, accepted or _takes(key, BOOL_ACCEPTED, raw))
    return value


def read_int(raw: str, field: str, text: Any, key: str, lo: int = INT64[0], hi: int = INT64[1],
             accepted: Optional[str] = None) -> int:
    """Option ``key`` of spec ``text`` as an integer in [lo, hi] (an int64 by default)."""
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise ConfigError(field, text, accepted or _takes(key, _int_range(lo, hi), raw))
    return value


def read_float(raw: str, field: str, text: Any, key: str, lo: float = -math.inf, hi: float = math.inf,
               accepted: Optional[str] = None) -> float:
    """Option ``key`` of spec ``text`` as a finite number in [lo, hi]."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and lo <= value <= hi):  # NaN fails too
        kind = "a finite number" + ("" if (lo, hi) == (-math.inf, math.inf) else f" in [{lo:g}, {hi:g}]")
        raise ConfigError(field, text, accepted or _takes(key, kind, raw))
    return value


def read_choice(raw: str, field: str, text: Any, key: str, choices: tuple[str, ...] | list[str],
                accepted: Optional[str] = None) -> str:
    """Option ``key`` of spec ``text`` as one of ``choices`` (case-insensitive; returned as listed)."""
    low = raw.strip().lower()
    for choice in choices:
        if choice.lower() == low:
            return choice
    raise ConfigError(field, text, accepted or _takes(key, "one of " + ", ".join(choices), raw))


def read_value(raw: str, typ: type, field: str, text: Any, key: str, accepted: Optional[str] = None) -> Any:
    """Option ``key`` read as ``typ`` (bool, int, float or str) by the reader of that type."""
    if typ is bool:
        return read_bool(raw, field, text, key, accepted)
    if typ is int:
        return read_int(raw, field, text, key, accepted=accepted)
    if typ is float:
        return read_float(raw, field, text, key, accepted=accepted)
    if typ is str:
        return raw
    try:
        return typ(raw)
    except (TypeError, ValueError):
        raise ConfigError(field, text, accepted or _takes(key, f"a {getattr(typ, '__name__', typ)}", raw)) from None


def check_keys(options: dict[str, str], known: Any, field: str, text: Any, accepted: str) -> None:
    """Reject any option key not in ``known`` with ``accepted``."""
    if any(key not in known for key in options):
        raise ConfigError(field, text, accepted)


def _int_range(lo: int, hi: int) -> str:
    if (lo, hi) == INT64:
        return "an int64"
    if hi == INT64[1]:
        return f"an integer ≥ {lo:,}"
    return f"an integer in [{lo:,}, {hi:,}]"


def _takes(key: str, kind: str, raw: str) -> str:
    return f"{key}= takes {kind}, got {raw!r}"
