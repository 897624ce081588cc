"""The cost model's GEMM-shape and per-kernel terms (syncwise.plan.cloud.gemm_time / wave_efficiency,
syncwise.plan.cost.kernels_per_microbatch): pure Python, no torch."""
import dataclasses

from syncwise.plan import Layout, predict
from syncwise.plan.cloud import ACCELERATORS, cluster, wave_efficiency
from syncwise.plan.cost import kernels_per_microbatch
from syncwise.plan.layout import SYNCWISE
from syncwise.plan.published import gpt, without_overheads


def test_tiny_gemm_runs_below_a_large_ones_efficiency():
    a100 = ACCELERATORS["a100-80gb"]
    tiny, large = a100.gemm_shape_efficiency(128, 128, 128), a100.gemm_shape_efficiency(16384, 4096, 4096)
    assert tiny < 0.1 * large
    assert large <= a100.matmul_efficiency + 1e-12
    assert wave_efficiency(128, 128, 108) < wave_efficiency(128 * 108, 128, 108) == 1.0
    # the catalog's GPUs carry their SM count; an accelerator without one keeps the size-independent model
    assert a100.sm_count == 108 and ACCELERATORS["h100-sxm"].sm_count == 132
    assert ACCELERATORS["cpu-lab"].sm_count == 0 and ACCELERATORS["cpu-lab"].kernel_launch_s == 0


def test_kernel_count_scales_with_layers():
    m12, m24 = gpt(1024, 12, 16), gpt(1024, 24, 16)
    k12, k24 = (kernels_per_microbatch(m, Layout(), SYNCWISE) for m in (m12, m24))
    per_layer = (k24 - k12) / 12
    assert per_layer > 20 and abs(k24 - (k12 + 12 * per_layer)) < 1e-9
    # a full recompute runs every block's forward again; pp splits the layers
    assert kernels_per_microbatch(m24, Layout(recompute="full"), SYNCWISE) > k24
    assert kernels_per_microbatch(m24, Layout(pp=2), SYNCWISE) == k24 / 2


def test_small_tp_model_is_predicted_slower_with_the_overhead_terms():
    model = gpt(1024, 24, 16, vocab=50368, seq=2048)           # ~0.35 B
    cloud = cluster("a100-80gb", 1, 8, intra="nvlink3")
    lay = Layout(dp_replicate=4, tp=2, micro_batch=1)
    with_terms = predict(cloud, model, lay, 32, 2048, syncwise_rules=False)
    without = predict(without_overheads(cloud), model, lay, 32, 2048, syncwise_rules=False)
    assert with_terms.tokens_per_s < without.tokens_per_s
    assert with_terms.info["gemm_shape_s_per_microbatch"] > 0 and without.info["gemm_shape_s_per_microbatch"] == 0
    # a model of tiny kernels is host-bound: the launch overhead shows in the breakdown and grows with the layers
    tiny = [predict(cloud, gpt(64, L, 4, vocab=512, seq=64), Layout(dp_replicate=8, micro_batch=1), 8, 64,
                    syncwise_rules=False).breakdown["kernel_overhead"] for L in (4, 8)]
    assert 0 < tiny[0] < tiny[1]
    # the host's issue time per kernel (the catalog's eager 25 µs, or --calibrate's): slower never predicts faster
    acc = cloud.accelerator
    hosts = [dataclasses.replace(cloud, accelerator=dataclasses.replace(acc, kernel_launch_s=f * acc.kernel_launch_s))
             for f in (0.25, 1.0, 2.0)]
    steps = [predict(h, model, lay, 32, 2048, syncwise_rules=False).step_time_s for h in hosts]
    assert steps[0] <= steps[1] == with_terms.step_time_s <= steps[2]


