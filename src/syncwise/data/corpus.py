"""Corpora: the Python stdlib's own sources (default), text files/folders, nanoGPT ``.bin`` token files.

Every corpus becomes two 1-D token tensors (train, val) in a compact dtype (uint8 for bytes, uint16
for nanoGPT files, which stay memory-mapped); loaders convert to int64 one batch at a time.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .cache import default_cache_dir
from ..errors import ConfigError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
"""Default cap on bytes read from text sources: the whole non-test stdlib is ~12 MB, read in < 1 s."""

TEXT_EXTENSIONS = frozenset({
    ".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
    ".js", ".ts", ".json", ".jsonl", ".toml", ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv", ".html",
    ".htm", ".xml", ".tex", ".sh", ".css", ".sql", ".text",
})
"""Extensions picked up when the corpus is a folder of text files."""

# Directories of the stdlib that are not "library source": third-party packages and the (huge,
# repetitive) test suites.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                               "__pycache__"})
_CACHE_FORMAT = 1  # bump when the tokenization or split rule changes, so stale caches are ignored
_ACCEPTED = ("'stdlib' (the Python standard library's sources), a text file, a folder of text files "
             f"({', '.join(sorted(TEXT_EXTENSIONS))}), or nanoGPT-style token files (a folder with "
             "train.bin [+ val.bin, meta.json/meta.pkl] or a path to a uint16 .bin file)")


@dataclass
class Corpus:
    """Train/val token streams of one corpus, plus what it is."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    name: str
    description: str
    byte_level: bool = True
    files: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})

    def __repr__(self) -> str:
        return (f"Corpus(name={self.name!r}, train={self.train.numel():,} tokens, "
                f"val={self.val.numel():,} tokens, vocab_size={self.vocab_size})")


def load_corpus(spec: str = "stdlib", val_fraction: float = 0.05,
                max_bytes: int | None = DEFAULT_MAX_BYTES, cache_dir: str | os.PathLike | None = None,
                tokenizer: str = "", text_column: str = "text", tokenize_workers: int = 0) -> Corpus:
    """Load a corpus by spec: ``"stdlib"``, a text file/folder, or nanoGPT ``train.bin``/``val.bin``.

    Text is byte-tokenized. Files go to val by a hash of their relative path (so the split does not
    depend on file order or count); with too few files for that, the last ``val_fraction`` of the
    stream is val. ``max_bytes`` caps bytes read from text sources (``None``: no cap); ``.bin``
    files are memory-mapped and never capped. The stdlib corpus is cached under ``cache_dir``
    (default ``$SYNCWISE_CACHE_DIR`` or ``~/.cache/syncwise``).

    ``tokenizer`` (a Hugging Face tokenizer.json or its folder): ``spec`` is JSON lines, parquet, text or a
    ``datasets`` folder, tokenized once into cached token shards (:mod:`.tokenized`, column ``text_column``, by
    ``tokenize_workers`` processes, 0: one per core).
    """
    if tokenizer:
        folder = _tokenized(spec, val_fraction, cache_dir, tokenizer, text_column, tokenize_workers)
        corpus = _load_bin(folder / "train.bin", str(spec), val_fraction, cache_dir)
        corpus.name = Path(str(spec)).expanduser().name or str(spec)
        corpus.description = f"{spec} tokenized by {tokenizer} ({corpus.description})"
        return corpus
    kind, path, files = _source(spec, val_fraction, max_bytes)
    if kind == "stdlib":
        return _load_stdlib(val_fraction, max_bytes, cache_dir)
    if kind == "bin":
        return _load_bin(path, str(spec), val_fraction, cache_dir)
    train, val, counts = _text_tokens(files, str(spec), path, val_fraction, max_bytes)
    capped = f", capped at {max_bytes:,} bytes" if max_bytes is not None and train.size + val.size >= max_bytes else ""
    return Corpus(torch.from_numpy(train), torch.from_numpy(val), 256, path.name or str(spec),
                  f"byte-level text from {path} ({len(files)} file(s){capped})", True, counts)


