"""The planner's token-bucket link (the lab's tbf burst) and its measured compressor compute (issue 28 items 1, 4
and 5): pure Python except the parameter count against the built presets and one 1-rank codec measurement."""
from __future__ import annotations

import dataclasses

import pytest

from syncwise.errors import ConfigError
from syncwise.plan import SYNCWISE, Layout, cloud_from_dict, load_model, predict
from syncwise.plan.cost import compressor_wire, _codec_time
from syncwise.plan.strategy import job_cloud

TINY = load_model("tiny", 128)


def _step(cloud, compress="none", **kw):
    return predict(cloud, TINY, Layout(dp_replicate=2, compress=compress, micro_batch=8, **kw), 16, 128)


# ------------------------------------------------------------------------------------------------ the burst
def test_burst_credit_is_the_bucket_or_what_refilled_it():
    f = job_cloud(2, 1, 20e6, burst_bytes=131072).inter_node
    assert f.burst_credit(10.0) == 131072                       # a long gap: the whole bucket
    assert f.burst_credit(0.01) == pytest.approx(2.5e6 * 0.01)  # 10 ms at 20 Mbit/s refills 25 KB
    assert job_cloud(2, 1, 20e6).inter_node.burst_credit(10.0) == 0.0


def test_a_sync_inside_the_bucket_pays_only_latency_and_a_larger_one_the_rest_at_the_rate():
    plain, shaped = job_cloud(2, 1, 1e9), job_cloud(2, 1, 1e9, burst_bytes=500_000)
    # tiny's fp32 gradients: 558 KB a step; bf16 279 KB fits the 500 KB bucket that refilled while the step computed
    bf = _step(shaped, "bf16").breakdown["dp_comm_exposed"]
    lat = 2 * shaped.inter_node.latency                          # a 2-rank all-reduce: 2 message steps
    assert bf == pytest.approx(lat, rel=1e-6)
    fp32_plain = _step(plain).breakdown["dp_comm_exposed"]
    fp32 = _step(shaped).breakdown["dp_comm_exposed"]
    nbytes = 4 * TINY.param_counts()[0]
    beyond = (nbytes - 500_000) / shaped.inter_node.effective
    assert fp32 == pytest.approx(lat + beyond, rel=1e-6) and fp32 < fp32_plain
    # the bytes counted as crossing the link do not change: only their time does
    assert _step(shaped).inter_node_bytes == _step(plain).inter_node_bytes


def test_the_bucket_refills_only_while_the_step_computes():
    """At 20 Mbit/s the 128 KiB bucket refills ~47 KB in a 19 ms step: most of it is not there again."""
    cloud = job_cloud(2, 1, 20e6, burst_bytes=131072)
    p = _step(cloud, "fp8")
    compute = p.breakdown["compute"]
    credit = cloud.inter_node.burst_credit(compute)
    assert credit < 131072
    plain = _step(job_cloud(2, 1, 20e6), "fp8")
    saved = plain.breakdown["dp_comm_exposed"] - p.breakdown["dp_comm_exposed"]
    assert saved == pytest.approx(credit / cloud.inter_node.effective, rel=1e-6)


def test_one_node_has_no_burst_and_the_toml_key_is_checked():
    one = dataclasses.replace(job_cloud(2, 1, 1e9, burst_bytes=500_000), nodes=1, gpus_per_node=2)
    assert predict(one, TINY, Layout(dp_replicate=2, micro_batch=8), 16, 128).step_time_s > 0
    c = cloud_from_dict({"nodes": 2, "gpus_per_node": 1, "accelerator": "cpu-lab",
                         "inter_node": {"name": "x", "kind": "lab", "bandwidth_gbit_s": 1, "burst_kbyte": 500}})
    assert c.inter_node.burst_bytes == 500_000
    with pytest.raises(ConfigError, match=r"cluster.inter_node.burst_kbyte.*-1"):
        cloud_from_dict({"nodes": 2, "gpus_per_node": 1, "inter_node": {"name": "x", "bandwidth_gbit_s": 1,
                                                                         "burst_kbyte": -1}})


# ------------------------------------------------------------------------------------------------ the codec
def test_tensor_count_is_the_built_models_parameter_count():
    from syncwise.models import PRESETS, build_model

    for name in PRESETS:
        if name in ("large", "xl", "xl-dense"):
            continue                     # same rule, minutes to build on a CPU
        assert load_model(name).tensor_count() == len(list(build_model(name).parameters())), name


