"""The one definition of each option (its default, documentation and accepted values), asked by both doors.

An :class:`Option` is written once; each door makes it a field of its own dataclass under the name that door
spells it: ``syncwise.config``'s sections (``--train.grad_accum``, the TOML key ``[train] grad_accum``, ``--help``,
``syncwise train --check``'s resolved TOML) and ``syncwise.train.options``' groups
(``OptimizedTrainer(grad_accum_steps=...)``, ``StepOptions``, the trainer's signature; the worker passes a job's
values by ``train.options.shared_keywords``, which pairs fields by their Option). :meth:`Option.validate` is the
field's one rule: a bad value is refused by either door with the same line (``ConfigError``: the field as that
door names it, the value, what is accepted).

The options that exist behind both doors are defined here, grouped by the command-line section that holds them;
an option of one door only is defined in that door's dataclass with :func:`option`. Rules *between* fields are
``syncwise.layout``'s (``check_step``) and ``syncwise.config.check_references``'.
Torch-free: a leaf (errors, layout, profiling), so the command line's ``--help`` never loads torch.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from .errors import ConfigError
from .layout import BUCKET_CAP_MB, MIN_NUMEL
from .profiling import EVERY_ACCEPTED, STEPS_ACCEPTED, check_every, parse_steps

_SAME = object()  # Option.api_default: the same default as the command line's


@dataclass(frozen=True, eq=False)
class Option:
    """One option: ``default`` (the command line's, and ``OptimizedTrainer``'s unless ``api_default`` says
    otherwise), ``doc``, ``accepted`` (the text every refusal shows; a function when the list lives elsewhere and is
    read only when shown) and ``check`` (False: refused). ``parse`` maps a spelling to its canonical value before
    the check ('half' → 'fp16'); the command line keeps the canonical value, the Python API the value as given.
    ``rule``: the name the rules between fields (``syncwise.layout.check_step``) call this option by, whichever
    door's field carries it; each door's spelling of it is read off its dataclasses (:func:`rule_fields`)."""

    default: Any
    doc: str
    accepted: Union[str, Callable[[], str]] = ""
    check: Optional[Callable[[Any], bool]] = None
    parse: Optional[Callable[[Any], Any]] = None
    api_default: Any = _SAME
    rule: str = ""

    def field(self, api: bool = False) -> Any:
        """This option as a dataclass field (``api=True``: with ``OptimizedTrainer``'s default)."""
        default = self.default if not api or self.api_default is _SAME else self.api_default
        meta = {"option": self}
        if isinstance(default, list):
            return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
        return dataclasses.field(default=default, metadata=meta)

    def accepted_text(self) -> str:
        return self.accepted() if callable(self.accepted) else self.accepted

    def validate(self, name: str, value: Any, typ: Optional[type] = None, optional: bool = False) -> Any:
        """The value's canonical form, or a ConfigError naming ``name``. ``typ`` (the field's type, when the value
        did not come through the command line's text conversion) is checked first; None passes when ``optional``."""
        if value is None and optional:
            return None
        if typ is not None and not is_a(value, typ):
            raise ConfigError(name, value, self.accepted_text() or TYPE_WORDS.get(typ, typ.__name__))
        canonical = self.parse(value) if self.parse is not None else value
        finite = not isinstance(canonical, float) or math.isfinite(canonical)  # no NaN or ±inf, in any float field
        if not finite or (self.check is not None and not self.check(canonical)):
            raise ConfigError(name, value, self.accepted_text() or "see `syncwise train --help`")
        return canonical


def option(default: Any, doc: str, accepted: Union[str, Callable[[], str]] = "",
           check: Optional[Callable[[Any], bool]] = None, **kw: Any) -> Any:
    """An option of one door only, as a field of that door's dataclass."""
    return Option(default, doc, accepted, check, **kw).field()


def option_of(f: dataclasses.Field) -> Optional[Option]:
    return f.metadata.get("option")


def rule_fields(groups: dict[str, type], qualified: bool) -> dict[str, str]:
    """{an Option's ``rule``: its field as one door spells it} over that door's dataclasses ``groups`` (name →
    class): ``qualified`` gives ``section.field`` (the command line's config keys), else the field's own name
    (``OptimizedTrainer``'s flat keywords). What the rules' messages name is so read off the fields that carry
    the options, written nowhere else."""
    out: dict[str, str] = {}
    for group, kind in groups.items():
        for f in dataclasses.fields(kind):
            opt = option_of(f)
            if opt is not None and opt.rule:
                if opt.rule in out:
                    raise ValueError(f"rule field {opt.rule!r} is carried twice: {out[opt.rule]} and {f.name}")
                out[opt.rule] = f"{group}.{f.name}" if qualified else f.name
    return out


TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def is_a(value: Any, typ: type) -> bool:
    """``value`` is of the field type ``typ`` (a bool is no number; an int is a float's value)."""
    if typ is Any or typ is object:
        return True
    if typ in (int, float) and isinstance(value, bool):
        return False
    if typ is float:
        return isinstance(value, (int, float))
    return isinstance(value, typ)


def type_of(cls: type, name: str) -> tuple[Any, bool]:
    """(the type of field ``name`` of dataclass ``cls`` with Optional removed, whether None is allowed)."""
    t = typing.get_type_hints(cls)[name]
    optional = False
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        optional = type(None) in args
        t = next(a for a in args if a is not type(None))
    return (typing.get_origin(t) or t), optional


def validate_fields(obj: Any) -> None:
    """Every field of dataclass ``obj`` that carries an Option, by its rule, under the field's own name (the
    Python API's groups: the value is kept as given)."""
    for f in dataclasses.fields(obj):
        opt = option_of(f)
        if opt is not None:
            typ, optional = type_of(type(obj), f.name)
            opt.validate(f.name, getattr(obj, f.name), typ, optional)


def within(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: lo <= v <= hi


def one_of(*choices: str) -> tuple[str, Callable[[Any], bool]]:
    return "one of: " + ", ".join(choices), lambda v: v in choices


def grammar(check: Callable[[Any], Any]) -> Callable[[Any], bool]:
    """A check by a grammar's own parser (it raises ConfigError on what it refuses)."""
    def ok(v: Any) -> bool:
        try:
            check(v)
        except ConfigError:
            return False
        return True
    return ok


# Bounds (each shown in its option's `accepted` text).
MAX_STEPS = 10**9          # steps, warm-up, validation interval, checkpoint interval: beyond any run
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # one week: datetime.timedelta and gloo's millisecond timeouts hold it

# ------------------------------------------------------------------------------------- mixed precision's words
_NO_AMP = {"none", "no", "fp32", "float32", "off", "false"}
_AMP = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16", "auto": "auto",
        "true": "auto"}
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "none"}
PRECISIONS = ("none", "bf16", "fp16", "auto")