def test_gpu_calibration_carries_sm_count_and_kernel_costs(tmp_path):
    """derive_cluster / cloud_toml on a GPU calibration's numbers (measure_kernels runs only on CUDA)."""
    from syncwise.plan.calibrate import cloud_toml, derive_cluster
    from syncwise.plan.cloud import load_cluster

    gemm = [{"size": s, "flops": 2.0 * s ** 3, "seconds": 2.0 * s ** 3 / 600e12 + 5e-6, "flop_s": 0.0,
             "dtype": "bfloat16"} for s in (256, 1024, 4096, 8192)]
    kernels = {"sm_count": 132, "kernel_launch_s": 6e-6, "kernel_gap_s": 1.5e-6}
    worker = {"gemm": gemm, "memory_bytes_s": 3e12, "reference_step_s": 0.05, "kernels": kernels}
    result = {"workers": [worker], "world": [], "intra": [], "nodes": 1, "procs_per_node": 1, "world_size": 1,
              "reference": ["small-dense", 8, 128], "torch": "x", "device": "cuda", "lab": None,
              "measured_at": "now", "host": "h", "cpu_count": 16, "seconds": 1.0}
    result["cluster"] = derive_cluster(result)
    path = tmp_path / "gpu.toml"
    path.write_text(cloud_toml(result))
    acc = load_cluster(path).accelerator
    assert acc.sm_count == 132 and acc.gemm_half_flops == 0.0
    assert abs(acc.kernel_launch_s - 6e-6) < 1e-9 and abs(acc.kernel_gap_s - 1.5e-6) < 1e-9
    assert "132 SMs" in path.read_text()


def test_loss_traffic_grows_with_the_vocabulary():
    cloud = cluster("a100-80gb", 1, 8, intra="nvlink3")
    lay = Layout(dp_shard=8, micro_batch=8)
    small, large = (predict(cloud, gpt(768, 12, 12, vocab=v), lay, 64, 2048, syncwise_rules=False)
                    for v in (8192, 65536))
    off = dataclasses.replace(SYNCWISE, loss_bytes_per_logit=0.0)
    large_off = predict(cloud, gpt(768, 12, 12, vocab=65536), lay, 64, 2048, training=off, syncwise_rules=False)
    # 64 × 2048 tokens × 65,536 logits × 44 B over 2.039 TB/s, on each of 8 ranks' eighth of the batch
    expected = 64 * 2048 / 8 * 65536 * 44 / 2.039e12
    assert abs((large.step_time_s - large_off.step_time_s) - expected) < 1e-3 * expected + 1e-6
    assert large.step_time_s > small.step_time_s


def test_held_out_and_moe_rows_carry_sources_and_report_before_and_after():
    from syncwise.plan.published import evaluate, runs

    rows = runs()
    held = [r for r in rows if r.group == "held-out small"]
    moe = [r for r in rows if r.group == "moe"]
    assert len([r for r in rows if r.group == "published"]) == 16 and len(held) == 6 and moe
    assert all("github.com/" in r.source for r in held + moe)
    assert all(r.model.n_layers and r.layout.ep > 1 and r.model.is_moe for r in moe)
    # MPT's shapes reproduce the table's parameter count exactly (125m: 125,311,488)
    assert [r.model.param_counts()[0] for r in held[:4]] == [125311488, 355985408, 760470528, 1315950592]
    row = evaluate(held[0], top_check=False)
    assert row["group"] == "held-out small" and row["error"] != row["error_without_overheads"]
    # llm-foundry's H100 7b / 13b rows: the table's NumParams
    h100 = [r for r in rows if r.group == "held-out h100 7-13b"]
    assert [r.model.param_counts()[0] for r in h100] == [6667247616, 6658859008, 12853954560]


def test_unfused_attention_core_is_slower_at_small_head_dim():
    """Without a fused kernel QKᵀ and AV are batched GEMMs that read and write the s × s scores: at head dim 64
    an A100 is HBM-bound on them (128 FLOPs per 2-byte score written or read: 64 FLOP/B, below its 153 ridge),
    so their excess over the large-GEMM rate is larger per FLOP than at 128; a fused recipe pays none of it."""
    from syncwise.plan.cost import attention_core_excess
    from syncwise.plan.layout import MEGATRON

    a100 = ACCELERATORS["a100-80gb"]
    per_flop = []
    for heads in (16, 8):                                    # d 1,024: head dim 64, then 128
        m = gpt(1024, 12, heads, seq=1024)
        fwd, bwd = attention_core_excess(a100, m, Layout(), 4, 1024, a100.peak_bf16_flops, a100.matmul_efficiency)
        assert fwd > 0 and bwd > fwd
        per_flop.append((fwd + bwd) / m.attention_core_flops_per_token(1024))
    assert per_flop[0] > per_flop[1]
    cloud = cluster("a100-80gb", 1, 8, intra="nvlink3")
    m, lay = gpt(1024, 12, 16, seq=1024), Layout(dp_replicate=8, micro_batch=4)
    fused = dataclasses.replace(MEGATRON, flash_attention=True)
    gap = [predict(cloud, m, lay, 32, 1024, training=t, syncwise_rules=False).info["gemm_shape_s_per_microbatch"]
           for t in (MEGATRON, fused)]
    assert gap[0] > gap[1]