def test_measured_codec_cost_prices_elements_tensors_and_peers():
    acc = dataclasses.replace(job_cloud(2, 1, 1e9).accelerator, codec_cost=(("fp8", 5e-9, 20e-6),))
    cloud = dataclasses.replace(job_cloud(2, 1, 1e9), accelerator=acc)
    wire = compressor_wire("fp8", TINY, SYNCWISE)
    one = _codec_time(cloud, wire, 1e6, 1, 10)
    assert one == pytest.approx(1e6 * 5e-9 + 10 * 20e-6)
    # more peers: more payloads to decode (CODEC_COST's per-peer share), never less
    assert _codec_time(cloud, wire, 1e6, 8, 10) > _codec_time(cloud, wire, 1e6, 2, 10) > one
    # a compressor the accelerator has no measurement of is priced from CODEC_COST as before
    catalog = dataclasses.replace(cloud, accelerator=dataclasses.replace(acc, codec_cost=()))
    int8 = compressor_wire("int8", TINY, SYNCWISE)
    assert _codec_time(cloud, int8, 1e6, 2, 10) == _codec_time(catalog, int8, 1e6, 2, 10)
    # and the step's compress_compute is that price for the rank's elements and tensors
    p = predict(cloud, TINY, Layout(dp_replicate=2, compress="fp8", micro_batch=8), 16, 128)
    assert p.breakdown["compress_compute"] == pytest.approx(
        _codec_time(cloud, wire, TINY.param_counts()[0], 2, TINY.tensor_count()))


def test_codec_cost_toml_table_is_checked():
    base = {"nodes": 1, "gpus_per_node": 2, "intra_node": "lab-loopback"}
    acc = {"name": "cpu-lab", "codec_cost": {"fp8": [5.5, 14.0]}}
    c = cloud_from_dict({**base, "accelerator": acc})
    assert c.accelerator.codec("fp8") == pytest.approx((5.5e-9, 14e-6)) and c.accelerator.codec("int8") is None
    for bad, field in (({"zstd": [1, 1]}, "codec_cost.zstd"), ({"fp8": [1]}, "codec_cost.fp8"),
                       ({"fp8": [-1, 1]}, r"codec_cost.fp8\[0\]"), ([1, 2], "codec_cost")):
        with pytest.raises(ConfigError, match=field):
            cloud_from_dict({**base, "accelerator": {**acc, "codec_cost": bad}})


def test_fit_codec_recovers_per_element_and_per_tensor_costs():
    from syncwise.plan.calibrate import CODEC_SETS, fit_codec

    a, b = 6e-9, 15e-6
    rows = []
    for shapes in CODEC_SETS:
        e = sum(r * c for r, c in shapes)
        rows.append({"elements": e, "tensors": len(shapes), "seconds": a * e + b * len(shapes)})
    assert fit_codec(rows) == pytest.approx((a, b))
    # a third, noisy point: least squares, close to both
    rows.append({"elements": 500_000, "tensors": 50, "seconds": 1.1 * (a * 500_000 + b * 50)})
    fa, fb = fit_codec(rows)
    assert fa == pytest.approx(a, rel=0.15) and fb == pytest.approx(b, rel=0.5)
    # noise that would make the per-tensor cost negative: all of it per element instead
    rows = rows[:2]
    rows[1]["seconds"] = a * rows[1]["elements"] * 0.5
    fa, fb = fit_codec(rows)
    assert fb == 0 and fa > 0


def test_measure_codecs_times_the_real_compressors_in_a_one_rank_group():
    import torch.distributed as dist

    from syncwise.plan.calibrate import fit_codec, measure_codecs

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = measure_codecs(dist.new_group([0]), ("fp8", "powersgd:rank=4,start_iter=0"), steps=1,
                              reference="tiny")
    finally:
        dist.destroy_process_group()
    ps = "powersgd:rank=4,start_iter=0"
    assert [(r["spec"], r["tensors"]) for r in rows] == [("fp8", 1), ("fp8", 32), ("fp8", 21), (ps, 1), (ps, 32),
                                                         (ps, 21)]          # tiny: 21 parameter tensors
    assert all(r["seconds"] > 0 for r in rows)
    a, b = fit_codec(rows[:3])
    assert a > 0 and b >= 0


