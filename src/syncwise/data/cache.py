"""Where syncwise caches corpora (byte-tokenized stdlib text, tokenized token shards)."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Where syncwise caches tokenized corpora: ``$SYNCWISE_CACHE_DIR`` or ``$XDG_CACHE_HOME/syncwise``."""
    env = os.environ.get("SYNCWISE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "syncwise"
