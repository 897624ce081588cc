"""Lossless baseline and cast compressors: none (fp32), fp16, bf16, fp8 e4m3 with per-block scales."""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import torch

from ..errors import ConfigError
from .base import Compressor, GatherCompressor, config_class, flat_view, flatten, unflatten_into


class NoneCompressor(Compressor):
    """Plain fp32 all-reduce average: the DDP baseline, one collective per bucket, no copy."""

    name: ClassVar[str] = "none"
    #: the DDP hook sends the whole bucket in this dtype with one collective, straight from the hook
    wire_dtype: ClassVar[Optional[torch.dtype]] = torch.float32

    def average(self, tensors: Sequence[torch.Tensor], keys: Sequence[str], group: Any = None,
                compress: Optional[Sequence[bool]] = None) -> Sequence[torch.Tensor]:
        """Average everything uncompressed (the policy flags are irrelevant here)."""
        return super().average(tensors, keys, group, [False] * len(tensors))

    def _average(self, comp, keys, raw, group, world):
        # no state: a NaN/Inf on any rank reaches every rank through the sum itself
        self._average_raw(raw, group, world)
        return True


class _CastCompressor(Compressor):
    """All-reduce in a 16-bit dtype. Pre-divides by world size (as torch's fp16 hook) so the sum
    cannot overflow where the average would not. Works on gloo and NCCL alike."""

    dtype: ClassVar[torch.dtype]

    def average(self, tensors: Sequence[torch.Tensor], keys: Sequence[str], group: Any = None,
                compress: Optional[Sequence[bool]] = None) -> Sequence[torch.Tensor]:
        """Cast every tensor: a 2-byte bias costs nothing and keeps it to one collective per bucket."""
        return super().average(tensors, keys, group, [True] * len(tensors))

    def _average(self, comp, keys, raw, group, world):
        if not comp:
            return True
        flat = flat_view(comp)
        # .to copies (or aliases when grads already are 16-bit, where working in place is fine too)
        buf = (flat if flat is not None else flatten(comp)).to(self.dtype)
        buf.div_(world)
        self._all_reduce_sum(buf, group)
        if flat is not None:
            flat.copy_(buf)
        else:
            unflatten_into(buf, comp)
        return True  # no state: a NaN/Inf on any rank reaches every rank through the sum itself


class FP16Compressor(_CastCompressor):
    """fp16 all-reduce (2 bytes/element)."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16
    wire_dtype: ClassVar[Optional[torch.dtype]] = torch.float16


class BF16Compressor(_CastCompressor):
    """bf16 all-reduce (2 bytes/element); unlike torch's bf16 hook it also runs on gloo."""

    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
    wire_dtype: ClassVar[Optional[torch.dtype]] = torch.bfloat16


_FP8 = getattr(torch, "float8_e4m3fn", None)


