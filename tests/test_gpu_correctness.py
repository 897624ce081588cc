"""Issue 24 on the CPU: what a GPU run needs, checked where no GPU is (strict devices, backend strings, timing)."""
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_workers
from syncwise import devices
from syncwise.comm import ops
from syncwise.comm.timing import Interval, timed
from syncwise.config import build_config
from syncwise.commands.worker import resume_target


def test_nccl_jobs_get_a_cpu_communicator_too():
    # the backend string both the worker and the Python API pass to init_process_group (join_torchrun)
    assert devices.process_group_backend("nccl") == devices.NCCL_PROCESS_GROUP
    assert ops._device_types(devices.process_group_backend("nccl")) == {"cpu", "cuda"}
    assert ops._device_types("nccl") == {"cuda"}  # what issue 24's worker passed: no CPU communicator
    assert devices.process_group_backend("gloo") == "gloo"


def _resume_under(rank, world, declared):
    """resume_target's agreement on a group declared ``declared`` ('nccl': the old worker's group)."""
    assert ops.strict()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    if declared == "join_torchrun":  # the real path: the Python API's / worker's own init
        from syncwise.launch import free_port
        from syncwise.train.arguments import join_torchrun
        port = ops.all_gather_object(free_port())[0]  # a fresh store: the old one may outlive rank 0's destroy
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port)
        assert join_torchrun(torch.device("cpu"))
    else:
        ops.declare_backend(declared)
    try:
        return resume_target(build_config(), rank)
    except ops.StrictDeviceError as e:
        return f"refused: {e}"
    finally:
        ops.declare_backend(None)


def test_strict_devices_refuses_the_cpu_control_tensor_of_an_nccl_only_group():
    old = run_workers(_resume_under, 2, "nccl")
    assert all(r.startswith("refused: all_reduce of a cpu tensor") and "'nccl'" in r for r in old), old
    assert run_workers(_resume_under, 2, "join_torchrun") == ["auto", "auto"]


def _explicit_group(rank, world):
    g = ops.new_group(backend="gloo", desc="t")
    t = torch.ones(2)
    ops.all_reduce(t, group=g)  # gloo takes CPU tensors: allowed
    ops.declare_backend("nccl", g)  # as if made NCCL-only
    with pytest.raises(ops.StrictDeviceError):
        ops.all_reduce(t, group=g)
    return t.tolist()


def test_strict_devices_holds_explicit_groups_to_their_backend():
    assert run_workers(_explicit_group, 2) == [[2.0, 2.0], [2.0, 2.0]]


def test_interval_on_the_cpu_is_the_host_clock():
    with timed("cpu") as iv:
        torch.ones(1000).sum()
    assert not iv.cuda and iv.done() and iv.seconds() >= 0.0
    assert not Interval(None).stopped
    with pytest.raises(RuntimeError):
        Interval("cpu").seconds()


