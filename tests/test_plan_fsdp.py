"""The planner prices FSDP2's compressed collectives (issue 40): parallel.fsdp_gather, fsdp_reshard and the quantized
reduce-scatter (flat and hierarchical) — bytes per hop, codec time, memory per rank — by the runtime's own rules.

The cross-node bytes are checked against the formulas the run's summary counts with (``comm.ops.cross_share``:
a ring over the shard group's W ranks, k per node, crosses on 1/k of its input; an all-to-all on (W − k)/W), on
2 nodes × 2 (W = 4, k = 2) with one micro-batch: per step and rank, P the stage's parameters, R the part backward
gathers again (FSDP2's units as apply_fsdp wraps them — the embedding, each block, the head, the root — all but the
head and the root, which are not resharded after forward: P less the head's matrix and the final norm),

- fp32 FSDP2: gathers (P + R)/4 × 4 B, reduce-scatter P × 4 B, half of each across;
- int8 flat reduce-scatter: P × (1 + 4/1024) B by all-to-all, 2 of 4 chunks across;
- hierarchical: P × 4 B inside the node, P/2 × (1 + 4/1024) B by an all-to-all over 2 nodes, half across;
- int8 gathers: (P + R)/4 × (1 + 4/128) B; fsdp_reshard=node: forward's P/4 × int8 across the 4 ranks, backward's
  gather inside the node (R/2 × 4 B, 0 across).
"""
import pytest

from syncwise.layout import fsdp_gather_bytes_per_element, fsdp_reduce_bytes_per_element, parse_compress
from syncwise.plan import Layout, load_model, predict
from syncwise.plan.memory import stage_params
from syncwise.plan.strategy import job_cloud, rank

INT8 = 1 + 4 / 1024
GATHER8 = 1 + 4 / 128
ZPP = dict(compress="int8", fsdp_gather="int8", fsdp_reshard="node")


def _p(cloud, **kw):
    return predict(cloud, load_model("small-dense", 128), Layout(dp_shard=4, micro_batch=8, **kw), 32, 128)


def _params():
    return stage_params(load_model("small-dense", 128), Layout(dp_shard=4, micro_batch=8)).total


def _regathered():
    """R: P less the head (vocab × d) and the final norm (d), which FSDP2 keeps from forward to backward."""
    m = load_model("small-dense", 128)
    return _params() - m.vocab_size * m.d_model - m.d_model


def test_wire_bytes_per_element_are_the_codecs():
    assert fsdp_reduce_bytes_per_element(parse_compress("int8")) == INT8
    assert fsdp_reduce_bytes_per_element(parse_compress("int8:levels=7")) == 0.5 + 4 / 1024   # int4: packed
    assert fsdp_reduce_bytes_per_element(parse_compress("fp8")) == 1 + 4 / 128
    assert fsdp_gather_bytes_per_element("fp32", 4) == 4 and fsdp_gather_bytes_per_element("fp32", 2) == 2
    assert fsdp_gather_bytes_per_element("bf16", 4) == 2 and fsdp_gather_bytes_per_element("int8", 2) == GATHER8