def corpus_sizes(spec: str = "stdlib", val_fraction: float = 0.05, max_bytes: int | None = DEFAULT_MAX_BYTES,
                 cache_dir: str | os.PathLike | None = None, tokenizer: str = "",
                 text_column: str = "text", tokenize_workers: int = 0) -> tuple[int, int, int | None]:
    """(train tokens, val tokens, vocab size or None when only the tokens tell) of the corpus ``load_corpus``
    would load, after the same checks (the same ConfigError for a bad spec), but cheap and read-only, to
    validate a configuration before any worker starts: ``.bin`` files are only stat'ed (their meta is read,
    their tokens are not), text sources are read as ``load_corpus`` reads them (at most ``max_bytes``), the
    stdlib's counts come from its cache if there is one and nothing is written. With a ``tokenizer`` the source
    is tokenized into its cache here (once; the workers then map it)."""
    if tokenizer:
        folder = _tokenized(spec, val_fraction, cache_dir, tokenizer, text_column, tokenize_workers)
        train, val, _ = _bin_split(folder / "train.bin", str(spec), val_fraction, cache_dir)
        return train.size, val.size, _read_vocab_size(folder)
    kind, path, files = _source(spec, val_fraction, max_bytes)
    if kind == "stdlib":
        return (*_stdlib_sizes(val_fraction, max_bytes, cache_dir), 256)
    if kind == "bin":
        train, val, _ = _bin_split(path, str(spec), val_fraction, cache_dir)
        return train.size, val.size, _read_vocab_size(path.parent)
    train, val, _ = _text_tokens(files, str(spec), path, val_fraction, max_bytes)
    return train.size, val.size, 256


def _source(spec: str, val_fraction: float, max_bytes: int | None) -> tuple[str, Path | None, list]:
    """What ``spec`` names: ('stdlib', None, []), ('bin', token file, []) or ('text', path, [(rel, file)])."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ConfigError("data.val_fraction", val_fraction, "a number in [0, 1)")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ConfigError("data.max_bytes", max_bytes, "a positive number of bytes, or None for no cap")
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ConfigError("data.corpus", spec, _ACCEPTED)
    spec = str(spec)
    if spec == "stdlib":
        return "stdlib", None, []
    try:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; no such file or folder: {path}")
        if path.is_dir() and (path / "train.bin").is_file():
            return "bin", path / "train.bin", []
        if path.is_file():
            if path.suffix != ".bin":
                _refuse_records(spec, [path])
            return ("bin" if path.suffix == ".bin" else "text"), path, [(path.name, path)]
        if not path.is_dir():
            raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {path} is neither a regular file nor a folder")
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*")
                       if p.is_file() and p.suffix.lower() in TEXT_EXTENSIONS)
    except (OSError, RuntimeError) as e:  # a name too long, a loop of links, '~user' of no user
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {e}") from None
    if not files:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; the folder {path} has no text files")
    _refuse_records(spec, [p for _, p in files])
    return "text", path, files


# Record formats whose bytes are not the text: read byte by byte they would train on keys, quotes and escapes.
RECORD_SUFFIXES = (".jsonl", ".parquet")


def _refuse_records(spec: str, files: list[Path]) -> None:
    """A JSON-lines / parquet corpus (a file, or a folder of nothing else) needs a tokenizer: refused without one
    rather than trained on its raw bytes."""
    if files and all(p.suffix.lower() in RECORD_SUFFIXES for p in files):
        what = files[0].name if len(files) == 1 else f"{len(files)} {files[0].suffix} files"
        raise ConfigError("data.tokenizer", None, f"a Hugging Face tokenizer.json (or its folder) for the corpus "
                          f"{spec} ({what}: records whose text is in a column, data.text_column); without one the byte "
                          "tokenizer would train on the raw JSON/parquet bytes, keys and quotes included. Or give "
                          "plain text files")


def _text_tokens(files: list[tuple[str, Path]], spec: str, path: Path, val_fraction: float,
                 max_bytes: int | None) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    try:
        train, val, counts = _tokenize_files(files, val_fraction, max_bytes)
    except OSError as e:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; cannot read {e.filename}: {e.strerror}") from None
    if train.size == 0:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {path} holds no text (0 bytes)")
    return train, val, counts


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # A hash of the relative path, not the file's position, so adding or removing files elsewhere
    # does not move any other file between train and val.
    h = int.from_bytes(hashlib.sha1(rel_path.encode("utf-8")).digest()[:8], "big")
    return h / 2.0 ** 64 < val_fraction


def _tokenize_files(files: list[tuple[str, Path]], val_fraction: float,
                    max_bytes: int | None) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Read files in the given (sorted) order up to ``max_bytes`` and split them train/val by file."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for rel, p in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = p.read_bytes()
        if not data:
            continue
        if not data.endswith(b"\n"):  # keep files from running into each other mid-line
            data += b"\n"
        if max_bytes is not None:
            data = data[: max_bytes - total]
        total += len(data)
        parts[_is_val(rel, val_fraction)].append(data)
    counts = {"train": len(parts[False]), "val": len(parts[True])}
    train = np.frombuffer(b"".join(parts[False]), dtype=np.uint8)
    val = np.frombuffer(b"".join(parts[True]), dtype=np.uint8)
    if val_fraction > 0 and (val.size == 0 or train.size == 0):
        # Too few files for a per-file split (e.g. one text file): hold out the tail of the stream,
        # as nanoGPT's data preparation does.
        stream = np.frombuffer(b"".join(parts[False] + parts[True]), dtype=np.uint8)
        cut = int(round(stream.size * (1.0 - val_fraction)))
        train, val = stream[:cut], stream[cut:]
        counts = {"train": -1, "val": -1}  # -1: split inside the stream, not by file
    # np.frombuffer gives read-only views; torch wants writable memory, so copy once here.
    return train.copy(), val.copy(), counts


def stdlib_files() -> tuple[Path, list[tuple[str, Path]]]:
    """The stdlib root and its library ``.py`` files as sorted (relative path, path) pairs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                p = Path(dirpath) / fn
                files.append((p.relative_to(root).as_posix(), p))
    files.sort()
    return root, files