def test_scatter_gather_sends_a_tp_slice_across_and_gathers_it_inside_the_node():
    """Training.pp_scatter_gather (Megatron-LM SC'21 §4.1, DeepSpeed's partitioned pipe sends): each of the tp ranks
    sends 1/tp of the activation over the pipeline's link and the receiving stage all-gathers the slices over
    NVLink, so the pipeline's cross-node bytes drop tp-fold; under sequence parallel the message is already a
    slice and the flag changes nothing."""
    from syncwise.plan.layout import MEGATRON

    sg = dataclasses.replace(MEGATRON, pp_scatter_gather=True)
    cloud = cluster("a100-80gb", 4, 8, intra="nvlink3", inter="ib-hdr", nics_per_node=8)
    model = gpt(8192, 16, 64)
    lay = Layout(dp_replicate=2, tp=8, pp=2, micro_batch=1, recompute="full", sequence_parallel=False)
    one = dataclasses.replace(lay, dp_replicate=1)
    small = cluster("a100-80gb", 2, 8, intra="nvlink3", inter="ib-hdr", nics_per_node=8)
    plain_p, sg_p = (predict(small, model, one, 16, 2048, training=t, syncwise_rules=False) for t in (MEGATRON, sg))
    # pp 2 of tp 8 on 2 nodes: only the pipeline crosses; its bytes drop 8-fold
    assert abs(sg_p.inter_node_bytes - plain_p.inter_node_bytes / 8) <= 1e-9 * plain_p.inter_node_bytes
    assert sg_p.breakdown["pp_p2p"] < plain_p.breakdown["pp_p2p"] / 2
    assert predict(cloud, model, lay, 64, 2048, training=sg, syncwise_rules=False).step_time_s < \
        predict(cloud, model, lay, 64, 2048, training=MEGATRON, syncwise_rules=False).step_time_s
    sp = dataclasses.replace(lay, sequence_parallel=True)
    assert predict(cloud, model, sp, 64, 2048, training=sg, syncwise_rules=False).step_time_s == \
        predict(cloud, model, sp, 64, 2048, training=MEGATRON, syncwise_rules=False).step_time_s


def test_megatron_table1_rows_run_as_the_papers_script_and_mt_nlg_as_deepspeed():
    """Megatron-LM Table 1's rows take examples/sc21/run_table_1.sh's micro-batch, interleaving and DDP; MT-NLG's
    rows run DeepSpeed's pipeline (non-interleaved, partitioned sends) at the same (tp, pp) as the 529.6 B row."""
    from syncwise.plan.published import runs

    rs = {r.name: r for r in runs()}
    big = rs["Megatron-LM GPT 529.6 B"]
    assert (big.layout.micro_batch, big.layout.pp_schedule, big.layout.stages_per_rank) == (1, "interleaved-1f1b", 3)
    assert big.training.grad_reduce_bytes == 2 and big.training.pp_scatter_gather and not big.training.overlap_dp
    assert [rs[f"Megatron-LM GPT {p} B"].layout.micro_batch for p in (1.7, 7.5, 18.4, 39.1, 145.6)] == [16, 16, 8, 4, 2]
    assert rs["Megatron-LM GPT 7.5 B"].training.overlap_dp and rs["Megatron-LM GPT 145.6 B"].layout.stages_per_rank == 2
    mt = rs["MT-NLG 530B on 2240 GPUs"]
    assert (mt.layout.tp, mt.layout.pp, mt.layout.stages_per_rank) == (8, 35, 1) and mt.training.pp_scatter_gather


