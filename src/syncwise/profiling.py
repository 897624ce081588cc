"""The profiling schedule's grammar (``--profile.steps`` / ``--profile.every``; ``profile_steps`` / ``profile_every``
of ``OptimizedTrainer``), torch-free: a shared leaf that ``config`` (the command line's door, its ``--help``) and
``train.options`` (the Python API's door) both ask, so the two refuse the same values with the same words. The
profiler itself is ``syncwise.train.profile``.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from .errors import ConfigError

STEPS_ACCEPTED = "'' (off), 'A:B' (steps A to B, 1 ≤ A ≤ B) or 'A' (step A alone)"
EVERY_ACCEPTED = "0 (off) or an integer ≥ 2 (one step in N: steps N, 2N, ...)"
_STEPS_RE = re.compile(r"^\s*([0-9]{1,10})\s*(?::\s*([0-9]{1,10})\s*)?$")
_MAX_WINDOW = 1000       # steps in one trace file: beyond this a trace is too large to read back
#: the profiler label around a gradient compressor's own work (encode, decode and its collectives in between;
#: syncwise.compress.hook): what syncwise.doctor.trace reads as compression on a trace
COMPRESS_LABEL = "syncwise:compress"
#: the profiler label around a blocking collective's call (``syncwise.comm.ops``: ``WAIT_LABEL + name``, e.g.
#: ``syncwise:wait broadcast``): the host waits inside torch's ``work.wait()``, which records nothing of its own, so
#: without it the wait reads as idle where the execution is a control's few bytes (a pipeline's loss broadcast)
WAIT_LABEL = "syncwise:wait "


def parse_steps(value: Any, field: str = "profile_steps") -> Optional[tuple[int, int]]:
    """``'A:B'`` / ``'A'`` / a pair → (A, B); None/'' → None (off). Anything else: a ConfigError naming ``field``."""
    if value is None or value == "":
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        a, b = value
    elif isinstance(value, str) and _STEPS_RE.match(value):
        m = _STEPS_RE.match(value)
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
    else:
        raise ConfigError(field, value, STEPS_ACCEPTED)
    if not 1 <= a <= b or b - a + 1 > _MAX_WINDOW:
        raise ConfigError(field, value, STEPS_ACCEPTED + f", at most {_MAX_WINDOW:,} steps")
    return a, b


def check_every(value: Any, field: str = "profile_every") -> int:
    """0 (off) or N ≥ 2; else a ConfigError naming ``field``. (Every step is ``profile_steps='1:S'``.)"""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value == 1:
        raise ConfigError(field, value, EVERY_ACCEPTED)
    return value


def check_pair(steps: Any, every: Any, names: tuple[str, str] = ("profile_steps", "profile_every")) -> None:
    """One schedule at a time: a window, or one step in N."""
    window, n = parse_steps(steps, names[0]), check_every(every, names[1])
    if window is not None and n:
        raise ConfigError(names[1], every, f"0 when {names[0]} is set ({steps!r}): one schedule at a time")


def profiled(step: int, steps: Optional[tuple[int, int]], every: int) -> bool:
    """Whether trainer step ``step`` (1-based) is recorded."""
    if steps is not None:
        return steps[0] <= step <= steps[1]
    return bool(every) and step % every == 0