def _load_stdlib(val_fraction: float, max_bytes: int | None, cache_dir: str | os.PathLike | None) -> Corpus:
    root, train, val, counts = _stdlib_tokens(val_fraction, max_bytes, cache_dir, save=True)
    capped = max_bytes is not None and train.size + val.size >= max_bytes
    desc = (f"Python {sys.version_info.major}.{sys.version_info.minor} stdlib sources under {root} "
            f"({counts['train']} train / {counts['val']} val files, byte-level"
            + (f", first {max_bytes:,} bytes by sorted path)" if capped else ")"))
    return Corpus(torch.from_numpy(train), torch.from_numpy(val), 256, "stdlib", desc, True, counts)


@functools.lru_cache(maxsize=64)
def _stdlib_sizes(val_fraction: float, max_bytes: int | None, cache_dir: str | os.PathLike | None) -> tuple[int, int]:
    # The stdlib does not change while this process runs: validating many configurations reads it once.
    _, train, val, _ = _stdlib_tokens(val_fraction, max_bytes, cache_dir, save=False)
    return train.size, val.size


def _stdlib_tokens(val_fraction: float, max_bytes: int | None, cache_dir: str | os.PathLike | None,
                   save: bool) -> tuple[Path, np.ndarray, np.ndarray, dict[str, int]]:
    """The stdlib's train/val bytes from the cache, else tokenized (and cached if ``save``)."""
    root, files = stdlib_files()
    if not files:
        raise ConfigError("data.corpus", "stdlib",
                          f"{_ACCEPTED}; no .py sources found under {root} (this Python ships without "
                          "them): pass a text file or folder instead")
    ver = f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    # The key covers everything that changes the result: interpreter, where its stdlib is, cap, split.
    key = hashlib.sha1(f"{_CACHE_FORMAT}|{ver}|{root}|{max_bytes}|{val_fraction!r}".encode()).hexdigest()[:12]
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache_file = cache / f"stdlib-{ver}-{key}.npz"
    train = val = None
    counts = {"train": 0, "val": 0}
    if cache_file.is_file():
        try:
            with np.load(cache_file) as z:
                train, val = z["train"], z["val"]
                counts = {"train": int(z["n_train_files"]), "val": int(z["n_val_files"])}
        except (OSError, ValueError, KeyError, EOFError):  # a corrupt cache is rebuilt, never fatal
            train = val = None
    if train is None:
        train, val, counts = _tokenize_files(files, val_fraction, max_bytes)
        if save:
            _atomic_savez(cache_file, train=train, val=val, n_train_files=counts["train"],
                          n_val_files=counts["val"])
    return root, train, val, counts