def test_busiest_stage_matches_the_split_syncwise_runs_and_the_uniform_splits():
    """cost.busiest_stage: with end_layers None it is the largest stage of the split syncwise itself makes
    (parallel.pipeline._partition over equal layers with the head on the last stage, in integer units); with k
    the two end stages hold k layers fewer (Megatron-LM's uniform split: 0; Llama 3: 1)."""
    from syncwise.parallel.pipeline import _partition
    from syncwise.plan.cost import busiest_stage

    unit = 100                                    # a layer, in _partition's integer cost units
    for layers, pp, head in ((8, 4, 1.5), (24, 4, 0.3), (12, 3, 2.0), (7, 2, 0.5), (105, 35, 0.26), (6, 6, 1.0)):
        split = _partition([unit] * layers, pp, 0, round(head * unit))
        largest = max(len(s) * unit + (round(head * unit) if i == pp - 1 else 0) for i, s in enumerate(split))
        assert abs(busiest_stage(layers, pp, head, None) - largest / unit) < 1e-9, (layers, pp, head, split)
    assert busiest_stage(105, 35, 0.26, 0) == 3.26             # MT-NLG: 3 layers a stage, the head on the last
    assert busiest_stage(126, 16, 0.66, 1) == 8                 # Llama 3: 7 + head on the last, 8 in the middle
    assert abs(busiest_stage(70, 12, 1.1, 1) - 6.1) < 1e-9      # BLOOM (type:transformer|embedding): 5 + 1.1 > 6
    assert busiest_stage(48, 1, 0.2, 0) == 48.2


def test_the_busiest_stage_paces_the_pipeline_and_every_micro_batch_accumulates_its_gradients():
    """The steady state runs at the busiest stage's pace (the head on the last stage): (M - 1) × its excess over
    the average stage is the ``pp_imbalance`` part, and taking a layer off each end stage (pp_end_layers=1)
    shrinks it. Gradient accumulation costs weight_bytes + 2 × grad_bytes of HBM traffic per local parameter per
    accumulation: M of them with main-gradient hooks (Megatron), M - 1 with autograd's .grad."""
    from syncwise.plan.layout import MEGATRON
    from syncwise.plan.memory import stage_params

    cloud = cluster("a100-80gb", 1, 8, intra="nvlink3", inter="ib-hdr", nics_per_node=8)
    model = gpt(4096, 16, 32, vocab=250880)       # a large vocabulary: the head is worth ~2 layers
    lay = Layout(dp_replicate=1, tp=2, pp=4, micro_batch=1, recompute="none", sequence_parallel=False)
    uniform = predict(cloud, model, lay, 32, 2048, training=MEGATRON, syncwise_rules=False)
    assert uniform.microbatches == 32 and uniform.breakdown["pp_imbalance"] > 0.05 * uniform.step_time_s
    trimmed = predict(cloud, model, lay, 32, 2048, training=dataclasses.replace(MEGATRON, pp_end_layers=1),
                      syncwise_rules=False)
    assert trimmed.breakdown["pp_imbalance"] < uniform.breakdown["pp_imbalance"]
    assert trimmed.step_time_s < uniform.step_time_s
    one = dataclasses.replace(lay, pp=1, dp_replicate=4)
    assert predict(cloud, model, one, 32, 2048, training=MEGATRON, syncwise_rules=False).breakdown["pp_imbalance"] == 0

    local = stage_params(model, lay).total
    per = local * (MEGATRON.weight_bytes + 2 * MEGATRON.grad_bytes) / cloud.accelerator.hbm_bandwidth
    assert abs(uniform.breakdown["grad_accumulation"] - 32 * per) < 1e-9 * per
    autograd = predict(cloud, model, lay, 32, 2048, training=dataclasses.replace(MEGATRON, main_grad_hooks=False),
                       syncwise_rules=False)
    assert abs(autograd.breakdown["grad_accumulation"] - 31 * per) < 1e-9 * per
    single = predict(cloud, model, dataclasses.replace(lay, pp=1, dp_replicate=4), 4, 2048, training=SYNCWISE, syncwise_rules=False)
    assert single.microbatches == 1 and single.breakdown["grad_accumulation"] == 0