# ------------------------------------------------------------------------------------------------ shared cores
def test_a_pipeline_on_shared_cores_fills_its_bubble_with_the_other_stages_work():
    """4 workers on 2 cores: the calibrated speed is the shared one; a stage idle in the bubble lends its core."""
    base = job_cloud(2, 2, 200e6)
    shared = dataclasses.replace(base, accelerator=dataclasses.replace(base.accelerator, shared_by=2.0))
    lay = Layout(pp=2, dp_replicate=2, micro_batch=4, microbatches=4)
    own, lent = (predict(c, load_model("small-dense", 128), lay, 32, 128) for c in (base, shared))
    assert own.breakdown["pp_bubble"] > 0 and lent.breakdown["pp_bubble"] == 0      # (4 + 1) / 2 ≤ 4 micro-batches
    assert lent.breakdown["compute"] == own.breakdown["compute"]                  # all busy: the calibrated speed
    # one micro-batch: (1 + 1) / 2 = 1 — still no bubble; a deeper pipeline of 4 stages: (1 + 3) / 2 - 1 = 1 left
    deep = Layout(pp=4, micro_batch=8, microbatches=1)
    p = predict(dataclasses.replace(shared, nodes=1, gpus_per_node=4), load_model("small-dense", 128), deep, 8, 128)
    tau = p.breakdown["compute"] + p.breakdown["recompute"]     # one micro-batch: all of it
    assert p.breakdown["pp_bubble"] == pytest.approx(tau, rel=0.05)
    with pytest.raises(ConfigError, match=r"cluster.accelerator.shared_by.*0.5"):
        cloud_from_dict({"nodes": 1, "gpus_per_node": 2, "accelerator": {"name": "cpu-lab", "shared_by": 0.5}})


def test_fsdp2_on_a_cpu_overlaps_nothing():
    from syncwise.plan.calibrate import recipe_for

    cloud = job_cloud(2, 2, 200e6)
    cpu = recipe_for(cloud.accelerator)
    assert not cpu.overlap_fsdp and SYNCWISE.overlap_fsdp
    m, lay = load_model("small-dense", 128), Layout(dp_shard=4, micro_batch=8)
    gpu_like = predict(cloud, m, lay, 32, 128, training=dataclasses.replace(cpu, overlap_fsdp=True))
    on_cpu = predict(cloud, m, lay, 32, 128, training=cpu)
    gathers = on_cpu.info["fsdp_gather_total_per_microbatch"]
    assert on_cpu.breakdown["fsdp_comm_exposed"] == pytest.approx(gathers)            # forward + backward, whole
    assert on_cpu.breakdown["dp_comm_exposed"] == pytest.approx(on_cpu.info["dp_comm_total"])
    assert on_cpu.step_time_s > gpu_like.step_time_s


# ------------------------------------------------------------------------------------------------ hierarchical sync
def test_the_hierarchical_sync_is_priced_where_the_layout_owner_runs_it():
    """dist.hierarchical=auto on 2 nodes × 2 ranks with fp8: fp32 hops inside the node, fp8 across on a half shard
    per rank — about one payload over each node's link instead of the flat all-gather's (nodes − 1) × 2."""
    cloud, m = job_cloud(2, 2, 200e6), load_model("small-dense", 128)

    def p(compress, hierarchical):
        return predict(cloud, m, Layout(dp_replicate=4, compress=compress, micro_batch=8, hierarchical=hierarchical),
                       32, 128)

    auto, flat = p("fp8", "auto"), p("fp8", "off")
    assert auto.inter_node_bytes == pytest.approx(flat.inter_node_bytes / 3, rel=0.05)   # ring: 3 of 4 payloads
    assert auto.breakdown["dp_comm_exposed"] < flat.breakdown["dp_comm_exposed"]
    assert auto.breakdown["compress_compute"] < flat.breakdown["compress_compute"]       # half the elements each
    # auto leaves fp32 DDP and the all-reducing compressors flat (the owner's rule); 'on' applies to them
    assert p("none", "auto").step_time_s == p("none", "off").step_time_s
    assert p("powersgd:rank=4", "auto").step_time_s == p("powersgd:rank=4", "off").step_time_s
    assert p("none", "on").inter_node_bytes < p("none", "off").inter_node_bytes
    # one rank per node, or one node: nothing to be hierarchical about
    one = job_cloud(4, 1, 200e6)
    assert predict(one, m, Layout(dp_replicate=4, compress="fp8", micro_batch=8), 32, 128).step_time_s == \
        predict(one, m, Layout(dp_replicate=4, compress="fp8", micro_batch=8, hierarchical="off"), 32, 128).step_time_s
