"""FSDP2's bytes per hop (issue 40): its all-gathers and reduce-scatters, torch's and the quantized ones, are split
into intra-node and cross-node bytes by their pattern over their group (``comm.ops.cross_share``), so a run on
2 nodes reports what its FSDP2 traffic puts on the link between nodes.

The formulas (``ops.ring_cross_share`` / ``ops.all_to_all_cross_share``): a ring through a group's W ranks in rank
order (node-major) leaves each of its N_g nodes once, so N_g of its W equal links cross: N_g / W of the bytes; an
all-to-all's chunks for ranks on other nodes cross. On 2 nodes × 2 ranks, FSDP2 over all 4: a ring 2/4, an
all-to-all 2/4 for every rank, a node's group 0.
"""
import os

import pytest
import torch

from distributed import run_workers
from syncwise.comm import ops

STEPS, PER_RANK, SEQ = 3, 2, 16


def test_ring_and_all_to_all_cross_shares_follow_the_topology():
    ring, a2a = ops.ring_cross_share, ops.all_to_all_cross_share
    assert ring([0, 1, 2, 3], 2) == 0.5           # 2 nodes × 2: 2 of 4 ring links leave a node
    assert ring([0, 1, 2, 3, 4, 5, 6, 7], 4) == 0.25
    assert ring([0, 1], 2) == 0.0 and ring([2, 3], 2) == 0.0   # a node's group
    assert ring([0, 2], 2) == 1.0 and ring([1, 3], 2) == 1.0   # one rank per node: every byte crosses (hop_of's 'cross')
    assert ring([0, 1, 2, 3, 4, 5], 2) == 0.5     # 3 nodes × 2
    assert ring([0], 2) == 0.0
    assert a2a([0, 1, 2, 3], 2, 0) == 0.5 and a2a([0, 1, 2, 3], 2, 3) == 0.5
    assert a2a([0, 1, 2, 3, 4, 5, 6, 7], 2, 5) == 0.75   # 4 nodes × 2: 6 of 8 chunks leave the node
    assert a2a([0, 1], 2, 1) == 0.0 and a2a([0, 2], 2, 0) == 0.5
    with pytest.raises(ValueError):
        ops.cross_share(None, "tree")


