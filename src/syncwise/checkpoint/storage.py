"""On-disk format of a syncwise checkpoint: layout, manifest, verification, safe readers.

A checkpoint is one directory ``step_00000100/`` holding

- the files of ``torch.distributed.checkpoint`` (``.metadata`` + ``__<rank>_<n>.distcp``) for the
  *global* state (model, optimizer, scheduler, counters), sharded by DCP;
- ``rank_00000.pt`` ... one ``torch.save`` file per rank for the *per-rank* state (RNG, sampler
  position, compressor residuals), plain data only so it loads with ``weights_only=True``;
- ``manifest.json``, written last by rank 0: step, world size, every file with its size and
  sha256, versions and save times.

It is written as ``step_00000100.partial/`` and published by renaming the finished directory, so a
directory named ``step_*`` without ``.partial`` is complete unless the disk later damaged it, which
the manifest's checksums detect. The manifest must list every file a load reads (``.metadata``, the
DCP shards, one rank file per rank of its world size), so a manifest that lists nothing cannot
vouch for a checkpoint. Beside the published directories live ``step_*.abandoned`` (a later timeline
set aside after resuming from an older checkpoint, see ``SmartCheckpointer``) and, only after a crash
while re-saving a step, ``step_*.replaced`` (the previous copy of that step).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import zlib
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("syncwise.checkpoint")

MANIFEST = "manifest.json"
FORMAT = "syncwise-checkpoint/1"
PARTIAL_SUFFIX = ".partial"
ABANDONED_SUFFIX = ".abandoned"
REPLACED_SUFFIX = ".replaced"
METADATA = ".metadata"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
# step_00000100.abandoned, or step_00000100.2.abandoned when that step was abandoned more than once
_ABANDONED_RE = re.compile(r"^step_(\d{8,})(?:\.(\d+))?\.abandoned$")
_SHARD_RE = re.compile(r"^__\d+_\d+\.distcp$")
_RANK_RE = re.compile(r"^rank_(\d{5,})\.pt$")
_HASH_CHUNK = 8 << 20


def step_dirname(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (``step_00000100``)."""
    return f"step_{step:08d}"


def rank_filename(rank: int) -> str:
    """File name of the per-rank state of ``rank`` (``rank_00003.pt``)."""
    return f"rank_{rank:05d}.pt"


def step_of(path: Path) -> int | None:
    """Step number of a published checkpoint directory name, or None if the name is not one."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def published_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Published ``step_*`` directories (no ``.partial``), newest step first; not verified."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]


def abandoned_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """``step_*.abandoned`` directories, highest step first (the same step abandoned again: latest first)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _ABANDONED_RE.match(p.name)
        if m and p.is_dir():
            found.append(((int(m.group(1)), int(m.group(2) or 1)), p))
    return [p for _, p in sorted(found, key=lambda kp: kp[0], reverse=True)]


