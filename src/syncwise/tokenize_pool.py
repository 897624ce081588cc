"""The tokenizing processes' side of ``syncwise.data.tokenized`` (``--data.tokenizer``): a torch-free leaf, so a
spawned worker imports only this, ``tokenizers`` and numpy (importing ``syncwise.data`` would pay for torch in every
worker)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np

_TOKENIZER: Any = None


def init(tokenizer_file: str) -> None:
    """Process initializer: load the (already validated) tokenizer.json once per process, single-threaded."""
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_file(tokenizer_file)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """The tokenizers library's own thread pool off for a while (its ``TOKENIZERS_PARALLELISM``, read per call)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode(texts: list[str], special: bool, dtype: str, tok: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts``, concatenated, and each text's length; ``special``: whether the tokenizer's own
    special tokens (its post-processor's BOS, say) are added. ``encode_batch_fast`` (no offsets) on one thread:
    the process count is the parallelism."""
    tok = tok if tok is not None else _TOKENIZER
    ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=special)]
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for i in ids for t in i), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths
