"""Real tokenized data: documents from JSON lines, parquet, text files or a ``datasets`` on-disk dataset, tokenized
once by a Hugging Face tokenizer (``--data.tokenizer PATH``) into memory-mapped token shards.

The shards use the nanoGPT layout that :mod:`.corpus` already reads: ``train.bin``, ``val.bin`` and ``meta.json``
(``vocab_size``, ``dtype``: uint16 up to 65,536 ids, uint32 above). The existing batch loader then shards them
across ranks and resumes from its checkpointed position. The cache key covers the source's *content* (a blake2b
digest of every byte of every source file, with its size and relative name), its path, the tokenizer file, the
text column and the validation split: a corpus edited with its size and mtime kept (``cp -p``, ``rsync -t``) gets a
new cache. A file's digest is remembered under the cache folder keyed by its identity, size, mtime and ctime (which
no copy tool can set back), so an unchanged source is hashed once. The shards' token counts and digests go into
meta.json, and every open checks them and that every id is below the vocabulary (:func:`.corpus._check_tokens`).
A second run, or every other rank, maps the same files without tokenizing again. Writes are atomic: the shards are written to a temporary folder that is then
renamed, so ranks racing to build the same cache are harmless.

Documents go to validation by a hash of their index (the same rule for the same data). Every document ends with
the tokenizer's end-of-text id when it has one.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .. import tokenize_pool
from ..errors import ConfigError, SyncwiseError

FORMAT = 2  # 2: keyed by content; meta.json records splits and blake2b digests
SOURCES = "a .jsonl/.json-lines file, a .parquet file, a text file, or a `datasets` folder (save_to_disk)"
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _tokenizer_file(path: str) -> Path:
    accepted = "a tokenizer.json file, or a folder holding one (a Hugging Face tokenizer saved with " \
               "save_pretrained / Tokenizer.save)"
    try:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        found = p.is_file()
    except (OSError, RuntimeError) as e:  # a name too long for the file system, ~nosuchuser: raised, not False
        raise ConfigError("data.tokenizer", path, f"{accepted} ({getattr(e, 'strerror', None) or e})") from None
    if not found:
        raise ConfigError("data.tokenizer", path, accepted)
    return p


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` at ``path`` (a tokenizer.json or a folder holding one)."""
    file = _tokenizer_file(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SyncwiseError("data.tokenizer needs tokenizers: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the library's own parse error, one line
        raise ConfigError("data.tokenizer", path, f"a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


TEXT_PIECE_CHARS = 1 << 20
"""A plain text file is one document, read in pieces of about this many characters cut at line ends (so a file
larger than memory streams); only the last piece ends with the end-of-text id."""
ROWS_PER_READ = 1024
"""Rows turned into Python strings at a time from parquet (within one row group) and ``datasets`` folders
(``Dataset.iter``)."""


class _Source:
    """The documents of one source, read as a stream: ``total`` progress units (rows, or bytes for JSON lines and
    text) and ``pieces()`` yielding (text, ends a document, progress units done)."""

    def __init__(self, path: Path, spec: str, column: str) -> None:
        self.path, self.spec, self.column = path, spec, column
        if path.is_dir() and not is_dataset_dir(path):
            raise ConfigError("data.corpus", spec, f"{SOURCES}; {path} is a folder without dataset_info.json and "
                              "state.json (not written by save_to_disk)")
        self.kind = ("dataset" if is_dataset_dir(path) else "parquet" if path.suffix.lower() == ".parquet" else
                     "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") or path.name.endswith(".json-lines")
                     else "text")
        self.unit = "rows" if self.kind in ("dataset", "parquet") else "bytes"
        self.total = self._open()  # the column is checked here, before any tokenizing

    def _open(self) -> int:
        column, spec = self.column, self.spec
        if self.kind == "dataset":
            try:
                import datasets
            except ImportError:
                raise SyncwiseError("a `datasets` folder as data.corpus needs datasets: pip install datasets") from None
            ds = datasets.load_from_disk(str(self.path))  # memory-mapped arrow files
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
            if column not in ds.column_names:
                raise ConfigError("data.text_column", column, f"a column of {spec}: {', '.join(ds.column_names)}")
            self._ds = ds.select_columns([column])
            return len(ds)
        if self.kind == "parquet":
            import pyarrow.parquet as pq  # installed with datasets

            try:
                self._pq = pq.ParquetFile(self.path)
            except Exception as e:  # pyarrow's own message, one line
                raise ConfigError("data.corpus", spec, f"a readable parquet file ({str(e).splitlines()[0]})") from None
            names = self._pq.schema_arrow.names
            if column not in names:
                raise ConfigError("data.text_column", column, f"a column of {spec}: {', '.join(names)}")
            return self._pq.metadata.num_rows
        return self.path.stat().st_size

    def pieces(self) -> Iterator[tuple[str, bool, int]]:
        column, spec = self.column, self.spec
        if self.kind == "dataset":
            for rows in self._ds.iter(batch_size=ROWS_PER_READ):
                values = rows[column]
                for value in values:
                    yield _text(value, spec, column), True, 0
                yield "", False, len(values)  # progress only
        elif self.kind == "parquet":
            # one row group at a time (parquet's unit of reading): iter_batches reads ahead across row groups, and
            # its memory grew with the file (measured: arrow's pool peak 9 -> 50 MB for a 2 -> 32 MB corpus)
            for group in range(self._pq.num_row_groups):
                table = self._pq.read_row_group(group, columns=[column], use_threads=False)
                for at in range(0, table.num_rows, ROWS_PER_READ):
                    values = table.column(0).slice(at, ROWS_PER_READ).to_pylist()
                    for value in values:
                        yield _text(value, spec, column), True, 0
                    yield "", False, len(values)
                del table
        elif self.kind == "jsonl":
            with open(self.path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    line = raw.decode("utf-8", errors="replace")
                    if not line.strip():
                        yield "", False, len(raw)
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError("data.corpus", spec, f"JSON lines: line {n} is not JSON ({e.msg})") from None
                    if not isinstance(obj, dict) or column not in obj:
                        keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise ConfigError("data.text_column", column, f"a field of every line of {spec} (line {n} "
                                          f"has: {keys})")
                    yield _text(obj[column], spec, column), True, len(raw)
        else:
            with open(self.path, "rb") as f:
                piece: list[str] = []
                size = done = 0
                for raw in f:
                    piece.append(raw.decode("utf-8", errors="replace"))
                    size += len(piece[-1])
                    done += len(raw)
                    if size >= TEXT_PIECE_CHARS:
                        yield "".join(piece), False, done
                        piece, size, done = [], 0, 0
                yield "".join(piece), True, done


def _text(value: Any, spec: str, column: str) -> str:
    if not isinstance(value, str):
        raise ConfigError("data.text_column", column, f"a column of strings in {spec} (found {type(value).__name__})")
    return value


HASH_PIECE = 1 << 16


def _hash_file(p: Path) -> str:
    """blake2b (16 bytes) of every byte of ``p``, read into one small reused buffer (bounded memory)."""
    h = hashlib.blake2b(digest_size=16)
    buf = bytearray(HASH_PIECE)
    view = memoryview(buf)
    with open(p, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _file_digest(p: Path, memo_dir: Path) -> str:
    """blake2b of every byte of ``p``; remembered in ``memo_dir`` under its identity, size, mtime and ctime (ctime
    changes with every write and no user-level tool can set it back, so an edit always misses the memo)."""
    st = p.stat()
    memo = memo_dir / hashlib.sha256(json.dumps([str(p.resolve()), st.st_dev, st.st_ino, st.st_size,
                                                 st.st_mtime_ns, st.st_ctime_ns]).encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 32:
            return known
    except OSError:
        pass
    digest = _hash_file(p)
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_dir, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:
        pass  # an unwritable cache only costs hashing again
    return digest


def _fingerprint(path: Path, memo_dir: Path) -> list:
    """What the source is, by content: (relative name, size, blake2b) of each of its files."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(p.relative_to(path).as_posix() if path.is_dir() else p.name, p.stat().st_size,
             _file_digest(p, memo_dir)) for p in files]


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from .cache import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


MAX_WORKERS = 8
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20
"""A batch handed to one tokenizing process: up to this many documents or characters, whichever comes first."""
AUTO_SERIAL_BYTES = 8 << 20
"""With ``workers=0`` (auto), a source smaller than this is tokenized in this process (starting worker processes
costs more than it saves)."""

def resolve_workers(workers: int, source_bytes: int) -> int:
    """Processes that tokenize: ``workers`` when set, else one per CPU core (up to MAX_WORKERS), 1 for small data."""
    if workers > 0:
        return workers
    if source_bytes < AUTO_SERIAL_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))


def _source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _progress(source: _Source, spec: str):
    """A rich progress bar on an interactive terminal, in rank 0 (or outside torchrun) only; else None."""
    if os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    count = DownloadColumn() if source.unit == "bytes" else MofNCompleteColumn()
    return Progress(TextColumn(f"tokenizing {Path(spec).name}"), BarColumn(), count, TextColumn("{task.fields[rate]}"),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)


def prepare(spec: str, tokenizer: str, val_fraction: float = 0.05, column: str = "text",
            cache_dir: str | os.PathLike | None = None, workers: int = 0) -> Path:
    """Tokenize ``spec`` with ``tokenizer`` once; returns the cache folder holding train.bin, val.bin, meta.json.

    The source is read as a stream and the ids are appended to the shards batch by batch, so memory stays bounded
    by a few batches per process whatever the corpus' size. ``workers`` processes tokenize (0: one per CPU core up
    to MAX_WORKERS, or 1 for a source under AUTO_SERIAL_BYTES); the result does not depend on their number."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError("data.corpus", spec, f"{SOURCES}; no such file or folder: {path}")
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError("data.corpus", spec, f"{SOURCES}; {path} is empty")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError("data.tokenize_workers", workers, "an integer ≥ 0 (0: one per CPU core)")
    tok_file = _tokenizer_file(tokenizer)
    root = _cache_root(cache_dir)
    key = hashlib.sha256(json.dumps([FORMAT, str(path.resolve()), _fingerprint(path, root / "digests"), column,
                                     val_fraction, hashlib.sha256(tok_file.read_bytes()).hexdigest()]
                                    ).encode()).hexdigest()[:20]
    out = root / "tokenized" / key
    if (out / "meta.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _one_builder(out.parent / f".{key}.lock"):  # other processes on this machine wait, then find the cache
        if not (out / "meta.json").is_file():
            _build(out, path, spec, tok_file, tokenizer, column, val_fraction, workers)
    return out


def _build(out: Path, path: Path, spec: str, tok_file: Path, tokenizer: str, column: str, val_fraction: float,
           workers: int) -> None:
    """Tokenize ``path`` into a temporary folder next to ``out``, then publish it as ``out`` (atomic rename)."""
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    eos = next((tok.token_to_id(t) for t in _EOS_NAMES if tok.token_to_id(t) is not None), None)
    source = _Source(path, spec, column)
    n_workers = resolve_workers(workers, _source_bytes(path))
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        start = time.perf_counter()
        with open(tmp / "train.bin", "wb") as train_f, open(tmp / "val.bin", "wb") as val_f:
            docs, counts = _tokenize_into(source, tok, tok_file, dtype, eos, val_fraction, n_workers,
                                          {"train": train_f, "val": val_f}, spec)
        seconds = time.perf_counter() - start
        tokens = counts["train"] + counts["val"]
        if tokens == 0:
            raise ConfigError("data.corpus", spec, f"{SOURCES} with text in it; {docs} document(s) gave no tokens")
        if counts["train"] == 0 or counts["val"] == 0:  # too few documents for the hash split: the stream's tail
            _split_tail(tmp, dtype, val_fraction)
        splits, digests = {}, {}
        for split in ("train", "val"):
            splits[split] = (tmp / f"{split}.bin").stat().st_size // dtype.itemsize
            digests[f"{split}.bin"] = _hash_file(tmp / f"{split}.bin")
        (tmp / "meta.json").write_text(json.dumps({
            "format": FORMAT, "splits": splits, "blake2b": digests,
            "vocab_size": vocab, "dtype": dtype.name, "tokenizer": str(tok_file), "source": str(path),
            "documents": docs, "tokens": tokens, "eos_id": eos, "column": column, "workers": n_workers,
            "tokenize_seconds": round(seconds, 3)}, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another rank published the same cache first
            if not (out / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _one_builder(lock: Path) -> Iterator[None]:
    """One process on this machine builds a given cache at a time (ranks of a plain torchrun job, each calling
    load_corpus): an exclusive ``flock`` on ``lock``. Where there is no flock, or the lock file cannot be made,
    every caller builds and the atomic rename keeps the result whole."""
    try:
        import fcntl

        f = open(lock, "a")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()  # closing releases the lock


def _tokenize_into(source: _Source, tok: Any, tok_file: Path, dtype: np.dtype, eos: int | None, val_fraction: float,
                   n_workers: int, files: dict, spec: str) -> tuple[int, dict[str, int]]:
    """Stream ``source`` through ``n_workers`` tokenizing processes (at most 2 batches each in flight, results
    written in order), appending each document's ids (+ eos) to the train or val file. Returns (documents,
    tokens per split)."""
    counts = {"train": 0, "val": 0}
    state = {"docs": 0, "tokens": 0, "bar": 0}
    bar = _progress(source, spec)
    task = bar.add_task("tokenize", total=source.total, rate="") if bar is not None else None
    start = time.perf_counter()

    def write(result: tuple[np.ndarray, np.ndarray], ends: list[bool], progress: int) -> None:
        flat, lengths = result
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        chunks: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        for i, last in enumerate(ends):
            split = "val" if _is_val(state["docs"], val_fraction) else "train"
            chunks[split].append(flat[bounds[i]:bounds[i + 1]])
            if last:
                if eos is not None:
                    chunks[split].append(np.asarray([eos], dtype=dtype))
                state["docs"] += 1
        for split, parts in chunks.items():
            if parts:
                data = np.concatenate(parts)
                data.tofile(files[split])
                counts[split] += data.size
        state["tokens"] = counts["train"] + counts["val"]
        if bar is not None:
            if not state["bar"]:  # started at the first result: after the pool has forked (no thread to copy)
                bar.start()
                state["bar"] = 1
            rate = state["tokens"] / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=progress, rate=f"{rate / 1e6:.2f}M tok/s")

    whole = source.kind != "text"  # a text file's pieces get no special tokens, only the final eos

    def batches() -> Iterator[tuple[list[str], list[bool], int]]:
        texts: list[str] = []
        ends: list[bool] = []
        chars = progress = 0
        for text, last, done in source.pieces():
            progress += done
            if text or last:
                texts.append(text)
                ends.append(last)
                chars += len(text)
            if len(texts) >= BATCH_DOCS or chars >= BATCH_CHARS:
                yield texts, ends, progress
                texts, ends, chars, progress = [], [], 0, 0
        if texts or progress:
            yield texts, ends, progress

    try:
        if n_workers == 1:
            with tokenize_pool.single_threaded():
                for texts, ends, progress in batches():
                    write(tokenize_pool.encode(texts, whole, dtype.name, tok), ends, progress)
        else:
            from concurrent.futures import ProcessPoolExecutor
            import multiprocessing

            # fork where there is one: spawn (and forkserver) re-import the caller's __main__ in every worker, which
            # breaks any script without an `if __name__ == "__main__"` guard that calls load_corpus; the children
            # only run numpy and the tokenizers library on what they are sent. The tokenizers library's own thread
            # pool is declared off before the fork (else it warns in every child).
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            with tokenize_pool.single_threaded(), ProcessPoolExecutor(
                    n_workers, mp_context=multiprocessing.get_context(method), initializer=tokenize_pool.init,
                    initargs=(str(tok_file),)) as pool:
                pending: collections.deque = collections.deque()
                for texts, ends, progress in batches():
                    pending.append((pool.submit(tokenize_pool.encode, texts, whole, dtype.name), ends, progress))
                    if len(pending) >= 2 * n_workers:  # bounded: the reader waits for the oldest batch
                        future, e, p = pending.popleft()
                        write(future.result(), e, p)
                while pending:
                    future, e, p = pending.popleft()
                    write(future.result(), e, p)
    finally:
        if bar is not None and state["bar"]:
            bar.stop()
    return state["docs"], counts


def _split_tail(folder: Path, dtype: np.dtype, val_fraction: float) -> None:
    """Too few documents for the hash split (one split came out empty, e.g. a single text file): the stream is cut
    so that its last ``val_fraction`` is val. The tail is copied through a memory map and the train file truncated,
    so this stays bounded in memory too."""
    train, val = folder / "train.bin", folder / "val.bin"
    if train.stat().st_size == 0:
        os.replace(val, train)
    size = train.stat().st_size // dtype.itemsize
    cut = int(round(size * (1.0 - val_fraction)))
    stream = np.memmap(train, dtype=dtype, mode="r")
    with open(val, "wb") as f:
        for at in range(cut, size, 1 << 22):
            stream[at:min(size, at + (1 << 22))].tofile(f)
    del stream
    os.truncate(train, cut * dtype.itemsize)


def _is_val(index: int, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(str(index).encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


def check_vocab(folder: Path, tokenizer: str, spec: str) -> None:
    """A token folder (train.bin + meta.json) must have been made with a tokenizer of the same vocabulary."""
    meta = folder / "meta.json"
    if not meta.is_file():
        return
    have = json.loads(meta.read_text()).get("vocab_size")
    want = load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True)
    if have != want:
        raise ConfigError("data.tokenizer", tokenizer, f"a tokenizer with the vocabulary of {spec} ({have} ids, "
                          f"from its meta.json); this one has {want}")
