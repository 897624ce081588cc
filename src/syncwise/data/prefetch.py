"""SmartPrefetcher: a background thread keeps the next batches ready (pinned and already copied to
the GPU on CUDA) while the current step computes, without breaking exact resume."""
from __future__ import annotations

import copy
import threading
import time
from collections import deque
from typing import Any, Iterable, Iterator

import torch

from .. import devices
from ..errors import ConfigError


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class SmartPrefetcher:
    """Iterate ``loader`` through a bounded background queue of ``lookahead`` batches.

    Yields exactly the loader's batches in the loader's order. ``state_dict()`` is the loader's state
    right after the last batch *handed to the consumer* (not the ones prefetched), so saving it in a
    checkpoint and loading it resumes exactly. On CUDA, batches are pinned and copied on a side
    stream with ``non_blocking=True``; the consumer's stream waits on that copy. ``pattern_detection``
    adapts the queue depth: each time the consumer finds the queue empty, the depth grows by one (up
    to ``max_lookahead``), which absorbs bursty loaders (slow file reads, tokenization spikes); it
    cannot help a loader that is slower than the step on average (see ``stats()``).
    Use as a context manager or call ``close()``; the thread is a daemon either way.
    """

    def __init__(self, loader: Iterable, lookahead: int = 2, pin_memory: bool | None = None,
                 device: str | torch.device | None = None, pattern_detection: bool = False,
                 max_lookahead: int = 8):
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 1:
            raise ConfigError("data.prefetch", lookahead, "a positive integer number of batches to prefetch")
        if pattern_detection and (not isinstance(max_lookahead, int) or max_lookahead < lookahead):
            raise ConfigError("data.max_lookahead", max_lookahead, f"an integer >= lookahead ({lookahead})")
        self.loader = loader
        # 'cuda' without an index is the current CUDA device of the constructing thread (the producer thread
        # must be told which one); CUDA on a machine without it fails here, not in the producer thread.
        self.device = devices.resolve(device, "device") if device is not None else None
        cuda = self.device is not None and self.device.type == "cuda"
        # Pinning only pays (and only works) when a host-to-GPU copy follows.
        self.pin_memory = cuda if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        self._cuda = cuda
        self.pattern_detection = bool(pattern_detection)
        self.max_lookahead = max_lookahead if pattern_detection else lookahead
        self.lookahead = lookahead
        self._cond = threading.Condition()
        self._buf: deque[tuple[str, Any, Any, Any]] = deque()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._error: BaseException | None = None
        self._exhausted = False
        self._stateful = callable(getattr(loader, "state_dict", None))
        self._state = self._snapshot()
        self._stats = {"batches": 0, "wait_s": 0.0, "starved": 0, "produce_s": 0.0}

    # -- producer ---------------------------------------------------------------------------------
    def _snapshot(self) -> Any:
        return copy.deepcopy(self.loader.state_dict()) if self._stateful else None

    def _to_device(self, batch: Any) -> tuple[Any, Any]:
        if self.pin_memory:
            batch = _map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
        if self.device is None:
            return batch, None
        if not self._cuda:
            return _map_tensors(batch, lambda t: t.to(self.device)), None
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            batch = _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(stream)
        return batch, event

    def _produce(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        try:
            it = iter(self.loader)
            while True:
                with self._cond:
                    while len(self._buf) >= self.lookahead and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    self._put(("end", None, None, None))
                    return
                state = self._snapshot()  # the loader's position right after this batch
                batch, event = self._to_device(batch)
                self._stats["produce_s"] += time.perf_counter() - t0
                self._put(("batch", batch, state, event))
        except BaseException as exc:  # handed to the consumer, which re-raises it in its own thread
            self._put(("error", exc, None, None))

    def _put(self, item: tuple[str, Any, Any, Any]) -> None:
        with self._cond:
            self._buf.append(item)
            self._cond.notify_all()

    def _start(self) -> None:
        self._stop = False
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._thread = threading.Thread(target=self._produce, name="syncwise-prefetch", daemon=True)
        self._thread.start()

    # -- consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise RuntimeError("SmartPrefetcher is closed")
        if self._error is not None:
            raise self._error
        if self._exhausted:
            raise StopIteration
        if self._thread is None:
            self._start()
        t0 = time.perf_counter()
        with self._cond:
            starved = not self._buf
            while not self._buf:
                self._cond.wait(timeout=1.0)
                if not self._buf and not self._thread.is_alive():  # cannot happen, but never hang
                    raise RuntimeError("SmartPrefetcher: the producer thread died without a result")
            kind, payload, state, event = self._buf.popleft()
            if starved and self.pattern_detection and self.lookahead < self.max_lookahead:
                self.lookahead += 1
            self._cond.notify_all()
        self._stats["wait_s"] += time.perf_counter() - t0
        if kind == "error":
            self._error = payload
            raise payload
        if kind == "end":
            self._exhausted = True
            raise StopIteration
        self._stats["batches"] += 1
        self._stats["starved"] += int(starved)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            # The tensors were allocated on the copy stream: tell the allocator they are used here.
            _map_tensors(payload, lambda t: t.record_stream(current) if t.is_cuda else None)
        self._state = state
        return payload

    # -- state and lifetime -----------------------------------------------------------------------
    @property
    def epoch(self) -> int | None:
        """Epoch of the last batch handed out (from the loader's state), if the loader has one."""
        return self._state.get("epoch") if isinstance(self._state, dict) else None

    def __len__(self) -> int:
        """The wrapped loader's length (batches per epoch)."""
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> Any:
        """The loader's state after the last batch handed to the consumer (prefetched ones excluded)."""
        if not self._stateful:
            raise TypeError(f"{type(self.loader).__name__} has no state_dict(); it cannot be resumed")
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: Any) -> None:
        """Drop prefetched batches, restore the loader, and prefetch again from ``state``."""
        if not self._stateful:
            raise TypeError(f"{type(self.loader).__name__} has no load_state_dict(); it cannot be resumed")
        self._shutdown()
        if self._thread is not None:  # still inside a slow next(): loading now would race with it
            raise RuntimeError("SmartPrefetcher: the loader did not stop within 30 s; cannot load state")
        self.loader.load_state_dict(state)  # type: ignore[union-attr]
        self._state = self._snapshot()
        self._error, self._exhausted = None, False

    def stats(self) -> dict[str, float]:
        """Batches handed out, time the consumer waited, how often it found the queue empty, and the
        current depth: a high wait share means the loader, not the step, is the bottleneck."""
        return dict(self._stats, lookahead=self.lookahead)

    def _shutdown(self) -> None:
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            # The producer stops at its next queue check; one batch in flight at most.
            thread.join(timeout=30.0)
        with self._cond:
            self._buf.clear()
        self._thread = thread if thread is not None and thread.is_alive() else None

    def close(self) -> None:
        """Stop the background thread and drop prefetched batches."""
        if not self._closed:
            self._shutdown()
            self._closed = True

    def __enter__(self) -> "SmartPrefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