def _atomic_savez(path: Path, **arrays: np.ndarray | int) -> None:
    """Write an .npz next to its final name, then rename: readers never see a half-written cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # an unwritable cache dir only costs speed next time


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data (dict/list/str/int...) only: nanoGPT's meta.pkl needs nothing more, and
    refusing every global means a crafted pickle cannot run code."""

    def find_class(self, module: str, name: str):  # noqa: D102
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain data is allowed")


def _read_vocab_size(folder: Path) -> int | None:
    meta_json, meta_pkl = folder / "meta.json", folder / "meta.pkl"
    try:
        if meta_json.is_file():
            meta = json.loads(meta_json.read_text())
        elif meta_pkl.is_file():
            with open(meta_pkl, "rb") as f:
                meta = _DataOnlyUnpickler(f).load()
        else:
            return None
    except (OSError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        raise ConfigError("data.corpus", str(folder),
                          f"a readable meta.json/meta.pkl with an integer 'vocab_size' ({exc})") from exc
    vs = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vs, int) or vs <= 0:
        raise ConfigError("data.corpus", str(folder), "meta.json/meta.pkl with a positive integer 'vocab_size'")
    return vs


def _tokenized(spec: str, val_fraction: float, cache_dir: str | os.PathLike | None, tokenizer: str,
               text_column: str, workers: int = 0) -> Path:
    """The token folder for ``spec`` under ``tokenizer``: a nanoGPT folder as it is (its vocabulary checked), else
    the cache that :func:`.tokenized.prepare` builds."""
    from .tokenized import SOURCES, check_vocab, load_tokenizer, prepare

    load_tokenizer(tokenizer)  # the tokenizer's own errors first: they name data.tokenizer
    if str(spec) == "stdlib":
        raise ConfigError("data.tokenizer", tokenizer, f"'' with data.corpus=stdlib (byte-level); a tokenizer "
                          f"needs data.corpus to be {SOURCES}")
    path = Path(str(spec)).expanduser()
    if path.is_dir() and (path / "train.bin").is_file():
        check_vocab(path, tokenizer, str(spec))
        return path
    return prepare(str(spec), tokenizer, val_fraction, text_column,
                   cache_dir if cache_dir is not None else default_cache_dir(), workers)


def _token_meta(path: Path, spec: str) -> dict:
    """The meta.json next to a token file ({} when there is none); an unreadable one is refused, naming it."""
    meta = path.parent / "meta.json"
    if not meta.is_file():
        return {}
    try:
        data = json.loads(meta.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {meta} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {meta} is not a JSON object")
    return data


def _token_dtype(path: Path, spec: str) -> np.dtype:
    """uint16 (nanoGPT), or the ``dtype`` a meta.json next to the file names (uint32 for vocabularies > 65,536);
    any other dtype there is refused (read as uint16 it would train on garbage)."""
    name = _token_meta(path, spec).get("dtype", "uint16")
    if name not in ("uint16", "uint32"):
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {path.parent / 'meta.json'} names dtype {name!r}, "
                          "not uint16 or uint32")
    return np.dtype(name)


def _memmap_tokens(path: Path, spec: str) -> np.ndarray:
    size = path.stat().st_size
    dtype = _token_dtype(path, spec)
    if size == 0 or size % dtype.itemsize:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {path} is {size} bytes, not a non-empty "
                          f"array of {dtype.name} tokens")
    # mode "c" (copy-on-write) maps lazily like "r" but gives a writable array, which torch.from_numpy
    # accepts without a warning; nothing is ever written back to the file.
    return np.memmap(path, dtype=dtype, mode="c")


SCAN_TOKENS = 1 << 24
"""Token files are checked in pieces of this many ids (bounded memory, whatever their size)."""


