"""DynamicBatcher: the largest micro-batch that fits, found by probing, and backed off on out-of-memory.

The user's batch size ``B`` (the global batch per rank) never changes: each loader batch is split into
micro-batches of the current micro size and their gradients are accumulated, each chunk's loss weighted by
``chunk_rows / B`` (and ``1 / n`` for ``n`` loader batches per step), so the accumulated gradient, the
optimizer step and the loss curve are those of the full batch whatever the micro size is.

* :meth:`DynamicBatcher.find` grows a probe size from ``initial_size`` by ``growth_factor`` until the probe
  runs out of memory, crosses ``memory_threshold`` or reaches ``max_size`` (as Lightning's batch-size finder
  does), then binary-searches between the last size that fit and the first that did not (``mode=
  "binsearch"``, the default: the exact largest size that fits) or keeps the last power (``mode="power"``).
* :meth:`DynamicBatcher.accumulate` runs one optimizer step's forward/backward passes. On out-of-memory in a
  chunk it drops the attempt, frees memory, zeroes the gradients, shrinks the micro size and redoes the step
  from the same batches (already in memory): neither the step nor the data position is lost. After a step
  whose peak memory crossed ``memory_threshold`` it shrinks for the next step, so out-of-memory is rare.
  Under DDP the last chunk's backward all-reduces the gradients; an out-of-memory there cannot be retried
  by one rank alone, and raises :class:`DynamicBatchOOMError` (see docs/dynamic-batch.md).

Memory is read on CUDA from ``torch.cuda.max_memory_allocated`` (the step's peak) plus what other processes
hold (``torch.cuda.mem_get_info``), against the device's memory; on CPU from the process's peak RSS (VmHWM,
reset per step via ``/proc/self/clear_refs``; VmRSS or psutil where that is unavailable) against the cgroup
memory limit or the machine's RAM, and its address space against ``RLIMIT_AS`` when one is set.
Out-of-memory is ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), the CPU allocator's
"can't allocate memory" ``RuntimeError`` and Python's ``MemoryError``.
"""
from __future__ import annotations

import gc
import math
import resource
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch

from ..errors import ConfigError, SyncwiseError
from ..schema import MEMORY_THRESHOLD
from ..specs import count

__all__ = ["DynamicBatcher", "DynamicBatchOOMError", "SizeChange", "is_oom_error"]

# Messages of out-of-memory failures that are not torch.OutOfMemoryError (the CPU allocator's, and the CUDA
# libraries' that report allocation failures as plain RuntimeErrors), as Lightning's is_oom_error lists them.
_OOM_MESSAGES = ("can't allocate memory", "cuda out of memory", "cuda error: out of memory",
                 "cublas_status_alloc_failed", "cudnn_status_alloc_failed")
_MODES = ("binsearch", "power")


class DynamicBatchOOMError(SyncwiseError):
    """Out of memory where a retry is impossible: in the chunk that syncs gradients (other ranks are already
    inside its all-reduce), at a micro size of 1, or when no probe size fits. ``micro_size`` is the size that
    failed; ``suggested_max_size`` the largest one to try (pass it as ``max_size``)."""

    def __init__(self, message: str, micro_size: int, suggested_max_size: int):
        self.micro_size, self.suggested_max_size = micro_size, suggested_max_size
        super().__init__(message)


class SizeChange(NamedTuple):
    """One change of the micro size, for logs: at optimizer step ``step`` (0: before training)."""

    step: int
    old: int
    new: int
    reason: str


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory failure (CUDA, the CPU allocator, Python)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(m in text for m in _OOM_MESSAGES)
    return False