def test_priced_cross_node_bytes_fall_as_the_formulas_say():
    cloud, P, R = job_cloud(2, 2, 50e6), _params(), _regathered()
    got = {name: _p(cloud, **kw).info["fsdp_bytes_per_step"] for name, kw in {
        "fp32": {}, "bf16": dict(compress="bf16"), "int8-flat": dict(compress="int8", hierarchical="off"),
        "int8-hier": dict(compress="int8"), "qwZ": dict(fsdp_gather="int8"), "hpZ": dict(fsdp_reshard="node"),
        "zpp-flat": dict(ZPP, hierarchical="off"), "zpp": ZPP}.items()}
    expected_cross = {
        "fp32": 0.5 * (P + R + 4 * P),
        "bf16": 0.5 * (P + R + 2 * P),
        "int8-flat": 0.5 * (P + R + INT8 * P),
        "int8-hier": 0.5 * (P + R + INT8 * P / 2),
        "qwZ": 0.5 * ((P + R) / 4 * GATHER8 + 4 * P),
        "hpZ": 0.5 * (P + 4 * P),
        "zpp-flat": 0.5 * (P / 4 * GATHER8 + INT8 * P),
        # hierarchical gather: each rank's shard goes whole into the gather across nodes (one rank per node)
        "zpp": P / 4 * GATHER8 + 0.5 * INT8 * P / 2,
    }
    for name, cross in expected_cross.items():
        assert got[name]["cross"] == pytest.approx(cross, rel=1e-9), name
    # the hierarchical reduce-scatter moves its fp32 inside the node: more intra, fewer across
    assert got["int8-hier"]["intra"] > got["int8-flat"]["intra"]
    assert got["hpZ"]["intra"] == pytest.approx(0.5 * (P + 4 * P) + R / 2 * 4)
    # the goal for qgZ + qwZ + hpZ, priced: ≥ 3.5× fewer cross-node bytes than fp32 FSDP2 (4.7×, 7.9×)
    assert got["fp32"]["cross"] / got["zpp-flat"]["cross"] > 3.5
    assert got["fp32"]["cross"] / got["zpp"]["cross"] > got["fp32"]["cross"] / got["zpp-flat"]["cross"]
    # one node: nothing crosses, whatever the options
    one = _p(job_cloud(1, 4, None), **ZPP).info["fsdp_bytes_per_step"]
    assert one["cross"] == 0 and one["intra"] > 0


def test_step_time_codec_time_and_memory_follow_the_options():
    cloud, P = job_cloud(2, 2, 50e6), _params()
    fp32, zpp, zpp_flat = _p(cloud), _p(cloud, **ZPP), _p(cloud, **ZPP, hierarchical="off")
    assert zpp.step_time_s < zpp_flat.step_time_s < fp32.step_time_s     # a 50 Mbit/s link: the bytes dominate
    assert zpp.inter_node_bytes < zpp_flat.inter_node_bytes < fp32.inter_node_bytes
    assert fp32.breakdown["compress_compute"] == 0 < zpp.breakdown["compress_compute"]
    # the hierarchical reduce-scatter encodes 1/k of the elements the flat one does
    assert _p(cloud, compress="int8").breakdown["compress_compute"] < \
        _p(cloud, compress="int8", hierarchical="off").breakdown["compress_compute"]
    # memory per rank: node keeps each unit sharded over the node's 2 ranks between forward and backward (P/2 × 4 B),
    # none keeps it whole (P × 4 B); all keeps nothing extra
    GiB = 2 ** 30
    assert "fsdp_forward_copies" not in fp32.memory
    assert _p(cloud, fsdp_reshard="node").memory["fsdp_forward_copies"] == pytest.approx(P * 4 / 2 / GiB)
    assert _p(cloud, fsdp_reshard="none").memory["fsdp_forward_copies"] == pytest.approx(P * 4 / GiB)
    assert _p(cloud, fsdp_reshard="none").info["fsdp_gather_total_per_microbatch"] < \
        fp32.info["fsdp_gather_total_per_microbatch"]                      # no backward gather


def test_plan_strategy_prices_int8_and_fp8_as_fsdp2s_quantized_reduce_scatter():
    """On a dp_shard layout `--compress auto` / `plan --strategy` rank int8 and fp8 as the quantized reduce-scatter
    (the layout owner accepts them there), with the layout's fsdp_gather / fsdp_reshard in every candidate's price."""
    from syncwise import layout as owner

    cloud, m = job_cloud(2, 2, 50e6), load_model("small-dense", 128)
    for opts in ({}, {"fsdp_gather": "int8", "fsdp_reshard": "node"}):
        lay = owner.Layout.of(dp_shard=4, compress="auto", **opts)
        ranked = {r.spec: r for r in rank(cloud, m, lay, 32, 128, micro_batch=8)}
        for name in ("int8", "fp8"):
            assert not ranked[name].why_not.startswith("not on this layout"), ranked[name]
            assert ranked[name].step_time_s < ranked["none"].step_time_s
            assert ranked[name].step_time_s == pytest.approx(_p(cloud, compress=name, **opts).step_time_s)


def test_plan_layout_reads_and_writes_the_fsdp_options():
    from syncwise.errors import ConfigError
    from syncwise.plan.layout import parse_layout

    lay = parse_layout("dp_shard=4,compress=int8,fsdp_gather=int8,fsdp_reshard=node,hierarchical=off", 4)
    assert (lay.fsdp_gather, lay.fsdp_reshard, lay.hierarchical) == ("int8", "node", "off")
    assert parse_layout(lay.text(), 4).text() == lay.text() and "fsdp_reshard=node" in lay.text()
    with pytest.raises(ConfigError):
        parse_layout("dp_shard=4,fsdp_gather=int4", 4)