def _check_tokens(path: Path, tokens: np.ndarray, spec: str, cache_dir: str | os.PathLike | None) -> None:
    """A token file checked on open: its length against the count its meta.json records (a syncwise cache
    records it), its bytes against the recorded blake2b digest, every id below the vocabulary size. Each
    failure is one line naming the file. The scan reads the file once; its success is remembered (under the
    cache folder, keyed by the file's identity, size, mtime *and* ctime, which no copy tool can set back), so
    later opens of the same unchanged file cost a stat."""
    meta = _token_meta(path, spec)
    where = path.parent / "meta.json"
    fix = " (a syncwise cache: delete its folder to tokenize again)" if meta.get("format") else ""
    want = (meta.get("splits") or {}).get(path.stem) if isinstance(meta.get("splits"), dict) else None
    if isinstance(want, int) and want != tokens.size:
        raise ConfigError("data.corpus", spec, f"token files of the length their meta.json records; {path} holds "
                          f"{tokens.size:,} tokens, {where} says {want:,} (truncated or replaced){fix}")
    vocab = _read_vocab_size(path.parent)
    digests = meta.get("blake2b") if isinstance(meta.get("blake2b"), dict) else {}
    digest = digests.get(path.name)
    if vocab is None and digest is None:
        return  # nothing to check against: the vocabulary is max id + 1
    st = path.stat()
    memo = _cache_root(cache_dir) / "verified" / hashlib.sha256(json.dumps(
        [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, vocab,
         digest]).encode()).hexdigest()[:32]
    if memo.is_file():
        return
    h = hashlib.blake2b(digest_size=16)
    for at in range(0, tokens.size, SCAN_TOKENS):
        piece = np.asarray(tokens[at:at + SCAN_TOKENS])
        if digest is not None:
            h.update(piece.tobytes())
        if vocab is not None and piece.size:
            top = int(piece.max())
            if top >= vocab:
                pos = at + int(np.argmax(piece >= vocab))
                raise ConfigError("data.corpus", spec, f"token ids below the vocabulary size; {path} holds id "
                                  f"{top} (first out-of-vocabulary id at token {pos:,}) but its meta says "
                                  f"vocab_size {vocab}{fix}")
    if digest is not None and h.hexdigest() != digest:
        raise ConfigError("data.corpus", spec, f"token files whose bytes match their meta.json; {path} does not "
                          f"match the blake2b digest {where} records (changed or damaged since it was written){fix}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.touch()
    except OSError:
        pass  # an unwritable cache folder only means checking again next time


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _bin_split(path: Path, spec: str, val_fraction: float,
               cache_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """Train and val tokens of a token file (memory-mapped, checked once: :func:`_check_tokens`) and where val
    comes from."""
    try:
        train = _memmap_tokens(path, spec)
        _check_tokens(path, train, spec, cache_dir)
        val_path = path.with_name("val.bin")
        if path.name == "train.bin" and val_path.is_file():
            val = _memmap_tokens(val_path, spec)
            _check_tokens(val_path, val, spec, cache_dir)
            return train, val, "val.bin"
    except OSError as e:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; cannot read {e.filename}: {e.strerror}") from None
    # A lone token file: hold out its tail, contiguous, so windows never straddle the cut.
    cut = int(round(train.size * (1.0 - val_fraction)))
    train, val = train[:cut], train[cut:]
    if train.size == 0:
        raise ConfigError("data.corpus", spec, f"{_ACCEPTED}; {path} leaves no training tokens")
    return train, val, f"last {val_fraction:.0%} of the file"


def _load_bin(path: Path, spec: str, val_fraction: float, cache_dir: str | os.PathLike | None = None) -> Corpus:
    train, val, split = _bin_split(path, spec, val_fraction, cache_dir)
    vocab = _read_vocab_size(path.parent)
    # Without meta, the largest id seen bounds the vocab (numpy: torch has no max for uint16).
    vocab_size = vocab if vocab is not None else int(max(train.max(), val.max() if val.size else 0)) + 1
    return Corpus(torch.from_numpy(train), torch.from_numpy(val), vocab_size,
                  path.parent.name if path.name == "train.bin" else path.stem,
                  f"{train.dtype.name} token file {path} (memory-mapped; val: {split}; vocab_size "
                  f"{vocab_size} from {'meta' if vocab is not None else 'max token + 1'})", False,
                  {"train": 1, "val": 1})