FP8Config = config_class("fp8", "FP8Config", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS

_FP8_TABLES: dict = {}


def _fp8_table(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 fp8 e4m3 bit patterns."""
    table = _FP8_TABLES.get(device)
    if table is None:
        patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _FP8_TABLES[device] = patterns.view(_FP8).float().to(device)
    return table


class FP8Compressor(GatherCompressor):
    """fp8 e4m3 with one fp32 scale per block; all-gather of bytes, fp32 sum locally (gloo cannot
    reduce fp8, and an fp8 running sum would lose the low bits anyway)."""

    name: ClassVar[str] = "fp8"
    Config: ClassVar[type] = FP8Config
    direct: ClassVar[bool] = True

    def _validate(self) -> None:
        if _FP8 is None:
            raise ConfigError("compress", "fp8", "a torch build with torch.float8_e4m3fn (torch>=2.1)")
        if self.config.block < 1:
            raise ConfigError("compress", f"fp8:block={self.config.block}", "block >= 1")

    def _encode(self, x, sizes, keys, rank):
        b = self.config.block
        n = x.numel()
        nb = -(-n // b)
        # codes of the first n elements, then the scales (the zero padding of the last block is not sent); in passes of
        # whole blocks, so no temporary is bucket-sized (see _CHUNK)
        payload = torch.empty(n + 4 * nb, dtype=torch.uint8, device=x.device)
        scale = torch.empty(nb, dtype=torch.float32, device=x.device)
        step = self._step(x.device)
        for start in range(0, n, step):
            stop = min(start + step, n)
            m, blocks = stop - start, -(-(stop - start) // b)
            xc = x[start:stop]
            xp = (xc if m == blocks * b else torch.nn.functional.pad(xc, (0, blocks * b - m))).view(blocks, b)
            sc = scale[start // b:start // b + blocks]
            torch.amax(xp.abs(), 1, out=sc)
            sc.div_(torch.finfo(_FP8).max).clamp_min_(torch.finfo(torch.float32).tiny)
            q = torch.div(xp, sc[:, None]).to(_FP8).view(-1)[:m]
            payload[start:stop].copy_(q.view(torch.uint8))
        payload[n:].copy_(scale.view(torch.uint8))
        local = self._decode_sum(payload[None], sizes, n) if self.config.error_feedback else None
        return payload, local

    #: elements encoded or decoded per pass (whole blocks; at least one): each pass's temporaries are ~1 MB (the decode
    #: reuses its index and value buffers pass after pass). Decoding a whole 25 MB bucket at once made two fresh 4-bytes-per-element
    #: temporaries per payload on gloo's callback thread every step; on CPU glibc then raised its mmap threshold to
    #: their size and served them from that thread's arena, whose heaps fragmented: the workers' resident set
    #: grew by ~15 MB a step (`small`, 400 steps: 2,409 MB against fp32 DDP's 617 MB, issue 26). The sum's own
    #: buffer is made by ``pack`` on the hook's thread (``_decode_buffer``) for the same reason; the encode's
    #: bucket-sized |x|, x/scale and fp8 temporaries were the rest of the growth.
    _CHUNK: ClassVar[int] = 1 << 18

    def _step(self, device: torch.device) -> int:
        """Elements per encode/decode pass on ``device`` (whole blocks): :data:`_CHUNK` on the CPU, where it keeps the
        heap flat; the whole bucket elsewhere — on a GPU the caching allocator has no such growth, and 2^18-element
        passes made fp8 launch-bound (~1e5 kernel launches per step at 0.87 B parameters, world 8; issue 39 N4)."""
        b = self.config.block
        return max(b, self._CHUNK // b * b) if torch.device(device).type == "cpu" else 1 << 62

    def _decode_buffer(self, n, device):
        return torch.empty(-(-n // self.config.block) * self.config.block, dtype=torch.float32, device=device)

    def _decode_sum(self, gathered, sizes, n, out=None):
        b = self.config.block
        nb = -(-n // b)
        world = gathered.shape[0]
        scales = gathered[:, n:].contiguous().view(torch.float32)
        table = _fp8_table(gathered.device)
        total = self._decode_buffer(n, gathered.device) if out is None else out
        step = self._step(gathered.device)  # whole blocks per pass
        idx = torch.empty(min(step, n), dtype=torch.int32, device=gathered.device)
        q = torch.empty(min(step, nb * b), dtype=torch.float32, device=gathered.device)
        for start in range(0, n, step):
            stop = min(start + step, n)
            m, blocks = stop - start, -(-(stop - start) // b)
            out = total[start:start + blocks * b].view(blocks, b)
            qc = q[:blocks * b]
            if m < blocks * b:  # the last block's zero padding is not sent
                qc[m:].zero_()
            for w in range(world):  # rank order: the same fp32 sum on every rank
                # fp8 -> fp32 through a 256-entry table: ~7x faster than .float() on CPU, bit-identical
                ic = idx[:m]
                ic.copy_(gathered[w, start:stop])
                torch.index_select(table, 0, ic, out=qc[:m])
                s = scales[w, start // b:start // b + blocks, None]
                if w == 0:
                    torch.mul(qc.view(blocks, b), s, out=out)
                else:
                    out.addcmul_(qc.view(blocks, b), s)
        return total[:n]
