"""The compressor protocol: pure tensor code, explicit per-tensor state, collectives via comm.ops.

A compressor averages a *bucket* (a list of gradient tensors) across a process group, in place.
Every collective goes through :mod:`syncwise.comm.ops` into the compressor's ``stats`` (its own CommStats, or a
run's ``ledger.dp``), which counts the compressed payload that really crossed the wire. State (error-feedback
residuals, PowerSGD Q matrices, per-tensor step counters) is keyed by a stable tensor name, so a checkpoint taken
on one run resumes on the next even if DDP rebuilds its buckets.

A bucket that holds NaN/Inf on ANY rank is skipped on EVERY rank: each compressor carries a
"non-finite" flag inside the payload it already sends (4 bytes; no extra round trip), every rank
reads the same gathered/summed flags, and on a bad bucket all ranks fill it with NaN (the trainer
then skips the step everywhere) and leave their state — residuals, Q matrices, step counters —
untouched. Deciding locally would make ranks send different payloads and hang the group.

That decision stays on the device (no host sync per bucket): the agreed flag is a 0-d bool tensor
``ok``; the averages are divided by ``where(ok, world, nan)`` and the new state is committed with
``torch.where(ok, new, old)``. A state entry a skipped step creates holds the value its absence
stands for (zeros for a residual or momentum, the seeded initial Q), so it behaves as if untouched.
Only the per-tensor step counters are host integers (they seed draws and gate PowerSGD's warm-up):
each bucket's ``ok`` is booked as a :class:`Verdict` (on CUDA copied to pinned memory behind an
event) and folded into the counters when a counter is next read — by the next step's draw for that
tensor, by :meth:`Compressor.state_dict`, by :attr:`Compressor.counters` — so the read waits for that
old event only, never for the work queued since.

Randomness never lives in a hidden generator: every random draw is seeded from
``(config.seed, tensor name, that tensor's step counter[, rank])`` with a generator on the tensor's
device (one cached per device, re-seeded per draw). The counters are checkpointed, so the generator
state is too: resuming from a state dict replays the same draws, and shared-seed schemes (random-k)
pick identical indices on all ranks of the same device type (a CUDA and a CPU generator seeded alike
produce different streams).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..comm import ops
from ..comm.stats import CommStats
from ..comm.hostread import HostCopy
from ..errors import ConfigError, SyncwiseError
from ..layout import COMPRESSORS


def opt(default: Any, doc: str) -> Any:
    """A config field with a one-line doc (shown by the CLI's compressor list)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass
class CompressorConfig:
    """Options shared by all compressors (subclasses add their own fields)."""

    seed: int = opt(*COMPRESSORS["none"].options["seed"][1:])


@dataclass
class WarmupConfig(CompressorConfig):
    """Options of the lossy compressors that can start uncompressed (issue 26: Adam's moments settle first)."""

    warmup: int = opt(*COMPRESSORS["topk"].options["warmup"][1:])

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError("compress", f"warmup={self.warmup}", "warmup: an integer >= 0 (steps sent uncompressed)")

    @property
    def start_iter(self) -> int:
        """The warm-up under PowerSGD's name, which the trainer's summary reads to report warm-up bytes apart."""
        return self.warmup


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def config_class(name: str, class_name: str, module: str) -> type:
    """The ``Config`` dataclass of compressor ``name``, made from its spec in the torch-free table
    (``syncwise.layout.COMPRESSORS``: option names, types, defaults and docs), which owns them; ``class_name`` in
    ``module`` is where it is bound (so it pickles). A compressor with a ``warmup`` option gets
    :class:`WarmupConfig`'s check and ``start_iter``."""
    spec = COMPRESSORS[name]
    base = WarmupConfig if "warmup" in spec.options else CompressorConfig
    inherited = {f.name for f in dataclasses.fields(base)}
    fields = [(key, _TYPES[typ], opt(default, doc)) for key, (typ, default, doc) in spec.options.items()
              if key not in inherited]
    cls = dataclasses.make_dataclass(class_name, fields, bases=(base,),
                                     namespace={"__doc__": f"Options of the {name} compressor "
                                                           "(syncwise.layout.COMPRESSORS)."})
    cls.__module__ = module
    return cls


class Compressor:
    """Base class: average a bucket of tensors across a group, with explicit, checkpointable state.

    Subclasses set ``name`` / ``Config`` and implement :meth:`_average` (tensors to compress plus
    tensors the policy left uncompressed; both are averaged in place).
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type] = CompressorConfig
    #: nominal bytes per element on the wire (for docs/CLI); None when it depends on options. Set from the
    #: compressor's spec (syncwise.layout.COMPRESSORS) for the compressors listed there.
    bytes_per_element: ClassVar[Optional[float]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = COMPRESSORS.get(cls.__dict__.get("name", ""))
        if spec is not None:
            cls.bytes_per_element = spec.bytes_per_element
    #: set by single-collective compressors: the DDP hook then sends the bucket in this dtype directly
    wire_dtype: ClassVar[Optional[torch.dtype]] = None

    def __init__(self, config: Optional[CompressorConfig] = None, **kwargs: Any):
        if config is None:
            config = self.Config(**kwargs)
        elif kwargs:
            config = dataclasses.replace(config, **kwargs)
        self.config = config
        self._validate()
        # key -> {"count": int, and compressor-specific tensors}
        self._state: dict[str, dict[str, Any]] = {}
        # running totals: elements averaged and payload bytes this rank sent (read them via .counters)
        self._counters: dict[str, int] = {"elements": 0, "bytes_sent": 0, "collectives": 0}
        # where its collectives are counted: its own, until a run hands it its ledger's 'dp' (parallelize)
        self.stats = CommStats()
        self._transient()

    def _transient(self) -> None:
        """Caches that are not state: one generator per device, verdicts not folded into counters yet."""
        self._generators: dict[torch.device, torch.Generator] = {}
        self._verdicts: list[Verdict] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        return {k: v for k, v in self.__dict__.items() if k not in ("_generators", "_verdicts", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._transient()

    # ---- subclass interface -------------------------------------------------------------------
    def _validate(self) -> None:
        """Raise ConfigError for bad option values (subclasses extend)."""

    def _average(self, comp: list[torch.Tensor], keys: list[str], raw: list[torch.Tensor],
                 group: Any, world: int) -> "Union[bool, torch.Tensor]":
        """Average in place; return the verdict ``ok`` (True, or a 0-d bool tensor that stays on the
        device): False when some rank's bucket was non-finite — every rank gets the same — after filling
        the tensors with NaN and leaving the state as it was. Must not read a tensor on the host."""
        raise NotImplementedError

    # ---- public API ---------------------------------------------------------------------------
    def average(self, tensors: Sequence[torch.Tensor], keys: Sequence[str], group: Any = None,
                compress: Optional[Sequence[bool]] = None) -> Sequence[torch.Tensor]:
        """Average ``tensors`` across ``group`` in place; ``compress[i]=False`` sends tensor i as fp32.

        Must be called with the same tensor shapes/keys/flags, in the same order, on every rank.
        """
        if len(keys) != len(tensors):
            raise ValueError("average(): one key per tensor is required")
        comp, ckeys, raw = split_by_policy(tensors, keys, compress)
        booked = ckeys
        warm = getattr(self.config, "warmup", 0)
        if warm and comp:
            # Warm-up: a tensor's first ``warmup`` averaged steps go out as fp32 (its counter still counts them;
            # the counters are agreed on every rank, so every rank sends the same payload layout).
            cold = [self._count(k) < warm for k in ckeys]
            raw = list(raw) + [t for t, c in zip(comp, cold) if c]
            comp, ckeys = [t for t, c in zip(comp, cold) if not c], [k for k, c in zip(ckeys, cold) if not c]
        world = dist.get_world_size(group)
        self.book(self._average(comp, ckeys, raw, group, world), sum(t.numel() for t in tensors), booked)
        return tensors

    @property
    def has_error_feedback(self) -> bool:
        """True if this compressor keeps per-tensor residuals (its config has ``error_feedback`` on)."""
        return bool(getattr(self.config, "error_feedback", False))

    @property
    def counters(self) -> dict[str, int]:
        """Running totals: ``elements`` averaged (buckets skipped as non-finite not counted), ``bytes_sent``
        and ``collectives`` this rank issued (also in :attr:`stats`). Reading it folds every booked verdict,
        i.e. waits until the device has computed them."""
        self.settle()
        return self._counters

    # ---- verdicts: a bucket's "every rank was finite" flag, folded into the host counters later --------
    _MAX_VERDICTS: ClassVar[int] = 1024  # beyond this many unread verdicts, book() folds the finished ones

    def book(self, ok: "Union[bool, torch.Tensor]", elements: int, compressed_keys: Sequence[str]) -> None:
        """Book one bucket's verdict (``ok``: bool or 0-d bool tensor): if it holds, the bucket's element
        count and each compressed tensor's step counter go up. No host sync: a device flag is read when
        a counter is next needed (see :meth:`settle`)."""
        verdict = Verdict(ok, elements, compressed_keys)
        with self._lock:
            self._verdicts.append(verdict)
            if len(self._verdicts) > self._MAX_VERDICTS:
                self._fold_locked(lambda v: v.ready())  # old ones: their events are long done, no wait

    def settle(self, key: Optional[str] = None) -> None:
        """Fold booked verdicts into the counters: every one (waiting for the device) when ``key`` is None,
        else those that involve ``key`` (waiting for those only: on CUDA, for an event of an earlier step)."""
        with self._lock:
            if self._verdicts:
                self._fold_locked(None if key is None else (lambda v: key in v.keys))

    def _fold_locked(self, which: Optional[Callable[["Verdict"], bool]]) -> None:
        keep = []
        for v in self._verdicts:
            if which is not None and not which(v):
                keep.append(v)
            elif v.value():
                self._counters["elements"] += v.elements
                for k in v.keys:
                    self._slot(k)["count"] += 1
        self._verdicts = keep

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: name, config, and per-tensor state keyed by tensor name. The step counters
        in it seed every random draw, so they are the generators' state too (resume replays the draws)."""
        self.settle()
        return {
            "name": self.name,
            "config": dataclasses.asdict(self.config),
            "per_tensor": {k: {n: (v.detach().clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                           for k, s in self._state.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the compressor name must match)."""
        if state.get("name") != self.name:
            raise SyncwiseError(f"compressor state is for {state.get('name')!r}, not {self.name!r}: resume "
                                f"with the same --compress setting the checkpoint was written with")
        with self._lock:
            self._verdicts = []  # verdicts of the state being replaced
        self._state = {k: {n: (v.detach().clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                       for k, s in state.get("per_tensor", {}).items()}

    def reset_state(self) -> None:
        """Forget residuals, Q matrices and counters."""
        with self._lock:
            self._verdicts = []
        self._state.clear()

    def __repr__(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self.config, f.name)}" for f in dataclasses.fields(self.config))
        return f"{type(self).__name__}({self.name}:{opts})"

    # ---- helpers for subclasses ---------------------------------------------------------------
    def _slot(self, key: str) -> dict[str, Any]:
        s = self._state.get(key)
        if s is None:
            s = self._state[key] = {"count": 0}
        return s

    def _seed(self, *parts: object) -> int:
        """A 63-bit seed from the base seed and ``parts`` (stable across processes and runs)."""
        h = hashlib.blake2b(repr((self.config.seed,) + parts).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") & ((1 << 63) - 1)

    def _generator(self, *parts: object, device: Any = "cpu") -> torch.Generator:
        """A generator on ``device`` seeded from ``parts`` (one cached per device, re-seeded per draw)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        g = self._generators.get(dev)
        if g is None:
            g = self._generators[dev] = torch.Generator(device=dev)
        g.manual_seed(self._seed(*parts))
        return g

    def _residual(self, key: str, like: torch.Tensor) -> torch.Tensor:
        s = self._slot(key)
        r = s.get("residual")
        if r is None or r.shape != like.shape:
            r = s["residual"] = torch.zeros_like(like, dtype=torch.float32)
        elif r.device != like.device:  # loaded onto another device: move it once
            r = s["residual"] = r.to(like.device)
        return r

    def _count(self, key: str) -> int:
        """Averaged steps of tensor ``key`` (folds the verdicts of its earlier buckets first)."""
        self.settle(key)
        return self._slot(key)["count"]

    # collectives, counted here as well as in ``self.stats``
    def _all_reduce_sum(self, t: torch.Tensor, group: Any) -> None:
        self._counters["bytes_sent"] += t.numel() * t.element_size()
        self._counters["collectives"] += 1
        ops.all_reduce(t, "sum", group=group, stats=self.stats)

    def _all_gather(self, payload: torch.Tensor, group: Any, world: int, async_op: bool = False
                    ) -> "tuple[Any, torch.Tensor]":
        """(work handle or None, the world x payload result — valid once the work completed)."""
        out = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
        self._counters["bytes_sent"] += payload.numel() * payload.element_size()
        self._counters["collectives"] += 1
        work = ops.all_gather(out, payload, group=group, async_op=async_op, stats=self.stats)
        return work, out.view(world, payload.numel())

    def _average_raw_checked(self, raw: list[torch.Tensor], group: Any, world: int) -> "Union[bool, torch.Tensor]":
        """fp32 average of ``raw`` alone; a NaN/Inf on any rank makes the sum non-finite on every rank,
        so the sum itself is the agreed flag (the verdict: a 0-d bool tensor, True if all finite)."""
        if not raw:
            return True
        self._average_raw(raw, group, world)
        return ~nonfinite_flag(raw).bool()

    def _average_raw(self, raw: list[torch.Tensor], group: Any, world: int,
                     extra: Optional[torch.Tensor] = None, flag: Optional[torch.Tensor] = None
                     ) -> "tuple[Optional[torch.Tensor], Optional[torch.Tensor]]":
        """One fp32 all-reduce for the uncompressed tensors, plus an optional fp32 ``extra`` (returned
        summed, not averaged) and an optional non-finite ``flag`` (0-d, 1.0: this rank's bucket was bad,
        see :func:`nonfinite_flag`) riding in the same collective.

        Returns ``(summed extra or None, ok or None)``: ``ok`` (with a flag) is a 0-d bool on the device,
        False when some rank flagged its bucket — then ``raw`` comes back as NaN on every rank."""
        if not raw and extra is None and flag is None:
            return None, None
        if extra is None and flag is None:
            flat = flat_view(raw)
            if flat is not None and flat.dtype == torch.float32:
                # the tensors are adjacent views of one buffer (a DDP bucket): reduce it in place, no copy
                self._all_reduce_sum(flat, group)
                flat.div_(world)
                return None, None
        tail = [t.reshape(-1).float() for t in (extra, flag) if t is not None]
        buf = torch.cat([t.reshape(-1).float() for t in raw] + tail)
        self._all_reduce_sum(buf, group)
        n_raw = sum(t.numel() for t in raw)
        ok = None if flag is None else buf[-1] == 0
        if raw:
            unflatten_into(buf[:n_raw].div_(world if ok is None else divisor(ok, world)), raw)
        summed = None if extra is None else buf[n_raw:n_raw + extra.numel()]
        return summed, ok


class Verdict:
    """One averaged bucket's verdict (``ok``), its element count and compressed keys, readable later.

    The flag goes through :class:`syncwise.comm.hostread.HostCopy`: on CUDA copied to pinned memory behind an event,
    so reading it waits for that event only, not for the work queued after it (a plain ``.item()`` would wait for
    the whole stream: the rest of the backward pass)."""

    __slots__ = ("keys", "elements", "_copy")

    def __init__(self, ok: "Union[bool, torch.Tensor]", elements: int, keys: Sequence[str]):
        self.keys = frozenset(keys)
        self.elements = elements
        self._copy = HostCopy({"ok": ok})

    def ready(self) -> bool:
        """True if reading the verdict would not wait for the device."""
        return self._copy.ready()

    def value(self) -> bool:
        """The verdict (waits for its event on CUDA)."""
        return bool(self._copy.read()["ok"])


def fp32_matmul(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` (a matmul) in full fp32 precision whatever the global TF32 setting (the trainer turns TF32 on
    for the model on CUDA): on a GPU computed in fp64 and rounded to fp32 once — TF32's 10-bit mantissa would round
    PowerSGD's and DeMo's projections coarsely, differently per GPU model (issue 39 N13). Thread-safe, unlike
    toggling ``torch.backends.cuda.matmul.allow_tf32`` while the backward runs. On the CPU (no TF32): as given."""
    if tensors[0].device.type == "cuda":
        return fn(*(t.double() for t in tensors)).float()
    return fn(*tensors)


def rank_order_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows[0] + rows[1] + ...`` (world x n) added in rank order: the same fp32 bits on every rank and every GPU
    model (a reduction kernel's order depends on its launch configuration)."""
    out = rows[0].clone()
    for w in range(1, rows.shape[0]):
        out.add_(rows[w])
    return out


def divisor(ok: torch.Tensor, world: int) -> torch.Tensor:
    """0-d fp32 ``world`` if ``ok`` else NaN: dividing a sum by it averages it, or poisons it on every rank
    (the trainer's non-finite check then skips the step everywhere) without a host branch."""
    return torch.where(ok, float(world), float("nan"))


def nonfinite_flag(tensors: Sequence[torch.Tensor], device: Any = None) -> torch.Tensor:
    """0-d float32 tensor: 1.0 if any of ``tensors`` holds NaN/Inf, else 0.0 (no host sync). It rides in
    a compressor's own collective so every rank learns whether any rank's bucket was bad.

    ``aminmax`` propagates NaN and meets any Inf, and is ~20x cheaper than ``isfinite(t).all()`` on CPU."""
    ends = [torch.stack(torch.aminmax(t.reshape(-1))) for t in tensors if t.numel()]
    if not ends:
        return torch.zeros((), device=device if device is not None else (tensors[0].device if tensors else None))
    return (~torch.isfinite(torch.cat(ends).float()).all()).float()


def flat_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-D view covering ``tensors`` if they are adjacent contiguous views of one storage, else None."""
    if not tensors:
        return None
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return None
    try:
        base_storage = first.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() != base_storage for t in tensors):
            return None
    except RuntimeError:
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    total = offset - first.storage_offset()
    return first.as_strided((total,), (1,), first.storage_offset())


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Concatenate tensors into one flat buffer of ``dtype``."""
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (casting to their dtype)."""
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t))
        off += n


def split_by_policy(tensors: Sequence[torch.Tensor], keys: Sequence[str], compress: Optional[Sequence[bool]]
                    ) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor]]:
    """(tensors to compress, their keys, tensors to send as fp32); ``compress=None`` compresses all."""
    flags = [True] * len(tensors) if compress is None else list(compress)
    comp = [t for t, f in zip(tensors, flags) if f]
    ckeys = [k for k, f in zip(keys, flags) if f]
    raw = [t for t, f in zip(tensors, flags) if not f]
    return comp, ckeys, raw


def sizes_of(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Element counts of ``tensors``."""
    return [t.numel() for t in tensors]


@dataclass
class Packed:
    """One rank's all-gather payload for a bucket and what to do once everyone's payload is in."""

    payload: torch.Tensor  # encoded part, raw fp32 bytes, then the 4-byte non-finite flag
    encoded: int  # bytes of the encoded part
    #: stores the new error-feedback state where ``ok`` (0-d bool: every rank finite) holds, else keeps the old
    commit: Optional[Callable[[torch.Tensor], None]] = None
    #: tensors ``commit``/decode read that were made while packing (the staged residual): on CUDA the decode may
    #: run on another stream, which must ``record_stream`` them (comm.streams)
    streamed: tuple = ()
    #: the decode's fp32 output, allocated while packing (on the hook's thread), or None: the decode allocates it
    out: Optional[torch.Tensor] = None


_FLAG_BYTES = 4  # an int32 at the end of every gather payload: 1 if this rank's bucket held NaN/Inf


class GatherCompressor(Compressor):
    """Compressors whose payload cannot be summed on the wire (low-bit, sparse).

    Each rank encodes its (error-compensated) bucket into one fixed-size byte payload, followed by the
    tensors the policy left uncompressed as raw fp32 bytes and a 4-byte non-finite flag; the payloads
    are all-gathered in ONE collective, and every rank decodes and sums all of them locally in fp32 in
    rank order, so the result is bit-identical on all ranks. Error feedback (when
    ``config.error_feedback``) keeps ``residual = compensated - decode(own payload)`` per tensor name,
    stored only once every rank's flag says its bucket was finite.
    """

    #: a bucket is one all-gather and nothing else: the DDP hook issues it straight from the hook and
    #: decodes in the collective's callback, without the worker thread (fp8)
    direct: ClassVar[bool] = False

    def _encode(self, x: torch.Tensor, sizes: list[int], keys: list[str], rank: int
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return (uint8 payload of a size every rank agrees on, local decode or None if unneeded)."""
        raise NotImplementedError

    def _decode_sum(self, gathered: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
        """Sum of the decoded payloads of all ranks (``gathered`` is world x payload bytes). A compressor whose
        :meth:`_decode_buffer` gives a buffer also takes it as ``out=``."""
        raise NotImplementedError

    def _decode_buffer(self, n: int, device: torch.device) -> Optional[torch.Tensor]:
        """The fp32 buffer the decode of an ``n``-element bucket writes, made by :meth:`pack` — on the thread that
        packs, not on the collective's callback thread (see ``FP8Compressor._CHUNK``) — or None."""
        return None

    def _compensate(self, comp: list[torch.Tensor], keys: list[str]) -> torch.Tensor:
        """The vector to encode: a fresh copy (gradient + residual); must not change the state."""
        x = flatten(comp)
        if self.has_error_feedback:
            x.add_(flatten([self._residual(k, t) for k, t in zip(keys, comp)]))
        return x

    def _staged_state(self, comp: list[torch.Tensor], keys: list[str], x: torch.Tensor,
                      local: Optional[torch.Tensor]) -> Optional[Callable[[torch.Tensor], None]]:
        """The state update of this bucket, committed by ``unpack_sum`` where every rank was finite."""
        if not self.has_error_feedback:
            return None
        assert local is not None
        resid = x.sub_(local)
        return lambda ok: self._store_residuals(resid, comp, keys, ok)

    def pack(self, comp: list[torch.Tensor], keys: list[str], raw: list[torch.Tensor], rank: int) -> Packed:
        """This rank's payload for one all-gather: the encoded ``comp``, ``raw`` as fp32 bytes, the
        non-finite flag. The state is not touched here (see :class:`Packed`)."""
        parts, flags, encoded, staged, made, out = [], [], 0, None, (), None
        if comp:
            x = self._compensate(comp, keys)
            flags.append(nonfinite_flag([x]))  # before _staged_state reuses x for the residual
            payload, local = self._encode(x, sizes_of(comp), keys, rank)
            staged = self._staged_state(comp, keys, x, local)
            made = (x,) if local is None else (x, local)
            parts.append(payload)
            encoded = payload.numel()
            out = self._decode_buffer(x.numel(), x.device)
        if raw:
            flat = flatten(raw)
            flags.append(nonfinite_flag([flat]))
            parts.append(flat.view(torch.uint8))
        parts.append(torch.stack(flags).amax().to(torch.int32).reshape(1).view(torch.uint8))
        return Packed(torch.cat(parts), encoded, staged, made + (() if out is None else (out,)), out)

    def unpack_sum(self, gathered: torch.Tensor, packed: Packed, comp: list[torch.Tensor],
                   raw: list[torch.Tensor], world: int) -> torch.Tensor:
        """Write the averages of all ranks' payloads (``gathered``: world x payload bytes) into the tensors
        and commit the staged state; if any rank flagged its bucket non-finite, NaN and the old state
        instead (every rank sees the same flags, so every rank decides alike). Returns the verdict, a 0-d
        bool on the device: decided there, no host sync."""
        ok = gathered[:, -_FLAG_BYTES:].contiguous().view(torch.int32).eq(0).all()
        div = divisor(ok, world)
        encoded = packed.encoded
        if comp:
            sizes = sizes_of(comp)
            total = (self._decode_sum(gathered[:, :encoded], sizes, sum(sizes)) if packed.out is None
                     else self._decode_sum(gathered[:, :encoded], sizes, sum(sizes), out=packed.out))
            unflatten_into(total.div_(div), comp)
        if raw:
            values = gathered[:, encoded:-_FLAG_BYTES].contiguous().view(torch.float32)
            unflatten_into(rank_order_sum(values).div_(div), raw)
        if packed.commit is not None:
            packed.commit(ok)
        return ok

    def _average(self, comp, keys, raw, group, world):
        if not comp and not raw:
            return True
        packed = self.pack(comp, keys, raw, dist.get_rank(group))
        return self.unpack_sum(self._all_gather(packed.payload, group, world)[1], packed, comp, raw, world)

    def _store_residuals(self, resid: torch.Tensor, comp: list[torch.Tensor], keys: list[str],
                         ok: "Union[bool, torch.Tensor]" = True) -> None:
        off = 0
        for k, t in zip(keys, comp):
            n = t.numel()
            r = self._residual(k, t)
            commit(r, resid[off:off + n].view_as(t), ok)
            off += n


def commit(old: torch.Tensor, new: torch.Tensor, ok: "Union[bool, torch.Tensor]") -> None:
    """``old <- new`` where ``ok`` (a 0-d bool tensor decided on the device, or True) holds, in place."""
    if ok is True:
        old.copy_(new)
    else:
        torch.where(ok, new, old, out=old)