def test_hierarchical_on_one_node_is_priced_as_the_fp32_sum_inside_it():
    """dist.hierarchical=on with every shard rank on one node: the runtime sums in fp32 inside the node and encodes
    nothing (fsdp_quant: one node rounds nothing); the planner prices the fp32 all-to-all and no codec time."""
    one = job_cloud(1, 4, None)
    on = _p(one, compress="int8", hierarchical="on")
    assert on.breakdown["compress_compute"] == 0
    assert on.info["fsdp_bytes_per_step"]["cross"] == 0
    assert _p(one, compress="int8").breakdown["compress_compute"] > 0        # auto on one node: the flat all-to-all


def _calls_worker(rank, world, _):
    """fp32 FSDP2 and qgZ + qwZ + hpZ (hierarchical) on the tiny preset over 2 nodes × 2 gloo ranks: the collectives
    of the second step (forward + backward), seen at the operator level (a TorchDispatchMode over c10d's ops, as
    comm.counting's counter sees FSDP2's), by kind and by the hop of their group (comm.ops.hop_of)."""
    import collections

    import torch
    import torch.nn.functional as F
    from torch.distributed import distributed_c10d as c10d
    from torch.utils._python_dispatch import TorchDispatchMode

    from syncwise.comm import ops
    from syncwise.comm.counting import _group_name
    from syncwise.models import build_model
    from syncwise.parallel.fsdp import apply_fsdp
    from syncwise.parallel.fsdp_quant import BlockCodec
    from syncwise.parallel.mesh import ParallelSpec, build_mesh

    kinds = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_":
             "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter", "alltoall_base_": "all_to_all",
             "alltoall_": "all_to_all", "allreduce_": "all_reduce"}

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            kind = kinds.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
            if kind:
                self.seen[f"{kind} {ops.hop_of(c10d._resolve_process_group(_group_name(args, kwargs)))}"] += 1
            return func(*args, **kwargs)

    mesh = build_mesh(ParallelSpec(dp_shard=world), "cpu")
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, kw in (("fp32", {}), ("zpp", dict(reduce_codec=BlockCodec("int8", 1024), gather_codec=BlockCodec("int8"),
                                                reshard_after_forward=2, hierarchical_reduce=True))):
        torch.manual_seed(0)
        model = apply_fsdp(build_model("tiny", seq_len=16), mesh, ("dp_shard",), **kw)
        for _ in range(2):                       # the second step: FSDP2's lazy initialisation is behind it
            calls = Calls()
            with calls:
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            model.zero_grad()
        out[name] = dict(calls.seen)
    return out


def test_fsdp2_collectives_per_step_are_the_ones_priced():
    """The calls the planner charges a latency for (``info['fsdp_collectives_per_step']``: FSDP2's units — the
    embedding, 2 blocks, the head, the root: 5 — each one gather forward and one reduce; backward re-gathers the 3 it
    resharded) are the calls a real step makes, kind by kind and hop by hop: fp32 FSDP2 8 gathers and 5
    reduce-scatters over the 4 ranks (across nodes); qgZ + qwZ + hpZ 5 int8 gathers across (each followed by one
    inside the node: the hierarchical gather), 3 backward gathers inside
    the node (hpZ), and the hierarchical reduce-scatter's 2 all-to-alls per unit, one inside the node, one across."""
    from distributed import run_workers

    got = run_workers(_calls_worker, 4, None, local_world_size=2, timeout=300)
    cloud, m = job_cloud(2, 2, 50e6), load_model("tiny", 16)
    for name, kw in (("fp32", {}), ("zpp", ZPP)):
        priced = predict(cloud, m, Layout(dp_shard=4, micro_batch=2, **kw), 8, 16).info["fsdp_collectives_per_step"]
        assert all(r[name] == priced for r in got), (name, priced, got[0][name])
    assert priced == {"all_gather cross": 5, "all_gather intra": 8, "all_to_all intra": 5, "all_to_all cross": 5}