def precision_mode(value: Any) -> Any:
    """'none' | 'bf16' | 'fp16' | 'auto' from its spellings: False/None/'fp32'/'no'/'off', True, names, torch dtypes
    (recognised by name: no torch here); anything else is returned as it is (and refused by the check)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "auto"
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return _DTYPES.get(str(value), value)
    if isinstance(value, str):
        low = value.strip().lower()
        return "none" if low in _NO_AMP else _AMP.get(low, value)
    return value


# ================================================================== the options behind both doors, by section
# [train]  (OptimizedTrainer: StepOptions, RunOptions)
GRAD_ACCUM = Option(1, "micro-batches per optimizer step (only the last one communicates)",
                    "an integer from 1 to 65,536", within(1, 65536), rule="grad_accum")
CLIP_GRAD = Option(1.0, "gradient-norm clipping threshold (0 = off: the norm is only measured)",
                   "0 (off) or a number from 1e-6 to 1e6 (a smaller threshold scales every gradient to nothing)",
                   lambda v: v == 0 or 1e-6 <= v <= 1e6)
MIXED_PRECISION = Option("auto", "autocast dtype: auto (bf16 on a GPU that has it, else none), none, bf16, fp16 "
                         "(GPU, with GradScaler)",
                         "one of: none, bf16, fp16, auto (also spelled false/fp32/no/off, bfloat16, float16/half, "
                         "true = auto; in Python also None and torch.bfloat16 / torch.float16 / torch.float32)",
                         lambda v: isinstance(v, str) and v in PRECISIONS, parse=precision_mode,
                         rule="mixed_precision")
COMPILE = Option(False, "torch.compile the model (kernel fusion; on a GPU see docs/gpu.md for what it gains per "
                 "preset)", "true or false")
ACTIVATION_CHECKPOINTING = Option(False, "recompute each block's activations in backward", "true or false")
# (train.dynamic_batch's threshold: DynamicBatcher(memory_threshold=) in the Python API)
MEMORY_THRESHOLD = Option(0.9, "with dynamic_batch: the share of device memory (GPU) or of the memory limit (CPU: "
                          "cgroup/RAM) a step may peak at before the micro-batch shrinks",
                          "a number in (0, 1] (1 = only a real out-of-memory counts)", lambda v: 0 < v <= 1)
VAL_INTERVAL = Option(50, "validate every N steps, and at the end (0 = only at the end)",
                      f"an integer from 0 to {MAX_STEPS:,}", within(0, MAX_STEPS), api_default=0)
LOG_INTERVAL = Option(10, "plain output (not a terminal: a log file, a pipe, CI): a progress line every N steps, "
                      "and always for the first step and the last", f"an integer from 1 to {MAX_STEPS:,}",
                      within(1, MAX_STEPS))

# [dist]  (CommOptions, FaultOptions)
# Lower bound 0.001 MB (1 KB, 256 fp32 values): DDP rounds the cap to bytes and a smaller one puts every gradient in
# a bucket of its own (1e-300 is 0 bytes), one collective per tensor; the tests' smallest is 0.001.
BUCKET_CAP = Option(BUCKET_CAP_MB, "DDP gradient bucket size in MB",
                    "a number in [0.001, 10000] (1 KB at least: below that every tensor is a bucket of its own)",
                    within(0.001, 10_000))
COLLECTIVE_TIMEOUT = Option(300.0, "a collective that takes longer fails with a message (OptimizedTrainer: None = "
                            "torch's own timeout)", f"a number of seconds from 1 to {MAX_TIMEOUT_S:,.0f} s (one week)",
                            within(1, MAX_TIMEOUT_S), api_default=None)
# [compress]  (CommOptions)
MIN_NUMEL_OPTION = Option(MIN_NUMEL, "tensors with fewer elements (norms, biases) are sent uncompressed",
                          "an integer from 0 to 2,147,483,647", within(0, 2**31 - 1))
# [ckpt]  (FaultOptions)
PREEMPT_GRACE = Option(60.0, "on SIGTERM or SIGUSR1 (a scheduler's preemption or time-limit warning) every worker "
                       "finishes its step, saves a checkpoint and exits with code 83 within this many seconds, else "
                       "exits with 84 (docs/launch.md); 0 (OptimizedTrainer: or None) = the signals are left alone: "
                       "they end the run at once, unsaved",
                       "a number of seconds from 0 to 86,400 (keep it below the scheduler's own grace: Slurm's "
                       "KillWait or --signal lead time, Kubernetes' terminationGracePeriodSeconds)",
                       within(0, 86_400))
# [profile]  (RunOptions): torch profiler traces into RUN_DIR/traces (docs/doctor.md); the pair's rule is
# profiling.check_pair
PROFILE_STEPS = Option("", "record steps A to B ('A:B', or 'A' for one step) with torch.profiler; '' = off",
                       STEPS_ACCEPTED, grammar(parse_steps), api_default=None)
PROFILE_EVERY = Option(0, "record one step in N (steps N, 2N, ...) over a long run; 0 = off", EVERY_ACCEPTED,
                       grammar(check_every))
