"""One ``Parallelized`` class per data-parallel kind, chosen once by ``parallelize`` (syncwise.parallel.kinds)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_workers
from syncwise.layout import Layout
from syncwise.parallel import describe_layout, parallelize
from syncwise.parallel import kinds


@pytest.mark.parametrize("degrees, kind", [
    ({"dp_replicate": 1}, kinds.SingleProcess),
    ({"dp_replicate": 1, "tp": 2}, kinds.SingleProcess),          # tensor parallel alone: no data parallel
    ({"dp_replicate": 2}, kinds.Replicas),
    ({"dp_replicate": 1, "dp_shard": 2}, kinds.Sharded),
    ({"dp_replicate": 2, "dp_shard": 2}, kinds.Sharded),          # HSDP
    ({"dp_replicate": 2, "tp": 2}, kinds.Sharded),                # replicas of a tensor-parallel model: FSDP2
    ({"dp_replicate": 1, "pp": 2}, kinds.PipelineStage),
    ({"dp_replicate": 2, "pp": 2}, kinds.PipelineStage),          # the stage's replicas: StageGradientSync
    ({"dp_replicate": 1, "dp_shard": 2, "pp": 2}, kinds.ShardedPipelineStage),
])
def test_kind_of_a_layout(degrees, kind):
    assert kinds.kind_of(Layout(**degrees)) is kind


def test_a_sharded_pipeline_stage_runs_the_schedule_and_counts_as_fsdp():
    """The combined kind takes the pipeline's backward (no FSDP2 no-sync: the schedule runs every microbatch) and
    FSDP2's own data parallel, labels and clocks."""
    c = kinds.ShardedPipelineStage
    assert c._backward is kinds.PipelineStage._backward
    assert c.apply_data_parallel is kinds.Sharded.apply_data_parallel
    assert c.replicas_timed is kinds.Sharded.replicas_timed and c.kind_label is kinds.Sharded.kind_label
    assert c.fsdp and not kinds.PipelineStage.fsdp


def test_single_process_seam_is_the_plain_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    par = parallelize(model)
    assert type(par) is kinds.SingleProcess and par.module is model and par.model is model
    assert par.holds_all_layers and par.accepts_mappings and par.pipeline is None and not par.distributed
    assert not par.syncs_gradients(1) and describe_layout(par) == "single process"
    x = torch.randn(5, 4)
    par.begin_step()
    with par.micro_batch(syncing=True):
        par.module(x).square().sum().backward()
    assert par.counted_bytes() == {"dp": 0} and par.take_times()() == {} and par.step_metrics() == {}
    assert par.take_exposed()() == 0.0 and par.state_components() == {}
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(par.clip_grad_norm(float("inf")), expected)
    assert par.eval_loss(x, None, lambda m, i, t: m(i).sum()) == model(x).sum()


def _kinds_worker(rank, world):
    out = {}
    for name, degrees in (("replicas", {"dp_replicate": 2}), ("sharded", {"dp_replicate": 1, "dp_shard": 2}),
                          ("stage", {"dp_replicate": 1, "pp": 2, "microbatches": 2})):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        par = parallelize(model, degrees)
        out[name] = (type(par).__name__, describe_layout(par), par.holds_all_layers, par.accepts_mappings,
                     par.distributed)
        par.close()
    # rank 0 holds the store: it must not tear the group down while rank 1 still builds its last mesh (CI once saw
    # rank 1's gloo group creation reset by peer)
    torch.distributed.barrier()
    return out


def test_parallelize_returns_the_kind_of_each_layout_on_two_ranks():
    for out in run_workers(_kinds_worker, 2):
        assert out["replicas"] == ("Replicas", "dp_replicate 2 (DDP)", True, True, True)
        assert out["sharded"] == ("Sharded", "dp_shard 2 (FSDP2)", True, True, True)
        assert out["stage"] == ("PipelineStage", "pp 2", False, False, False)