def _inline_vs_thread(rank, world, spec):
    """Two backwards of a 3-bucket DDP model, the compressor on its worker thread and inline (ep > 1's mode)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec

    grads = {}
    for inline in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
        model = DDP(net, bucket_cap_mb=0.004)
        state = CompressionHookState(parse_compress_spec(spec), None, net, CompressionPolicy(min_numel=256))
        state.inline = inline
        model.register_comm_hook(state, compression_hook)
        for step in range(2):
            model.zero_grad()
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).pow(2).mean().backward()
        grads[inline] = [p.grad.clone() for p in net.parameters()]
        assert state._worker is None if inline else state._worker is not None
        state.close()
    return all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_inline_compression_equals_the_worker_thread():
    # PowerSGD: two dependent collectives per bucket, error feedback and warm start carried across steps
    assert run_workers(_inline_vs_thread, 2, "powersgd:rank=2,start_iter=1") == [True, True]


def _fsdp_policy(rank, world):
    from syncwise.models import build_model
    from syncwise.parallel.fsdp import apply_fsdp, fsdp_units

    model = build_model("tiny", seq_len=16)
    units = [u for u in fsdp_units(model) if u is not model]
    apply_fsdp(model, None, param_dtype=torch.bfloat16)
    out = []
    for u in units + [model]:
        state = u._get_fsdp_state()
        group = state._fsdp_param_group
        out.append((str(state._mp_policy.param_dtype), str(state._mp_policy.reduce_dtype),
                    group.post_forward_mesh_info is not None))  # True: resharded after forward
    seen = []
    hook = units[0].register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(1, 16, dtype=torch.long))
    hook.remove()
    return out, [str(d) for d in seen]


def test_fsdp2_gathers_bf16_under_bf16_autocast_and_keeps_the_last_block_gathered():
    (units, seen), = run_workers(_fsdp_policy, 1)
    assert all(p == "torch.bfloat16" and r == "torch.float32" for p, r, _ in units)
    assert [resharded for *_, resharded in units] == [True] * (len(units) - 2) + [False, False]
    assert seen == ["torch.bfloat16"]  # the unit computes with bf16 parameters


def _tp_clip(rank, world, norm_type):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from syncwise.comm import CommStats
    from syncwise.parallel.tensor_parallel import apply_tensor_parallel, clip_grad_norm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 24), nn.LayerNorm(24))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(output_layouts=Replicate())}
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), plan=plan)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in full]), norm_type)
    stats = CommStats()
    got = clip_grad_norm(model.parameters(), 1e9, norm_type=norm_type, stats=stats)
    return float(got), float(want), stats.total_calls


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_tp_clipping_is_one_all_reduce_per_sharded_mesh_dimension(norm_type):
    for got, want, calls in run_workers(_tp_clip, 2, norm_type):
        assert got == pytest.approx(want, rel=1e-6)
        assert calls == 1  # three sharded gradients (and four biases / replicated ones): one all-reduce


def test_tiny_moe_compiles_to_one_graph():
    # issue 24: torch._C._current_graph_task_id() in the MoE layer broke the graph once per layer (7 graphs)
    import torch._dynamo

    from syncwise.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-moe", seq_len=16).train()
    explained = torch._dynamo.explain(model)(torch.randint(0, 256, (2, 16)))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot-eager"])
def test_moe_counts_tokens_once_under_activation_checkpointing(compiled):
    from syncwise.models import build_model
    from syncwise.parallel.activation_checkpoint import apply_activation_checkpointing

    counts = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model("tiny-moe", seq_len=16).train()
        if checkpointed:
            apply_activation_checkpointing(model)
        run = torch.compile(model, backend="aot_eager") if compiled and checkpointed else model
        run(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))).float().pow(2).mean().backward()
        counts.append([m.tokens_per_expert.clone() for m in model.moe_layers()])
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*counts)) and counts[0][0].sum() > 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_async_saves_reuse_one_stager_and_publish_each_saves_values(tmp_path):
    from syncwise.checkpoint import SmartCheckpointer, TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = SmartCheckpointer(tmp_path, interval=1, max_checkpoints=3, async_save=True)
    saved = {}
    stagers = []
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)  # in place: the cached staging storage of this parameter is reused
        saved[step] = model.weight.detach().clone()
        ck.save(step, TrainState.for_training(model, opt))
        stagers.append(ck._async_stager)
    ck.close()
    assert stagers[0] is stagers[1] and ck._async_stager is None
    for step in (1, 2):
        fresh = torch.nn.Linear(8, 8)
        ck2 = SmartCheckpointer(tmp_path, interval=1, max_checkpoints=3)
        ck2.load(str(tmp_path / f"step_{step:08d}"), TrainState.for_training(fresh, torch.optim.SGD(
            fresh.parameters(), lr=0.1)))
        ck2.close()
        assert torch.equal(fresh.weight, saved[step]), step


def _pipeline_p2p(rank, world):
    from syncwise.models import build_model
    from syncwise.parallel.pipeline import AsyncPipeline, build_stage_modules, stage_ids_for_rank

    torch.manual_seed(0)
    model = build_model("tiny", seq_len=16)
    ids = stage_ids_for_rank(rank, world, 1, "1f1b")
    pipe = AsyncPipeline(build_stage_modules(model, world, ids), microbatches=2, overlap_communication=False,
                         schedule="1f1b")
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = pipe.step(x, x)
    batched = pipe.p2p_stats.by_op["send"].bytes
    return batched, pipe.last_p2p_bytes, float(loss)


def test_pipeline_without_overlap_sends_through_batch_isend_irecv():
    # every activation / gradient byte the stage sent went out in a batch_isend_irecv group (issue 24: unbatched
    # isend then irecv can deadlock a crossing pair under NCCL)
    for batched, sent, loss in run_workers(_pipeline_p2p, 2):
        assert batched == sent > 0 and loss == loss


class _QueuedInterval:
    """Stands in for a CUDA-event Interval whose end event the device has not reached yet."""

    def __init__(self, seconds):
        self.finished, self._seconds = False, seconds

    def done(self):
        return self.finished

    def seconds(self):
        return self._seconds


def test_event_timed_collectives_count_once_completed_and_stay_in_flight_until_then():
    import time

    from syncwise.comm.stats import CommStats

    stats, iv = CommStats(), _QueuedInterval(0.25)
    stats.record("all_reduce", 64)
    stats.add_interval("all_reduce", iv)
    assert stats.snapshot()["all_reduce"] == {"calls": 1, "bytes": 64, "time_s": 0.0}  # not reached yet: no time
    token = next(ops._tokens)
    ops._in_flight[token] = ops.InFlight("all_reduce", None, time.monotonic(), iv)
    try:
        assert ops.oldest_in_flight().interval is iv  # the watchdog sees the queued collective
        iv.finished = True
        assert ops.oldest_in_flight() is None
        assert stats.total_time_s == 0.25 and stats.snapshot()["all_reduce"]["time_s"] == 0.25  # added once
    finally:
        ops._in_flight.pop(token, None)
