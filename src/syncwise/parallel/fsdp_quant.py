"""Quantized FSDP2 collectives (ZeRO++'s qgZ and qwZ, written for FSDP2's public hooks).

FSDP2 (torch ≥ 2.9) lets a unit replace its two collectives: ``FSDPModule.set_custom_reduce_scatter`` and
``set_custom_all_gather`` take objects with torch's ``ReduceScatter`` / ``AllGather`` protocol
(``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``): ``allocate(size, dtype=, device=)`` for FSDP2's buffers and
``__call__(output, input, group, [op,] async_op)``. FSDP2 keeps everything around them: the flat buffers, the
padding, the copy-in of the unsharded gradients and the copy-out of the gathered parameters, the streams.

- :class:`QuantizedReduceScatter` (``--compress int8|fp8`` with ``dp_shard > 1`` and one replica): each rank cuts
  its flat fp32 gradient into the ``W`` destination chunks FSDP2's reduce-scatter would send, quantizes each chunk
  in blocks (one fp32 scale per block, its max |x| → the largest code), exchanges the chunks by one
  ``all_to_all_single`` of bytes (codes and scales side by side; gloo and NCCL both have it), and each rank
  dequantizes the ``W`` chunks it received and sums them **in fp32, in rank order** (then divides by W for FSDP2's
  average). No low-precision arithmetic ever accumulates: a ring reduce-scatter in int8 would round again at every
  hop; this rounds once per contribution, and the sum is deterministic (the same order on every run).
  Hierarchical (``dist.hierarchical``, when the shard group spans nodes with several of its ranks on each): the
  chunks are first summed inside the node at full precision (an all-to-all there), and only the node's partial
  sums are quantized and exchanged across nodes — P× fewer cross-node bytes at the same error bound
  (:class:`QuantizedReduceScatter`).
- :class:`QuantizedAllGather` (``--parallel.fsdp_gather=bf16|fp8|int8``): each rank quantizes its shard of the
  unit's parameters (already in FSDP2's all-gather dtype: fp32, or bf16 under bf16 mixed precision), all-gathers
  the bytes, and dequantizes every rank's part — its own included, so every rank computes with the same weights —
  into FSDP2's all-gather buffer. The master weights stay fp32 and sharded; only the transient compute copy is
  rounded. A gather over a smaller group than the one it was built for (the node-local group of
  ``fsdp_reshard=node``, backward's re-gather of forward's resharded parameters) is FSDP2's own, at full precision:
  re-quantizing already rounded values on other block boundaries would give backward other weights than forward.

Codecs (:class:`BlockCodec`): ``int8`` — symmetric integer codes in ``[-levels, levels]`` (``levels`` ≤ 127; ≤ 7
packs two codes per byte: int4), nearest rounding (error ≤ scale/2 = max|block| / (2·levels)) or stochastic
(unbiased, error < scale); ``fp8`` — e4m3 with the block's max mapped to 448 (relative error ≤ 2⁻⁴, nearest);
``bf16`` — a cast (relative error ≤ 2⁻⁸), no scales. No state is kept: no error feedback, and stochastic rounding
draws from a generator seeded per unit and rank (``seed``), so a resumed run draws anew (unbiased either way);
nearest rounding, the default here, is deterministic.

Bytes: each object reports what its rank puts on the wire (``wire_bytes``), which ``attach_timing`` counts as the
'fsdp' dimension's bytes instead of the fp32 input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

#: the codecs a quantized FSDP2 collective can use (``parallel.fsdp_gather`` takes these plus fp32)
CODECS = ("bf16", "fp8", "int8")
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class BlockCodec:
    """Blockwise quantization of a 2-D batch of rows (each row one destination's chunk, ``n`` elements).

    A row becomes ``payload(n)`` bytes: ``ceil(n / block)`` blocks of codes (zero-padded to whole blocks), then one
    fp32 scale per block (none for bf16)."""

    name: str                 # int8 | fp8 | bf16
    block: int = 128
    levels: int = 127         # int8: codes in [-levels, levels]; ≤ 7 packs two per byte
    stochastic: bool = False  # int8 only

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"codec {self.name!r}: one of {CODECS}")
        if self.name == "int8" and self.levels <= 7 and self.block % 2:
            raise ValueError("a 4-bit codec needs an even block")

    @property
    def code_bits(self) -> int:
        return {"bf16": 16, "fp8": 8}.get(self.name, 4 if self.levels <= 7 else 8)

    def blocks(self, n: int) -> int:
        return 1 if self.name == "bf16" else max(1, math.ceil(n / self.block))

    def padded(self, n: int) -> int:
        return n if self.name == "bf16" else self.blocks(n) * self.block

    def code_bytes(self, n: int) -> int:
        return self.padded(n) * self.code_bits // 8

    def payload(self, n: int) -> int:
        """Bytes one row of ``n`` elements takes on the wire."""
        return self.code_bytes(n) + (0 if self.name == "bf16" else 4 * self.blocks(n))

    def max_error(self, amax: float) -> float:
        """The largest absolute rounding error of one element in a block whose max |x| is ``amax``."""
        if self.name == "bf16":
            return amax * 2.0 ** -8  # 8 significant bits, round to nearest even
        if self.name == "fp8":
            return amax * (2.0 ** -4 + 2.0 ** -10)  # 3 mantissa bits (nearest); the subnormal step below 2⁻⁶
        return amax / self.levels * (1.0 if self.stochastic else 0.5)

    # ------------------------------------------------------------------------------------ encode / decode
    def encode(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``x`` (rows × n, any float dtype) → uint8 (rows × payload(n))."""
        rows, n = x.shape
        if self.name == "bf16":
            return x.to(torch.bfloat16).contiguous().view(torch.uint8).view(rows, -1)
        nb, p = self.blocks(n), self.padded(n)
        xf = x.float()
        if p != n:
            xf = torch.nn.functional.pad(xf, (0, p - n))
        xb = xf.view(rows * nb, self.block)
        amax = xb.abs().amax(dim=1)
        top = _FP8_MAX if self.name == "fp8" else float(self.levels)
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        y = xb / scale[:, None]
        if self.name == "fp8":
            codes = y.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            if self.stochastic:
                noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
                y = torch.floor(y + noise)
            else:
                y = torch.round(y)
            q = y.clamp(-self.levels, self.levels)
            if self.code_bits == 4:  # two codes per byte: (q + 8) in 1..15, low nibble first
                u = (q + 8).to(torch.uint8).view(rows * nb, self.block // 2, 2)
                codes = u[..., 0] | (u[..., 1] << 4)
            else:
                codes = q.to(torch.int8).view(torch.uint8)
        out = torch.empty(rows, self.payload(n), dtype=torch.uint8, device=x.device)
        cb = self.code_bytes(n)
        out[:, :cb] = codes.reshape(rows, cb)
        out[:, cb:] = scale.view(rows, nb).contiguous().view(torch.uint8)
        return out

    def decode(self, payload: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 (rows × payload(n)) → ``dtype`` (rows × n)."""
        rows = payload.shape[0]
        if self.name == "bf16":
            return payload.contiguous().view(torch.bfloat16).view(rows, n).to(dtype)
        nb, cb = self.blocks(n), self.code_bytes(n)
        codes = payload[:, :cb].contiguous()
        scale = payload[:, cb:].contiguous().view(torch.float32).view(rows * nb, 1)
        if self.name == "fp8":
            vals = codes.view(torch.float8_e4m3fn).float().view(rows * nb, self.block)
        elif self.code_bits == 4:
            lo = (codes & 0xF).to(torch.int16) - 8
            hi = (codes >> 4).to(torch.int16) - 8
            vals = torch.stack((lo, hi), dim=-1).view(rows * nb, self.block).float()
        else:
            vals = codes.view(torch.int8).float().view(rows * nb, self.block)
        out = (vals * scale).view(rows, nb * self.block)[:, :n]
        return out.to(dtype)


def codec_of(compress: Any) -> BlockCodec:
    """The reduce-scatter's codec from a parsed ``--compress`` spec (``syncwise.layout.Compress``): int8's ``chunk``
    and ``levels``, fp8's ``block``. Rounding is to nearest unless the spec says ``stochastic=true`` explicitly (the
    DDP int8 compressor's default is stochastic; here nearest halves the error and keeps the step deterministic)."""
    o = compress.options
    if compress.name == "int8":
        return BlockCodec("int8", block=int(o["chunk"]), levels=int(o["levels"]),
                          stochastic=bool(compress.given.get("stochastic", False)))
    if compress.name == "fp8":
        return BlockCodec("fp8", block=int(o["block"]))
    raise ValueError(f"no quantized reduce-scatter for {compress.name!r}")


def gather_codec(name: str, block: int = 128) -> Optional[BlockCodec]:
    """``parallel.fsdp_gather``'s codec (None for fp32: FSDP2's own all-gather). int8 / fp8 weights in blocks of
    128 (ZeRO++'s qwZ uses groups of this order; smaller blocks follow the weights' local range more closely)."""
    return None if name == "fp32" else BlockCodec(name, block=block)


class _Alloc:
    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _protocols() -> tuple[type, type]:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    return AllGather, ReduceScatter


class QuantizedReduceScatter(_Alloc):
    """FSDP2's gradient reduce-scatter as quantize → all-to-all → fp32 sum in rank order (module docstring).

    ``hierarchy`` (``dist.hierarchical``, :func:`node_groups`): ``(node_group, cross_group)`` of the shard group's
    ranks laid out nodes × ranks per node. The reduce-scatter then keeps full precision inside the node and
    quantizes only what crosses nodes (ZeRO++'s hierarchical qgZ, with fp32 sums):

    1. inside the node, an all-to-all in the input's dtype: local rank l receives, from each rank of its node, the
       chunks destined for the ranks with local rank l on every node, and sums them in fp32 in local-rank order
       (N node-partial sums of n elements);
    2. across nodes, over local rank l's cross-node group: each node-partial sum is quantized once (blocks, as the
       flat path), exchanged by one all-to-all, dequantized and summed in fp32 in node order.

    Error: node j's partial sum of its P ranks' contributions has |·| ≤ P·max_r ‖g_r‖∞, so its rounding is at most
    ``max_error(P·g) = P·max_error(g)`` (every codec's bound is linear in the block's max); the average of N such
    over W = N·P ranks is off by at most ``max_error(max_r ‖g_r‖∞)`` — the flat path's bound. Bytes across nodes:
    (N − 1)·payload(n) per rank instead of the flat all-to-all's (W − P)·payload(n), P× fewer; the node's link
    carries W·n fp32 values per rank more."""

    def __init__(self, codec: BlockCodec, seed: int = 0, unit: int = 0,
                 hierarchy: Optional[tuple[Any, Any]] = None) -> None:
        self.codec, self.seed, self.unit = codec, seed, unit
        self.hierarchy = hierarchy
        self._gen: Optional[torch.Generator] = None
        self.bytes_sent = 0  # this rank's payloads, all calls (what wire_bytes reports per call)

    def _hierarchical(self, group: Any) -> bool:
        if self.hierarchy is None:
            return False
        node, cross = self.hierarchy
        return group.size() == node.size() * cross.size()

    def wire_bytes(self, input_tensor: torch.Tensor, group: Any) -> int:
        w = group.size()
        n = input_tensor.numel() // w
        if self._hierarchical(group):  # the node's all-to-all in the input's dtype, the nodes' one quantized
            nodes = self.hierarchy[1].size()
            return input_tensor.numel() * input_tensor.element_size() + (nodes * self.codec.payload(n) if nodes > 1
                                                                         else 0)
        return w * self.codec.payload(n)

    def split_bytes(self, nbytes: int, input_tensor: torch.Tensor, group: Any) -> Optional[dict]:
        """``nbytes`` per hop (``comm.ops.split_bytes``): an all-to-all's chunks for other nodes cross; the
        hierarchical path's node all-to-all stays inside the node, its cross-node all-to-all is split likewise."""
        from ..comm import ops
        if not self._hierarchical(group):
            return ops.split_bytes(nbytes, group, "all_to_all")
        node, cross = self.hierarchy
        inside = input_tensor.numel() * input_tensor.element_size()
        return _two_hops(ops.split_bytes(inside, node, "all_to_all"),
                         ops.split_bytes(nbytes - inside, cross, "all_to_all"))

    def _generator(self, device: torch.device, rank: int) -> Optional[torch.Generator]:
        if not self.codec.stochastic:
            return None
        if self._gen is None:
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed((self.seed * 1_000_003 + self.unit * 65_537 + rank) % (2 ** 63))
        return self._gen

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        w = group.size()
        n = output_tensor.numel()
        if input_tensor.numel() != n * w:
            raise RuntimeError(f"reduce-scatter input of {input_tensor.numel()} elements for {w} ranks × {n}")
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"syncwise's quantized reduce-scatter sums or averages; FSDP2 asked for {op} "
                                      "(a gradient_divide_factor is not supported with it)")
        if self._hierarchical(group):
            acc = self._reduce_hierarchical(input_tensor, n, group)
            if op == dist.ReduceOp.AVG:
                acc.div_(w)
            output_tensor.copy_(acc)
            return None
        sent = self.codec.encode(input_tensor.view(w, n), self._generator(input_tensor.device, group.rank()))
        self.bytes_sent += sent.numel()
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)   # row r: rank r's chunk for this rank
        parts = self.codec.decode(received, n)                # (w, n) fp32
        acc = parts[0].clone()
        for r in range(1, w):                                 # rank order: the same sum on every run
            acc.add_(parts[r])
        if op == dist.ReduceOp.AVG:
            acc.div_(w)
        output_tensor.copy_(acc)
        return None  # done: FSDP2 treats a None work as completed


    def _reduce_hierarchical(self, input_tensor: torch.Tensor, n: int, group: Any) -> torch.Tensor:
        """The sum of every rank's chunk for this rank (fp32), node first at full precision (class docstring)."""
        node, cross = self.hierarchy
        p, nodes = node.size(), cross.size()
        # (N, P, n): chunk for group rank j·P + l → (P, N, n): row l holds the chunks for local rank l of each node
        mine = input_tensor.view(nodes, p, n).transpose(0, 1).contiguous()
        got = torch.empty_like(mine)
        dist.all_to_all_single(got.view(-1), mine.view(-1), group=node)   # row l: local rank l's chunks for us
        partial = got[0].to(torch.float32, copy=True)                     # (N, n): the node's sum for (j, my l)
        for r in range(1, p):                                             # local-rank order
            partial.add_(got[r])
        self.bytes_sent += got.numel() * got.element_size()
        if nodes == 1:                                                    # one node: nothing crosses, nothing rounds
            return partial[0]
        sent = self.codec.encode(partial, self._generator(input_tensor.device, group.rank()))
        self.bytes_sent += sent.numel()
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=cross)              # row j: node j's partial sum for us
        parts = self.codec.decode(received, n)
        acc = parts[0].clone()
        for j in range(1, nodes):                                         # node order
            acc.add_(parts[j])
        return acc


