"""The planner prices FSDP2's compressed collectives (issue 40): parallel.fsdp_gather, fsdp_reshard and the quantized
reduce-scatter (flat and hierarchical) — bytes per hop, codec time, memory per rank — by the runtime's own rules.

The cross-node bytes are checked against the formulas the run's summary counts with (``comm.ops.cross_share``:
a ring over the shard group's W ranks, k per node, crosses on 1/k of its input; an all-to-all on (W − k)/W), on
2 nodes × 2 (W = 4, k = 2) with one micro-batch: per step and rank, P the stage's parameters,

- fp32 FSDP2: gathers 2 × P/4 × 4 B, reduce-scatter P × 4 B, half of each across: 3·P;
- int8 flat reduce-scatter: P × (1 + 4/1024) B by all-to-all, 2 of 4 chunks across;
- hierarchical: P × 4 B inside the node, P/2 × (1 + 4/1024) B by an all-to-all over 2 nodes, half across;
- int8 gathers: P/4 × (1 + 4/128) B; fsdp_reshard=node: backward's gather inside the node (P/2 × 4 B, 0 across).
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


def test_wire_bytes_per_element_are_the_codecs():
    assert fsdp_reduce_bytes_per_element(parse_compress("int8")) == INT8
    assert fsdp_reduce_bytes_per_element(parse_compress("int8:levels=7")) == 0.5 + 4 / 1024   # int4: packed
    assert fsdp_reduce_bytes_per_element(parse_compress("fp8")) == 1 + 4 / 128
    assert fsdp_gather_bytes_per_element("fp32", 4) == 4 and fsdp_gather_bytes_per_element("fp32", 2) == 2
    assert fsdp_gather_bytes_per_element("bf16", 4) == 2 and fsdp_gather_bytes_per_element("int8", 2) == GATHER8


def test_priced_cross_node_bytes_fall_as_the_formulas_say():
    cloud, P = job_cloud(2, 2, 50e6), _params()
    got = {name: _p(cloud, **kw).info["fsdp_bytes_per_step"] for name, kw in {
        "fp32": {}, "bf16": dict(compress="bf16"), "int8-flat": dict(compress="int8", hierarchical="off"),
        "int8-hier": dict(compress="int8"), "qwZ": dict(fsdp_gather="int8"), "hpZ": dict(fsdp_reshard="node"),
        "zpp-flat": dict(ZPP, hierarchical="off"), "zpp": ZPP}.items()}
    expected_cross = {
        "fp32": 0.5 * (2 * P + 4 * P),
        "bf16": 0.5 * (2 * P + 2 * P),
        "int8-flat": 0.5 * (2 * P + INT8 * P),
        "int8-hier": 0.5 * (2 * P + INT8 * P / 2),
        "qwZ": 0.5 * (2 * P / 4 * GATHER8 + 4 * P),
        "hpZ": 0.5 * (P + 4 * P),
        "zpp-flat": 0.5 * (P / 4 * GATHER8 + INT8 * P),
        "zpp": 0.5 * (P / 4 * GATHER8 + INT8 * P / 2),
    }
    for name, cross in expected_cross.items():
        assert got[name]["cross"] == pytest.approx(cross, rel=1e-9), name
    # the hierarchical reduce-scatter moves its fp32 inside the node: more intra, fewer across
    assert got["int8-hier"]["intra"] > got["int8-flat"]["intra"]
    assert got["hpZ"]["intra"] == pytest.approx(0.5 * (P + 4 * P) + P / 2 * 4)
    # the goal for qgZ + qwZ + hpZ, priced: ≥ 3.5× fewer cross-node bytes than fp32 FSDP2 (4.8×, 7.9×)
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