def _trainer(rank, layout, compress, steps, **kw):
    from syncwise.models import build_model
    from syncwise.train import OptimizedTrainer

    torch.manual_seed(0)
    model = build_model("tiny", seq_len=SEQ)
    g = torch.Generator().manual_seed(7 + rank)
    data = torch.randint(0, 256, (steps, PER_RANK, SEQ + 1), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = OptimizedTrainer(model, opt, parallel=layout, compress_gradients=compress, mixed_precision=False,
                               show_progress=False, **kw)
    return trainer, [(d[:, :-1], d[:, 1:]) for d in data]


def _worker(rank, world, layout, compress):
    trainer, batches = _trainer(rank, layout, compress, STEPS)
    summary = trainer.train(batches, steps=STEPS)
    return {k: v for k, v in summary.items() if k.startswith(("hop_bytes", "comm_hops", "comm_bytes", "layout",
                                                                "final_loss"))}


@pytest.mark.slow  # 3 runs of 4 workers
def test_fsdp2_on_two_nodes_reports_cross_node_bytes_and_zeropp_sends_fewer():
    """fp32 FSDP2 over 2 nodes × 2 ranks: every byte is split (none 'unsplit'), half of it across nodes (rings over
    the 4 ranks: 2/4). qgZ + qwZ + hpZ with the flat reduce-scatter (dist.hierarchical=off: int8 all-to-all over
    the 4 ranks, int8 forward gathers, backward's gathers inside the node): per unit fp32 sends 24·S bytes per rank
    (two 4·S gathers, one 16·S reduce-scatter input, S the shard's elements), 12·S across; the quantized run
    ≈ 1.03·S (int8 + one fp32 scale per 128) across in half of forward's gather and 4·1.03·S in half of the
    all-to-all: 2.6·S, 4.6× fewer (the root and the last unit, gathered once: 3.9×). Asserted: more than 3.5×
    fewer. The hierarchical reduce-scatter (auto on 2 nodes × 2) sends one int8 payload per node across instead of
    one per rank of the other node: fewer cross-node bytes again (2·1.03·S → 1.03·S per unit), more inside."""
    fp32 = run_workers(_worker, 4, {"dp_shard": 4}, None, local_world_size=2, timeout=400)[0]
    zpp_layout = {"dp_shard": 4, "fsdp_gather": "int8", "fsdp_reshard": "node"}
    flat = run_workers(_worker, 4, {**zpp_layout, "hierarchical": "off"}, "int8", local_world_size=2, timeout=400)[0]
    zpp = run_workers(_worker, 4, zpp_layout, "int8", local_world_size=2, timeout=400)[0]
    assert "hierarchical" in zpp["layout"] and "hierarchical" not in flat["layout"]
    assert zpp["hop_bytes_per_step_cross"] < flat["hop_bytes_per_step_cross"]
    assert zpp["hop_bytes_per_step_intra"] > flat["hop_bytes_per_step_intra"]
    for s in (fp32, flat, zpp):
        assert s["comm_hops"].startswith("2 nodes"), s
        assert "hop_bytes_per_step_unsplit" not in s, s   # FSDP2's bytes all have a hop now
    cross, intra = fp32["hop_bytes_per_step_cross"], fp32["hop_bytes_per_step_intra"]
    for s in (fp32, flat, zpp):   # per dimension: FSDP2's are all the run's
        assert s["hop_bytes_per_step_cross_fsdp"] == s["hop_bytes_per_step_cross"], s
    assert cross > 0
    assert abs(cross - intra) <= 1e-3 * (cross + intra), fp32   # ring over 2 nodes × 2: half crosses
    assert flat["hop_bytes_per_step_cross"] > 0
    assert 3.5 * flat["hop_bytes_per_step_cross"] < cross, (flat, fp32)
    # hpZ's backward gathers inside the node are counted too (intra): more intra than cross in the quantized run
    assert flat["hop_bytes_per_step_intra"] > flat["hop_bytes_per_step_cross"]
    # the planner prices the same bytes per hop (plan.cost.fsdp_hop_bytes, the runtime's rules): within the issue's
    # 10 % planner criterion of what the run counted (its units — embedding, blocks, head, root; backward re-gathers
    # all but the head and the root — are the runtime's: plan.cost.fsdp_units; it ignores the padding of shards and
    # of quantized blocks: measured fp32 0.0 %, flat -6.5 % across / -1.8 % inside, hierarchical -5.6 % / -0.4 %)
    from syncwise.plan import Layout, load_model, predict
    from syncwise.plan.strategy import job_cloud

    for run, kw in ((fp32, {"dp_shard": 4}), (flat, {**zpp_layout, "compress": "int8", "hierarchical": "off"}),
                    (zpp, {**zpp_layout, "compress": "int8"})):
        priced = predict(job_cloud(2, 2), load_model("tiny", SEQ), Layout(micro_batch=PER_RANK, **kw),
                         4 * PER_RANK, SEQ).info["fsdp_bytes_per_step"]
        for hop in ("cross", "intra"):
            if os.environ.get("SYNCWISE_MEASURE"):
                print(f"\n{kw} {hop}: priced {priced[hop]:.0f}, counted {run[f'hop_bytes_per_step_{hop}']:.0f} "
                      f"({priced[hop] / run[f'hop_bytes_per_step_{hop}'] - 1:+.1%})")
            assert priced[hop] == pytest.approx(run[f"hop_bytes_per_step_{hop}"], rel=0.10), (kw, hop, priced, run)


@pytest.mark.slow  # 2 runs of 4 workers
def test_hsdp_and_tensor_parallel_bytes_are_split_by_their_groups():
    """2 nodes × 2: HSDP (dp_replicate 2 × dp_shard 2) shards inside the node (rings over a node's 2 ranks: intra)
    and all-reduces across replicas one rank per node (every byte across: the dispatch counter's share, 2/2); tensor
    parallel 2 × dp_shard 2 keeps tp inside the node and shards across (one rank per node: all across). No byte is
    left without a hop."""
    hsdp = run_workers(_worker, 4, {"dp_replicate": 2, "dp_shard": 2}, None, local_world_size=2, timeout=400)[0]
    assert "hop_bytes_per_step_unsplit" not in hsdp, hsdp
    assert hsdp["hop_bytes_per_step_cross"] == pytest.approx(hsdp["comm_bytes_per_step_dp"])
    assert hsdp["hop_bytes_per_step_intra"] == pytest.approx(hsdp["comm_bytes_per_step_fsdp"])
    assert hsdp["hop_bytes_per_step_cross_dp"] == pytest.approx(hsdp["comm_bytes_per_step_dp"])   # per dimension
    assert hsdp["hop_bytes_per_step_cross_fsdp"] == 0
    tp = run_workers(_worker, 4, {"tp": 2, "dp_shard": 2}, None, local_world_size=2, timeout=400)[0]
    assert "hop_bytes_per_step_unsplit" not in tp, tp
    assert tp["hop_bytes_per_step_intra"] == pytest.approx(tp["comm_bytes_per_step_tp"])
    assert tp["hop_bytes_per_step_cross"] == pytest.approx(tp["comm_bytes_per_step_fsdp"])
    assert tp["hop_bytes_per_step_cross_tp"] == 0
    assert tp["hop_bytes_per_step_cross_fsdp"] == pytest.approx(tp["comm_bytes_per_step_fsdp"])


def _resume_worker(rank, world, layout, compress, root):
    """A straight 4-step run, and the same run stopped after step 2's checkpoint and resumed: rank 0's losses."""
    import json
    from pathlib import Path

    from syncwise.checkpoint import SmartCheckpointer

    root = Path(root)
    trainer, batches = _trainer(rank, layout, compress, 4, run_dir=str(root / "straight"))
    trainer.train(batches, steps=4)
    trainer, batches = _trainer(rank, layout, compress, 4, run_dir=str(root / "resumed"),
                                checkpointer=SmartCheckpointer(root / "ck", interval=2, async_save=False))
    trainer.train(batches, steps=2)
    trainer, batches = _trainer(rank, layout, compress, 4, run_dir=str(root / "resumed"),
                                checkpointer=SmartCheckpointer(root / "ck", interval=2, async_save=False))
    shown = trainer.train(batches, steps=4, resume="auto")["layout"]
    started = trainer._start_step  # the step the resumed train() began after (0: a fresh start)

    def losses(name):
        return [(r["step"], r["loss"]) for r in map(json.loads, (root / name / "metrics.jsonl").read_text().splitlines())]
    return losses("straight"), losses("resumed"), started, shown, sorted(p.name for p in (root / "ck").glob("step_*"))


@pytest.mark.slow  # 3 runs of 4 workers
def test_hierarchical_qgz_with_qwz_and_hpz_resumes_bit_exact_on_two_nodes(tmp_path):
    """The hierarchical reduce-scatter keeps no state (nearest rounding, sums in a fixed order): stopped after step 2's
    checkpoint and resumed, steps 3 and 4 repeat the straight run's losses bit for bit (2 nodes × 2 gloo ranks)."""
    layout = {"dp_shard": 4, "fsdp_gather": "int8", "fsdp_reshard": "node"}
    straight, resumed, started, shown, saved = run_workers(_resume_worker, 4, layout, "int8", str(tmp_path),
                                                 local_world_size=2, timeout=600)[0]
    assert [s for s, _ in straight] == [1, 2, 3, 4] and [s for s, _ in resumed] == [1, 2, 3, 4], (straight, resumed)
    assert "step_00000002" in saved and started == 2   # it resumed after step 2's checkpoint
    assert "reduce-scatter hierarchical" in shown, shown
    assert resumed == straight


@pytest.mark.slow  # 2 runs of 4 workers
def test_hierarchical_reduce_scatter_builds_every_shard_groups_subgroups_under_tensor_parallel():
    """tp 2 × dp_shard 2 on one node of 4 with dist.hierarchical=on: two shard groups ([0, 2], [1, 3]) whose node and
    cross subgroups every rank creates alike (a rank building only its own would mismatch new_group's collective
    order); on one node nothing crosses and nothing is rounded: the fp32 sum inside the node, in rank order, against
    FSDP2's own reduce-scatter (gloo: an all-reduce, another summation order) — the same losses up to fp32 reordering
    over 2 summands (≤ 2⁻²³ relative per element; 1e-5 on the loss allows the steps' growth)."""
    layout = {"tp": 2, "dp_shard": 2}
    ref = run_workers(_worker, 4, layout, None, local_world_size=4, timeout=400)[0]
    hier = run_workers(_worker, 4, {**layout, "hierarchical": "on"}, "int8", local_world_size=4, timeout=400)[0]
    assert "hierarchical" in hier["layout"], hier["layout"]
    assert hier["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5), (hier, ref)