def _two_hops(first: Optional[dict], second: Optional[dict]) -> Optional[dict]:
    """The per-hop bytes of a collective made of two (``comm.ops.split_bytes`` of each), None where either's hop is
    not known."""
    if first is None or second is None:
        return None
    return {h: first[h] + second[h] for h in ("intra", "cross")}


def node_groups(groups: Sequence[Sequence[int]], procs_per_node: int, rank: int) -> tuple[Any, Any]:
    """``(node_group, cross_group)`` of global ``rank`` for the hierarchical reduce-scatter. ``groups``: every shard
    group of the job (global ranks, each in group order; the same list on every rank), on nodes of
    ``procs_per_node`` ranks. Each group's ranks must fill whole rows of nodes × k (k of its ranks on each node,
    node-major, as ``syncwise.parallel.mesh`` numbers them). Every rank creates every group's node and cross
    subgroups, in the same order (``new_group`` is collective over the whole job; ``apply_fsdp`` runs on every
    rank)."""
    mine: Optional[tuple[Any, Any]] = None
    for ranks in groups:
        ranks = list(ranks)
        nodes = [r // procs_per_node for r in ranks]
        distinct = list(dict.fromkeys(nodes))
        k = len(ranks) // max(len(distinct), 1)
        rows = [ranks[i * k:(i + 1) * k] for i in range(len(distinct))]
        if k * len(distinct) != len(ranks) or any(nodes[i * k:(i + 1) * k] != [distinct[i]] * k
                                                   for i in range(len(distinct))):
            raise ValueError(f"shard group {ranks} on nodes of {procs_per_node} ranks: not whole nodes × the same "
                             "number of ranks each, node-major (the hierarchical reduce-scatter needs them)")
        node_pgs = [dist.new_group(row) for row in rows]
        cross_pgs = [dist.new_group([row[j] for row in rows]) for j in range(k)]
        if rank in ranks:
            i = ranks.index(rank)
            mine = (node_pgs[i // k], cross_pgs[i % k])
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the shard groups {groups}")
    return mine


class QuantizedAllGather(_Alloc):
    """FSDP2's parameter all-gather with blockwise-quantized shards, dequantized into FSDP2's buffer (module
    docstring). ``world``: the shard group's size it quantizes over; a smaller group (the post-forward node-local
    group) is gathered at full precision. ``hierarchy`` (the quantized reduce-scatter's ``(node_group,
    cross_group)``, ``dist.hierarchical``): the payloads go across nodes first, among the ranks of the same local
    rank (each crosses once per other node, the node's P such gathers at once), then inside the node — the same
    bytes in the same order as the flat ring (bit-identical weights), (N − 1)·payload across per rank instead of the
    ring's share of (W − 1) payloads, and the slow link kept busy by P gathers instead of one ring."""

    def __init__(self, codec: BlockCodec, world: int, hierarchy: Optional[tuple[Any, Any]] = None) -> None:
        self.codec, self.world = codec, world
        self.hierarchy = hierarchy if hierarchy is not None and hierarchy[1].size() > 1 else None
        self.bytes_sent = 0

    def _quantizes(self, group: Any) -> bool:
        return group.size() == self.world

    def wire_bytes(self, input_tensor: torch.Tensor, group: Any) -> int:
        if not self._quantizes(group):
            return input_tensor.numel() * input_tensor.element_size()
        if self.hierarchy is not None:   # the payload into the cross-node gather, the N gathered into the node's
            return self.codec.payload(input_tensor.numel()) * (1 + self.hierarchy[1].size())
        return self.codec.payload(input_tensor.numel())

    def split_bytes(self, nbytes: int, input_tensor: torch.Tensor, group: Any) -> Optional[dict]:
        """``nbytes`` per hop (``comm.ops.split_bytes``): a ring over the group, or, hierarchical, the cross-node
        gather's input (its group holds one rank per node: all of it crosses) and the node's gather (inside)."""
        from ..comm import ops
        if self.hierarchy is None or not self._quantizes(group):
            return ops.split_bytes(nbytes, group, "ring")
        node, cross = self.hierarchy
        b = self.codec.payload(input_tensor.numel())
        return _two_hops(ops.split_bytes(b, cross, "ring"), ops.split_bytes(nbytes - b, node, "ring"))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        self.bytes_sent += self.wire_bytes(input_tensor, group)
        if not self._quantizes(group):
            dist.all_gather_single(output_tensor, input_tensor, group=group)
            return None
        w, n = group.size(), input_tensor.numel()
        mine = self.codec.encode(input_tensor.view(1, n))
        if self.hierarchy is not None:
            gathered = self._gather_hierarchical(mine.view(-1))
        else:
            gathered = torch.empty(w * mine.shape[1], dtype=torch.uint8, device=mine.device)
            dist.all_gather_single(gathered, mine.view(-1), group=group)
        # every rank's part, this rank's too: all ranks compute with the same rounded weights
        output_tensor.view(w, n).copy_(self.codec.decode(gathered.view(w, -1), n, output_tensor.dtype))
        return None

    def _gather_hierarchical(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's payload in group order (rank j·P + l: node j, local rank l): across nodes first, among the
        ranks of this local rank (each payload crosses once per other node, the node's P such groups at once), then
        inside the node."""
        node, cross = self.hierarchy
        p, nodes, b = node.size(), cross.size(), mine.numel()
        across = torch.empty(nodes * b, dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(across, mine, group=cross)                 # (N, b): node j's payload of my l
        inside = torch.empty(p * nodes * b, dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(inside, across, group=node)                # (P, N, b): local rank l's row
        return inside.view(p, nodes, b).transpose(0, 1).contiguous().view(-1)


def _register() -> None:
    """Make both classes instances of torch's protocols (FSDP2 checks ``isinstance`` in places)."""
    AllGather, ReduceScatter = _protocols()
    ReduceScatter.register(QuantizedReduceScatter)
    AllGather.register(QuantizedAllGather)


_register()
