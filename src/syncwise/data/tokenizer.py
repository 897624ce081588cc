"""Byte-level tokenizer: every UTF-8 byte is one token, so any text is encodable and vocab is 256."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); decoding replaces invalid byte sequences."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a compact uint8 numpy array (no per-byte Python ints)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; a model can emit byte sequences that are not valid UTF-8, hence 'replace'."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().reshape(-1).tolist()
        elif isinstance(ids, np.ndarray):
            ids = ids.reshape(-1).tolist()
        try:
            data = bytes(ids)
        except ValueError as exc:  # an id outside 0..255 is a caller bug, say which one
            bad = next(i for i in ids if not 0 <= int(i) < 256)
            raise ValueError(f"ByteTokenizer.decode: token id {bad} is outside 0..255") from exc
        return data.decode("utf-8", errors="replace")