def abandoned_name(directory: Path, name: str) -> Path:
    """A free ``.abandoned`` name for the checkpoint directory ``name``: an earlier abandoned copy of
    the same step (another timeline) is never overwritten."""
    aside = directory / (name + ABANDONED_SUFFIX)
    n = 2
    while aside.exists():
        aside = directory / f"{name}.{n}{ABANDONED_SUFFIX}"
        n += 1
    return aside


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (hashlib releases the GIL on large buffers)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or new entry in it survives a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def disk_full_hint(path: str | os.PathLike) -> str:
    """' (the disk holding PATH is full: N MiB free)' when under 16 MiB are left there, else ''.
    torch.save on a full disk says only 'unexpected pos 704 vs 598'."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return ""
    return f" (the disk holding {path} is full: {free / 2**20:.1f} MiB free)" if free < 16 * 2**20 else ""


def write_manifest(directory: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file in ``directory`` and write ``manifest.json`` (fsynced); return it."""
    files = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, **info, "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed manifest of a checkpoint directory (not verified)."""
    with open(Path(path) / MANIFEST) as f:
        return json.load(f)


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True) -> str | None:
    """Check a checkpoint against its manifest; return None if valid, else what is wrong."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return f"{path / MANIFEST} is missing (the save never finished)"
    except (OSError, ValueError) as e:
        return f"{path / MANIFEST} is unreadable: {e}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return f"{path / MANIFEST} is not a {FORMAT} manifest"
    problem = _incomplete_manifest(path, manifest)
    if problem is not None:
        return f"{path / MANIFEST} {problem}"
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"file {f} listed in the manifest is missing"
        size = f.stat().st_size
        if size != meta["size"]:
            return f"file {f} has {size} bytes, the manifest says {meta['size']} (truncated or overwritten)"
        if checksums and sha256_file(f) != meta["sha256"]:
            return f"file {f} fails its sha256 checksum (corrupted on disk)"
    return None


def _incomplete_manifest(path: Path, manifest: dict[str, Any]) -> str | None:
    """What makes ``manifest`` unable to vouch for the checkpoint in ``path`` (None if nothing).

    The checksums only prove the files the manifest lists; a manifest listing no files (or not the
    ones a load reads) would verify vacuously. So it must list ``.metadata``, at least one DCP shard
    when it has global components, and ``rank_<r>.pt`` for every rank of its ``world_size`` (every
    rank writes one, even with no per-rank components), and its step must be the directory's.
    """
    files = manifest["files"]
    if not files:
        return ("lists no files: it cannot vouch for the checkpoint (a manifest lists .metadata, the DCP shards "
                "and one rank file per rank)")
    for name, meta in files.items():
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
            return f"lists {name!r}, which is not a file name inside the checkpoint"
        if (not isinstance(meta, dict) or isinstance(meta.get("size"), bool) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            return f"has no size and sha256 for {name}"
    world = manifest.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return f"has no valid world_size ({world!r})"
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"has no valid step ({step!r})"
    if step_of(path) is not None and step_of(path) != step:
        return f"is for step {step}, not for step {step_of(path)} as the directory name says"
    components = {}
    for key in ("global_components", "per_rank_components"):
        names = manifest.get(key)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return f"has no list of {key.replace('_', ' ')}"
        components[key] = names
    if METADATA not in files:
        return f"does not list {METADATA}, the DCP metadata every load reads"
    if components["global_components"] and not any(_SHARD_RE.match(n) for n in files):
        return (f"lists no DCP shard (__<rank>_<n>.distcp) although it holds global state "
                f"({', '.join(components['global_components'])})")
    missing = [rank_filename(r) for r in range(world) if rank_filename(r) not in files]
    if missing:
        return (f"does not list {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: the per-rank state of "
                f"{len(missing)} of its {world} rank(s)")
    beyond = sorted(n for n in files if (m := _RANK_RE.match(n)) and int(m.group(1)) >= world)
    if beyond:
        return f"lists {', '.join(beyond[:3])} although it was written by {world} rank(s)"
    # A file in the directory that the manifest does not list: if it is one a load may read (DCP
    # metadata or shard, a rank file) the manifest does not describe what is there (a file written
    # after it, or dropped in) and unverified data could be loaded, so the checkpoint is refused.
    # Any other file (an NFS .nfs* placeholder, a note someone left) is ignored: the loader never
    # opens it, and refusing would throw away a good checkpoint and fall back to older progress.
    try:
        present = [p.name for p in path.iterdir() if p.is_file()]
    except OSError as e:
        return f"cannot be compared with the directory ({e})"
    unlisted = sorted(n for n in present if n not in files and (n == METADATA or _SHARD_RE.match(n)
                                                                  or _RANK_RE.match(n) or n.endswith(".distcp")))
    if unlisted:
        return (f"does not list {', '.join(unlisted[:3])}{' ...' if len(unlisted) > 3 else ''}, present in the "
                "directory: a checkpoint file not covered by the checksums")
    return None


def latest_valid(directory: str | os.PathLike, checksums: bool = True) -> Path | None:
    """Newest published checkpoint in ``directory`` that passes verification, or None.

    Damaged checkpoints (missing/truncated/corrupted files) are skipped with a warning that names
    the file, and the previous one is tried.
    """
    for path in published_checkpoints(directory):
        problem = verify_checkpoint(path, checksums=checksums)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s; falling back to the previous checkpoint", path, problem)
    return None


def corrupt_checkpoint(path: str | os.PathLike, mode: str = "truncate", file: str | None = None) -> Path:
    """Damage a checkpoint on purpose (tests, demos); return the damaged file.

    ``mode='truncate'`` cuts the file to half its size (a crash mid-write / full disk);
    ``mode='flip'`` inverts one byte in the middle (silent disk corruption). By default the largest
    data file is damaged.
    """
    from ..errors import ConfigError

    path = Path(path)
    if mode not in ("truncate", "flip"):
        raise ConfigError("mode", mode, "'truncate' or 'flip'")
    if file is None:
        candidates = [p for p in path.iterdir() if p.is_file() and p.name != MANIFEST]
        if not candidates:
            raise ConfigError("path", str(path), "a checkpoint directory containing data files")
        target = max(candidates, key=lambda p: p.stat().st_size)
    else:
        target = path / file
    size = target.stat().st_size
    if mode == "truncate":
        os.truncate(target, size // 2)
    else:
        with open(target, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
    return target


# ---------------------------------------------------------------------------------------------
# Safe loading: DCP unpickles its .metadata with pickle.load and non-tensor values with
# torch.load(weights_only=False). A checkpoint is data someone may hand us, so both are replaced
# by loaders that only accept plain data and DCP's own metadata classes.

_SAFE_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.distributed.checkpoint._hf_utils": {"_HFStorageInfo"},
    "torch": {"Size", "device", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
              "int8", "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
              "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format",
              "uint16", "uint32", "uint64"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves only DCP metadata classes and plain torch/builtin types."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not "
                                     "a checkpoint metadata type; refusing to unpickle it")


def safe_load_metadata(stream: IO[bytes]) -> Any:
    """Unpickle a DCP ``.metadata`` stream allowing only metadata types (no arbitrary code)."""
    return _MetadataUnpickler(stream).load()


def make_safe_reader(path: str | os.PathLike):
    """A DCP ``FileSystemReader`` that reads metadata safely and knows syncwise's compression."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            get_path = getattr(self, "_get_metadata_path", None)
            mpath = get_path(rank) if get_path is not None else Path(self.path) / ".metadata"
            with self.fs.create_stream(mpath, "rb") as f:
                metadata = safe_load_metadata(f)
            storage_meta_cls = getattr(dcp_metadata, "StorageMeta", None)  # torch>=2.4
            if storage_meta_cls is not None and hasattr(metadata, "storage_meta"):
                if metadata.storage_meta is None:
                    metadata.storage_meta = storage_meta_cls()
                metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    registry = extension_registry()
    if registry is not None:
        return SafeFileSystemReader(path, _extension_registry=registry)
    return SafeFileSystemReader(path)


def make_safe_planner():
    """A DCP load planner that loads non-tensor values with ``torch.load(weights_only=True)``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element  # private but present since 2.0

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


# ---------------------------------------------------------------------------------------------
# Compression. DCP (torch>=2.7) applies stream extensions to every item it writes and records them
# in .metadata, so a compressed checkpoint stays a normal, reshardable DCP checkpoint. It ships
# ZStandard (needs the `zstandard` or `pyzstd` package); when neither is installed we register a
# zlib extension of the same kind, built on the standard library.

try:  # torch >= 2.7
    from torch.distributed.checkpoint._extension import (ExtensionRegistry, StreamTransformExtension,
                                                         ZStandard)
except ImportError:  # pragma: no cover - older torch: compression unavailable
    ExtensionRegistry = StreamTransformExtension = ZStandard = None  # type: ignore[assignment,misc]


if StreamTransformExtension is not None:

    class _ZlibWriter(io.RawIOBase):
        def __init__(self, output: IO[bytes], level: int):
            self.output, self._z = output, zlib.compressobj(level)

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            data = memoryview(b).cast("B")
            out = self._z.compress(data)
            if out:
                self.output.write(out)
            return len(data)

        def close(self) -> None:
            if not self.closed:
                self.output.write(self._z.flush(zlib.Z_FINISH))
                self.output.close()  # cascades to DCP's no-close wrapper, which flushes
            super().close()

    class ZlibExtension(StreamTransformExtension):
        """DCP stream extension compressing every checkpoint item with zlib (stdlib fallback)."""

        LEVEL = 1  # fastest level: checkpoints are written while training runs

        @staticmethod
        def registry_name() -> str:
            return "stream.zlib@syncwise"

        @staticmethod
        def from_descriptor(version: str) -> "ZlibExtension":
            if version.partition(".")[0] != "1":
                raise ValueError(f"unknown stream.zlib@syncwise version {version!r}")
            return ZlibExtension()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            return _ZlibWriter(output, self.LEVEL)  # type: ignore[return-value]

        def transform_from(self, input: IO[bytes]) -> IO[bytes]:
            # items are single tensors or small blobs; a seekable buffer saves DCP a second copy
            z, out = zlib.decompressobj(), io.BytesIO()
            while chunk := input.read(1 << 20):
                out.write(z.decompress(chunk))
            out.write(z.flush())
            out.seek(0)
            return out
else:  # pragma: no cover
    ZlibExtension = None  # type: ignore[assignment,misc]


def extension_registry():
    """DCP extension registry with syncwise's zlib extension added (None on torch<2.7)."""
    if ExtensionRegistry is None:
        return None
    reg = ExtensionRegistry()
    reg.register(ZlibExtension)
    return reg


def compression_extension(kind: str | bool):
    """The DCP stream extension for ``compression``: 'zstd', 'zlib', True (zstd if installed, else
    zlib) or False (none). Returns (extension or None, name)."""
    from ..errors import ConfigError

    if kind is False or kind is None or kind == "none":
        return None, None
    if StreamTransformExtension is None:
        raise ConfigError("compression", kind, "False on this torch (DCP stream extensions need torch>=2.7)")
    if kind is True or kind == "auto":
        kind = "zstd" if ZStandard.is_available() else "zlib"
    if kind == "zstd":
        if not ZStandard.is_available():
            raise ConfigError("compression", "zstd", "'zlib', True or False (install `zstandard` for zstd)")
        return ZStandard(), "zstd"
    if kind == "zlib":
        return ZlibExtension(), "zlib"
    raise ConfigError("compression", kind, "True, False, 'zstd' or 'zlib'")
