"""Real tokenized data: documents from JSON lines, parquet, text files or a ``datasets`` on-disk dataset, tokenized
once by a Hugging Face tokenizer (``--data.tokenizer PATH``) into memory-mapped token shards.

The shards use the nanoGPT layout that :mod:`.corpus` already reads: ``train.bin``, ``val.bin`` and ``meta.json``
(``vocab_size``, ``dtype``: uint16 up to 65,536 ids, uint32 above). The existing batch loader then shards them
across ranks and resumes from its checkpointed position. The cache key covers the source files (path, size and
mtime), the tokenizer file, the text column and the validation split. A second run, or every other rank, maps the
same files without tokenizing again. Writes are atomic: the shards are written to a temporary folder that is then
renamed, so ranks racing to build the same cache are harmless.

Documents go to validation by a hash of their index (the same rule for the same data). Every document ends with
the tokenizer's end-of-text id when it has one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import ConfigError, SyncwiseError

FORMAT = 1
SOURCES = "a .jsonl/.json-lines file, a .parquet file, a text file, or a `datasets` folder (save_to_disk)"
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _tokenizer_file(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError("data.tokenizer", path, "a tokenizer.json file, or a folder holding one "
                          "(a Hugging Face tokenizer saved with save_pretrained / Tokenizer.save)")
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


def _documents(path: Path, spec: str, column: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if is_dataset_dir(path):
        try:
            import datasets
        except ImportError:
            raise SyncwiseError("a `datasets` folder as data.corpus needs datasets: pip install datasets") from None
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        if column not in ds.column_names:
            raise ConfigError("data.text_column", column, f"a column of {spec}: {', '.join(ds.column_names)}")
        for row in ds.select_columns([column]):
            yield _text(row[column], spec, column)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # installed with datasets

        names = pq.read_schema(path).names
        if column not in names:
            raise ConfigError("data.text_column", column, f"a column of {spec}: {', '.join(names)}")
        for value in pq.read_table(path, columns=[column]).column(column).to_pylist():
            yield _text(value, spec, column)
    elif suffix in (".jsonl", ".ndjson") or path.name.endswith(".json-lines"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError("data.corpus", spec, f"JSON lines: line {n} is not JSON ({e.msg})") from None
                if not isinstance(obj, dict) or column not in obj:
                    keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise ConfigError("data.text_column", column, f"a field of every line of {spec} (line {n} "
                                      f"has: {keys})")
                yield _text(obj[column], spec, column)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _text(value: Any, spec: str, column: str) -> str:
    if not isinstance(value, str):
        raise ConfigError("data.text_column", column, f"a column of strings in {spec} (found {type(value).__name__})")
    return value


def _fingerprint(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from .cache import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def prepare(spec: str, tokenizer: str, val_fraction: float = 0.05, column: str = "text",
            cache_dir: str | os.PathLike | None = None) -> Path:
    """Tokenize ``spec`` with ``tokenizer`` once; returns the cache folder holding train.bin, val.bin, meta.json."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError("data.corpus", spec, f"{SOURCES}; no such file or folder: {path}")
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError("data.corpus", spec, f"{SOURCES}; {path} is empty")
    tok_file = _tokenizer_file(tokenizer)
    key = hashlib.sha256(json.dumps([FORMAT, str(path.resolve()), _fingerprint(path), column, val_fraction,
                                     hashlib.sha256(tok_file.read_bytes()).hexdigest()]).encode()).hexdigest()[:20]
    out = _cache_root(cache_dir) / "tokenized" / key
    if (out / "meta.json").is_file():
        return out
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    eos = next((tok.token_to_id(t) for t in _EOS_NAMES if tok.token_to_id(t) is not None), None)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    docs, batch = 0, []

    def flush() -> None:
        for i, enc in enumerate(tok.encode_batch(batch)):
            ids = enc.ids + ([eos] if eos is not None else [])
            index = docs - len(batch) + i
            split = "val" if _is_val(index, val_fraction) else "train"
            parts[split].append(np.asarray(ids, dtype=dtype))
        batch.clear()

    for text in _documents(path, spec, column):
        batch.append(text)
        docs += 1
        if len(batch) == 1024:
            flush()
    if batch:
        flush()
    train = np.concatenate(parts["train"]) if parts["train"] else np.zeros(0, dtype)
    val = np.concatenate(parts["val"]) if parts["val"] else np.zeros(0, dtype)
    if train.size + val.size == 0:
        raise ConfigError("data.corpus", spec, f"{SOURCES} with text in it; {docs} document(s) gave no tokens")
    if val.size == 0 or train.size == 0:  # too few documents for the hash split: the stream's tail is val
        stream = np.concatenate([train, val])
        cut = int(round(stream.size * (1.0 - val_fraction)))
        train, val = stream[:cut], stream[cut:]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        (tmp / "meta.json").write_text(json.dumps({
            "vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokenizer": str(tok_file), "source": str(path),
            "documents": docs, "eos_id": eos, "column": column}, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another rank published the same cache first
            if not (out / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