def _proc_status() -> dict[str, int]:
    """The Vm* lines of /proc/self/status, in bytes ({} off Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Vm"):
                    key, _, rest = line.partition(":")
                    parts = rest.split()
                    if parts and parts[0].isdigit():
                        out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _total_ram() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional; not a dependency

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def cpu_memory_limit() -> Optional[int]:
    """The RAM this process may use: the cgroup's memory limit (v2, else v1) or the machine's RAM, smallest."""
    limits = [v for v in (_read_int("/sys/fs/cgroup/memory.max"),
                          _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"), _total_ram())
              if v is not None and 0 < v < (1 << 60)]  # cgroup v1 writes a huge number for no limit
    return min(limits) if limits else None


def _address_space_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


class DynamicBatcher:
    """Largest fitting micro-batch, gradient accumulation at a constant global batch, out-of-memory back-off.

    Seed API: ``DynamicBatcher(initial_size, max_size, growth_factor=2.0, memory_threshold=0.9, device=None)``.

    Args:
        initial_size: the first micro size the finder tries (and the micro size before :meth:`find` or
            :meth:`load_state_dict`).
        max_size: the largest micro size ever used (also capped by the batch's rows).
        growth_factor: > 1; the finder multiplies the size by it, a back-off divides by it (at least 1 less).
        memory_threshold: in (0, 1]; a probe whose peak memory is above this fraction of the limit does not
            fit, and a training step above it shrinks the micro size for the next step. 1.0 turns the
            threshold off (only real out-of-memory counts).
        device: the device whose memory is read (default: the current CUDA device when CUDA is available,
            else the CPU). Pass the trainer's device.
        mode: ``"binsearch"`` (the finder returns the exact largest size that fits, up to ``max_size``) or
            ``"power"`` (the largest ``initial_size * growth_factor**k`` that fits).
        grow_after: 0 (default: never grow during training) or N: after N consecutive steps whose peak is
            under the threshold, grow by ``growth_factor`` (capped at ``max_size`` and below the smallest size
            that ever ran out of memory, so it never retries a size known to fail).
        memory_limit_bytes: the limit memory fractions are taken against, instead of the detected one
            (device memory on CUDA; cgroup limit / RAM / RLIMIT_AS on CPU).
    """

    def __init__(self, initial_size: int, max_size: int, growth_factor: float = 2.0,
                 memory_threshold: float = MEMORY_THRESHOLD.default,
                 device: Any = None, *, mode: str = "binsearch", grow_after: int = 0,
                 memory_limit_bytes: Optional[int] = None):
        self.initial_size = count("initial_size", initial_size)
        self.max_size = count("max_size", max_size)
        if self.max_size < self.initial_size:
            raise ConfigError("max_size", max_size, f"an integer ≥ initial_size ({self.initial_size})")
        ok = isinstance(growth_factor, (int, float)) and not isinstance(growth_factor, bool) \
            and math.isfinite(growth_factor) and growth_factor > 1
        if not ok:
            raise ConfigError("growth_factor", growth_factor, "a finite number > 1")
        self.growth_factor = float(growth_factor)
        # the command line's train.memory_threshold too: one rule (syncwise.schema)
        self.memory_threshold = float(MEMORY_THRESHOLD.validate("memory_threshold", memory_threshold, float))
        if mode not in _MODES:
            raise ConfigError("mode", mode, "'binsearch' (exact largest size) or 'power' (largest power of "
                              "growth_factor times initial_size)")
        self.mode = mode
        self.grow_after = count("grow_after", grow_after, minimum=0)
        if memory_limit_bytes is not None:
            count("memory_limit_bytes", memory_limit_bytes)
        self.memory_limit_bytes = memory_limit_bytes
        try:
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                    else torch.device("cpu")
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError("device", device, f"a torch device ('cpu', 'cuda', 'cuda:0'): {e}") from None
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

        self.size = self.initial_size      # the current micro size
        self.found = False                 # find() ran or a state was loaded: no need to probe
        self.ceiling: Optional[int] = None  # the smallest size that ran out of memory (growth stays below it)
        self.steps = 0                     # successful accumulate() calls
        self.retries = 0                   # steps redone after out-of-memory
        self.history: list[SizeChange] = []
        self._good_steps = 0
        self._peak_reset_ok: Optional[bool] = None
        self._repeats = 2
        self._cpu_limit: Optional[int] = None

    # ------------------------------------------------------------------------------------------ finding
    def find(self, probe: Callable[[int], Any], batch_size: Optional[int] = None, *,
             agree: Optional[Callable[[int], int]] = None, zero_grad: Optional[Callable[[], Any]] = None,
             repeats: int = 2) -> int:
        """Probe micro sizes and set :attr:`size` to the largest that fits; return it.

        ``probe(n)`` runs a forward and backward pass on ``n`` rows of the worst-case shape (under DDP: on the
        plain module, ``ddp.module``, so it runs no collective: ranks may probe different sizes) and leaves
        its gradients: each size is probed ``repeats`` times (default 2) before
        ``zero_grad()`` frees them, so the second pass accumulates into existing gradients as every chunk
        after a step's first does (that peak is one gradient-sized buffer higher than the first chunk's).
        ``batch_size`` caps the search (a micro-batch never exceeds the batch). ``agree(n)`` makes the ranks
        agree (the trainer passes an all-reduce of the minimum); every rank must call ``find``. Raises
        :class:`DynamicBatchOOMError` when not even one row fits (on every rank, after agreeing).
        """
        self._repeats = count("repeats", repeats)
        cap = self.max_size if batch_size is None else min(self.max_size, count("batch_size", batch_size))
        n = min(self.initial_size, cap)
        fit, fail = 0, None
        while True:
            if self._fits(probe, n, zero_grad):
                fit = n
                if n >= cap:
                    break
                n = min(cap, self._grown(n))
            else:
                fail = n
                break
        if fail is not None:
            if self.mode == "binsearch":
                lo, hi = fit, fail
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self._fits(probe, mid, zero_grad):
                        lo = mid
                    else:
                        hi = mid
                fit, fail = lo, hi
            elif fit == 0:  # power: the initial size failed; go down by the same factor
                while n > 1:
                    n = self._shrunk(n)
                    if self._fits(probe, n, zero_grad):
                        fit = n
                        break
                    fail = n
        if agree is not None:
            fit = int(agree(fit))
        if fit < 1:
            raise DynamicBatchOOMError(
                "dynamic batch: a micro-batch of 1 row does not fit in memory (on this rank or another); the "
                "model, its optimizer state or the sequence length must shrink", micro_size=1, suggested_max_size=1)
        if fail is not None and fail > fit:
            self.ceiling = fail if self.ceiling is None else min(self.ceiling, fail)
        self._set(fit, "probe" + (f": {fail} rows did not fit" if fail is not None else f": up to {cap} fit"),
                  step=self.steps)
        self.found = True
        return fit

    def _fits(self, probe: Callable[[int], Any], n: int, zero_grad: Optional[Callable[[], Any]]) -> bool:
        self._reset_peak()
        oom = False
        try:
            for _ in range(self._repeats):
                probe(n)
        except BaseException as e:  # noqa: B036 - re-raised unless it is out-of-memory
            if not is_oom_error(e):
                raise
            oom = True
        # Outside the except block: the exception and its frames (which hold the probe's tensors) are gone.
        usage = None if oom else self._usage_if_thresholded()
        if zero_grad is not None:
            zero_grad()
        if oom:
            self.free_memory()
        return not oom and (usage is None or usage <= self.memory_threshold)

    # ----------------------------------------------------------------------------------------- training
    def accumulate(self, batches: Iterable[tuple[Any, Any]],
                   run_micro: Callable[[Any, Any, float, bool], Any], zero_grad: Callable[[], Any], *,
                   syncs: bool = False, step: Optional[int] = None) -> Any:
        """Forward/backward one optimizer step's loader batches in micro-batches; return the summed losses.

        ``batches``: the step's loader batches, ``(inputs, targets)`` each (``grad_accum_steps`` of them; a
        list with one pair without accumulation); inputs/targets are tensors or tuples/lists/dicts of tensors
        split along dim 0 (the trainer's mapping batch is ``(dict, KWARGS)``: the dict is split, the marker
        goes to every chunk; syncwise.train.batches). ``run_micro(inputs, targets, weight, is_last)`` computes
        ``loss = loss_fn(model(inputs), targets) * weight``, runs its backward (outside ``no_sync`` only when
        ``is_last``) and returns the loss (detached or not; its sum is returned, or None if it returns None).
        ``weight = chunk_rows / batch_rows / len(batches)``, so the accumulated gradient equals the full
        batch's whatever the micro size. ``zero_grad()`` clears the gradients before a step is redone.
        ``syncs``: the last chunk's backward runs a collective (DDP gradient sync); out-of-memory there raises
        :class:`DynamicBatchOOMError` instead of retrying. ``step``: the step number for :attr:`history`.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("accumulate() needs at least one (inputs, targets) batch")
        for b in batches:
            if not (isinstance(b, (tuple, list)) and len(b) == 2):
                raise TypeError("accumulate() takes a list of (inputs, targets) pairs, e.g. [(inputs, targets)]")
        step = self.steps + 1 if step is None else step
        rows = [_rows(x) for x, _ in batches]
        while True:
            size = self.size
            self._reset_peak()
            total, oom, oom_in_last, message = None, False, False, ""
            try:
                for inputs, targets, weight, last in self._plan(batches, rows, size):
                    oom_in_last = last
                    out = run_micro(inputs, targets, weight, last)
                    if out is not None:
                        out = out.detach() if isinstance(out, torch.Tensor) else out
                        total = out if total is None else total + out
                    del inputs, targets, out
            except BaseException as e:  # noqa: B036 - re-raised unless it is out-of-memory
                if not is_oom_error(e):
                    raise
                oom, message = True, str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            if not oom:
                break
            # Outside the except block, so the traceback's frames (and the attempt's tensors) are released.
            total = None
            zero_grad()
            self.free_memory()
            failed = min(size, max(rows))  # the rows of the chunks that ran out of memory
            self.ceiling = failed if self.ceiling is None else min(self.ceiling, failed)
            self._good_steps = 0
            if oom_in_last and syncs:
                suggested = self._shrunk(failed)
                self._set(suggested, f"out of memory in the gradient-syncing chunk ({message})", step)
                raise DynamicBatchOOMError(
                    f"dynamic batch: out of memory at micro-batch size {failed} in the chunk that syncs gradients "
                    f"(step {step}); the other ranks are already in its all-reduce, so the step cannot be redone "
                    f"on this rank alone. Restart with max_size={suggested} (or a lower memory_threshold) "
                    f"[{message}]", micro_size=failed, suggested_max_size=suggested)
            if failed <= 1:
                raise DynamicBatchOOMError(
                    f"dynamic batch: out of memory at micro-batch size 1 (step {step}); nothing smaller to try "
                    f"[{message}]", micro_size=1, suggested_max_size=1)
            self.retries += 1
            self._set(self._shrunk(failed), f"out of memory ({message})", step)
        self.steps += 1
        self._after_step(step, max(rows))
        return total

    def chunks(self, inputs: Any, targets: Any, size: Optional[int] = None) -> list[tuple[Any, Any, float]]:
        """One batch split into ``(inputs, targets, weight)`` micro-batches of ``size`` (default: the current
        size) rows, the last possibly smaller; the weights (``chunk_rows / rows``) sum to 1."""
        rows = _rows(inputs)
        return [(x, y, w) for x, y, w, _ in self._plan([(inputs, targets)], [rows], size or self.size)]

    def _plan(self, batches: Sequence[tuple[Any, Any]], rows: list[int], size: int):
        n = len(batches)
        for i, ((inputs, targets), r) in enumerate(zip(batches, rows)):
            for start in range(0, r, size):
                end = min(r, start + size)
                last = i == n - 1 and end == r
                yield _slice(inputs, start, end), _slice(targets, start, end), (end - start) / r / n, last

    def _after_step(self, step: int, rows: int) -> None:
        usage = self._usage_if_thresholded()
        if usage is not None and usage > self.memory_threshold:
            self._good_steps = 0
            if self.size > 1 and rows > 1:
                self._set(self._shrunk(min(self.size, rows)),
                          f"peak memory {usage:.0%} of the limit > memory_threshold {self.memory_threshold:.0%}",
                          step)
            return
        if not self.grow_after or self.size >= min(self.max_size, rows):
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.grow_after:
            self._good_steps = 0
            target = min(self.max_size, rows, self._grown(self.size))
            if self.ceiling is not None:
                target = min(target, self.ceiling - 1)
            if target > self.size:
                self._set(target, f"grow after {self.grow_after} steps under memory_threshold", step)

    # ------------------------------------------------------------------------------------------- sizes
    def _grown(self, n: int) -> int:
        return max(n + 1, int(n * self.growth_factor))

    def _shrunk(self, n: int) -> int:
        return max(1, min(n - 1, int(n / self.growth_factor)))

    def _set(self, new: int, reason: str, step: int) -> None:
        new = max(1, min(int(new), self.max_size))
        if new != self.size or reason.startswith("probe"):
            self.history.append(SizeChange(int(step), self.size, new, reason))
        self.size = new

    # ------------------------------------------------------------------------------------------ memory
    def free_memory(self) -> None:
        """Collect garbage and hand cached CUDA blocks back (after out-of-memory or a probe)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_limit(self) -> Optional[int]:
        """The bytes memory fractions are taken against (``memory_limit_bytes`` when given)."""
        if self.memory_limit_bytes is not None:
            return self.memory_limit_bytes
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[1])
        if self.device.type == "cpu":
            if self._cpu_limit is None:
                self._cpu_limit = cpu_memory_limit()
            return self._cpu_limit
        return None

    def memory_usage(self) -> Optional[float]:
        """Peak memory since the last reset (the start of the step or probe) as a fraction of the limit; None
        where it cannot be read (devices other than CPU and CUDA)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            others = max(0, total - free - reserved)  # other processes, the CUDA context
            used = torch.cuda.max_memory_allocated(self.device) + others
            return used / (self.memory_limit_bytes or total)
        if self.device.type != "cpu":
            return None
        status = _proc_status()
        rss = status.get("VmHWM" if self._peak_reset_ok else "VmRSS") or status.get("VmRSS")
        if rss is None:
            try:
                import psutil  # optional; not a dependency

                rss = int(psutil.Process().memory_info().rss)
            except Exception:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the lifetime peak (Linux: KiB)
        limit = self.memory_limit()
        usage = rss / limit if limit else None
        if self.memory_limit_bytes is None:
            as_limit = _address_space_limit()
            if as_limit and "VmSize" in status:  # RLIMIT_AS bounds address space, not RSS
                usage = max(usage or 0.0, status["VmSize"] / as_limit)
        return usage

    def _usage_if_thresholded(self) -> Optional[float]:
        return self.memory_usage() if self.memory_threshold < 1 else None

    def _reset_peak(self) -> None:
        if self.memory_threshold >= 1:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu" and self._peak_reset_ok is not False:
            try:  # "5" resets this process's peak RSS (VmHWM) to its current RSS (Linux ≥ 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self._peak_reset_ok = True
            except OSError:
                self._peak_reset_ok = False  # then the current RSS (after the step) is what is read

    # -------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The current micro size and what led to it (per rank: ranks may use different sizes)."""
        return {"size": self.size, "found": self.found, "ceiling": self.ceiling, "steps": self.steps,
                "retries": self.retries, "good_steps": self._good_steps,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume with the saved micro size (no re-probe), capped at this run's ``max_size``."""
        self.history = [SizeChange(int(s), int(o), int(n), str(r)) for s, o, n, r in state.get("history", [])]
        self.ceiling = None if state.get("ceiling") is None else int(state["ceiling"])
        self.steps = int(state.get("steps", 0))
        self.retries = int(state.get("retries", 0))
        self._good_steps = int(state.get("good_steps", 0))
        self.found = True  # a resumed run keeps its size (and its back-offs) instead of probing again
        saved = int(state["size"])
        self.size = saved
        if saved > self.max_size:
            self._set(self.max_size, f"resumed with max_size={self.max_size} < the saved size {saved}", self.steps)

    def __repr__(self) -> str:
        return (f"DynamicBatcher(size={self.size}, initial_size={self.initial_size}, max_size={self.max_size}, "
                f"growth_factor={self.growth_factor:g}, memory_threshold={self.memory_threshold:g}, "
                f"device={self.device})")


def _rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError("a batch tensor needs a batch dimension (dim 0)")
        return int(x.size(0))
    if isinstance(x, dict):
        for v in x.values():
            return _rows(v)
    if isinstance(x, (tuple, list)) and x:
        return _rows(x[0])
    raise TypeError(f"cannot split a batch of type {type(x).__name__}: pass tensors, or tuples/lists/dicts of them")


def _slice(x: Any, start: int, end: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x[start:end]
    if isinstance(x, dict):
        return {k: _slice(v, start, end) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_slice(v, start, end) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(v, start, end) for v in x)
    return x  # non-tensor leaves (flags, lengths) go to every chunk unchanged
