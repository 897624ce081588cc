"""Issue 39: the GPU hot path's rules, guarded on the CPU (docs/gpu.md "The hot path's rules").

- drift: every decode that sums ranks adds them in rank order; replicas stay bitwise identical (3 gloo ranks);
- host reads: under ``SYNCWISE_STRICT_SYNCS=1`` a steady step reads no step tensor on the host outside the one
  event-guarded reader (``syncwise.hostread``);
- lifetimes: an async collective's record in ``comm.ops`` owns its tensors until it completes;
- the rest: chunk sizes per device type, fp32 compressor matmuls under TF32, NCCL's timeout above the watchdog's,
  one timing stream per group.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

from distributed import run_workers
from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec
from syncwise.compress.base import rank_order_sum
from syncwise.compress.sparse import TopKCompressor
from syncwise.parallel import build_sync


# ---- drift: rank order -------------------------------------------------------------------------------------------
class ScatteredAtomics(TorchFunctionMode):
    """``index_add_`` as CUDA's float atomics may run it: colliding (index, value) pairs added in another order than
    given (here: reversed). A decode that adds each rank with its own call (distinct indices) cannot tell."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.index_add_:
            out, dim, index, source = args[:4]
            assert dim == 0 and not kwargs and len(args) == 4
            for j in reversed(range(index.numel())):
                out[index[j]] += source[j]
            return out
        return func(*args, **kwargs)


def test_topk_decode_adds_ranks_in_rank_order_whatever_order_atomics_take():
    """Three ranks send the same coordinate (1, 1e8, -1e8): in rank order (1 + 1e8) - 1e8 = 0 in fp32; added in
    another order it is 1. One index_add_ over every rank's pairs (before issue 39) gave 1 under reversed atomics."""
    c = TopKCompressor(ratio=0.25, error_feedback=False)
    payloads = []
    for v in (1.0, 1e8, -1e8):
        x = torch.zeros(8)
        x[0], x[5] = v, 0.5  # two kept per rank: coordinates 0 and 5
        payloads.append(c._encode(x, [8], ["w"], 0)[0])
    gathered = torch.stack(payloads)
    dense = [c._decode_sum(gathered[w:w + 1], [8], 8) for w in range(3)]
    expected = rank_order_sum(torch.stack(dense))
    assert expected[0].item() == 0.0
    with ScatteredAtomics():
        got = c._decode_sum(gathered, [8], 8)
    assert torch.equal(got, expected)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 96)
        self.l2 = nn.Linear(96, 64)
        self.l3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


DRIFT_SPECS = ["none", "fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.1,momentum=0.5", "randomk:ratio=0.1",
               "powersgd:rank=2,start_iter=1", "demo"]
DRIFT_SYNCS = ["localsgd:period=2", "diloco:period=2,delay=1", "sparseloco:period=2,delay=1,chunk=256,topk=16",
               "pipesgd"]


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _drift(rank, world, steps=3):
    """Parameters of every rank after ``steps`` DDP steps per compressor, and after sync-strategy runs."""
    out = {}
    for spec in DRIFT_SPECS:
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)
        names = {p: n for n, p in model.module.named_parameters()}
        state = CompressionHookState(parse_compress_spec(spec), None, names, CompressionPolicy(min_numel=512))
        model.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(16, 32, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :8]).backward()
            opt.step()
        state.close()
        out[spec] = _params(model)
    for spec in DRIFT_SYNCS:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sync = build_sync(spec, model)
        g = torch.Generator().manual_seed(rank)
        n = 4
        for step in range(1, n + 1):
            x = torch.randn(16, 32, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :8]).backward()
            updates, _ = sync.exchange(step, step == n)
            for grads in updates:
                if grads is not None:
                    for p, gr in zip(sync.params, grads):
                        p.grad = gr
                opt.step()
            sync.after_step(step, step == n)
        out[spec] = _params(model)
    dist.barrier()
    return out


def test_replicas_stay_bitwise_identical_on_three_ranks_for_every_compressor_and_sync():
    results = run_workers(_drift, 3)
    for spec in DRIFT_SPECS + DRIFT_SYNCS:
        first = results[0][spec]
        assert torch.isfinite(first).all(), spec
        for r in results[1:]:
            assert torch.equal(r[spec], first), f"{spec}: replicas drifted apart"


# ---- host reads: SYNCWISE_STRICT_SYNCS -----------------------------------------------------------------------------
STRICT_SPECS = [None, "topk:ratio=0.1", "powersgd:rank=2,start_iter=1", "fp8", "int8"]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _strict_steps(rank, world, specs, sync=None):
    """Steady DDP steps under SYNCWISE_STRICT_SYNCS=1 (fused AdamW: the non-finite step is skipped on the device)."""
    import os

    from syncwise.comm import hostread
    from syncwise.train import OptimizedTrainer

    os.environ[hostread.STRICT_ENV] = "1"
    out = {}
    for spec in specs:
        model = _mlp()
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
        trainer = OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                   nn.functional.cross_entropy, compress_gradients=spec, min_numel=256, sync=sync,
                                   show_progress=False)
        trainer.log_lag = 1  # as on a GPU
        hostread.DESIGNED.clear()
        summary = trainer.train(batches, steps=6)
        out[str(spec)] = (trainer._skips_on_device, dict(hostread.DESIGNED), summary["final_loss"])
    return out


def test_steady_ddp_steps_read_no_device_value_on_the_host_outside_the_reader():
    """Fails on 7ed2b6b: the step read bool(nonfinite) / float(loss) / the compressor's flags directly."""
    for result in run_workers(_strict_steps, 2, STRICT_SPECS):
        for spec, (on_device, designed, loss) in result.items():
            assert on_device, spec
            assert designed == {}, (spec, designed)  # no designed read either
            assert loss == loss, spec


def test_strict_syncs_fails_a_direct_read_inside_the_step_region():
    import os

    from syncwise.comm import hostread

    os.environ[hostread.STRICT_ENV] = "1"
    try:
        t = torch.ones(()) * 2
        with hostread.step_region():
            copy = hostread.HostCopy({"x": t, "n": 3})
            try:
                float(t)
            except hostread.HostReadError as e:
                assert "HostCopy" in str(e) and "test_hot_path.py" in str(e)
            else:
                raise AssertionError("a direct read passed")
            with hostread.designed("test"):
                assert bool(t)
            assert copy.read() == {"x": 2.0, "n": 3}
        assert float(t) == 2.0  # outside the region: anything goes
    finally:
        del os.environ[hostread.STRICT_ENV]


# ---- lifetimes: an async collective owns its tensors until it completes -------------------------------------------
def _owned(rank, world):
    import gc
    import weakref

    from syncwise.comm import ops

    import time

    inp = torch.full((1024,), float(rank))
    out = torch.empty(world * 1024)
    alive = weakref.ref(inp)
    if rank == 1:
        time.sleep(1.0)  # rank 0's gather cannot complete before rank 1 joins: it is in flight below
    work = ops.all_gather(out, inp, async_op=True)
    held = [f for f in list(ops._in_flight.values()) if any(t is inp for t in f.tensors)]
    del inp  # the caller drops its input before waiting (SparseLoCo's payload did)
    gc.collect()
    owned_in_flight = rank == 1 or (bool(held) and alive() is not None)
    held = None
    work.wait()
    work.get_future().wait()
    gc.collect()
    released = not any(f.op == "all_gather" for f in ops._in_flight.values())
    return owned_in_flight, released, out[1024:].eq(1.0).all().item()


def test_an_async_collectives_record_owns_its_tensors_until_it_completes():
    """Fails on 7ed2b6b: the in-flight record kept no tensor (NCCL's stash went at the timing stream's wait)."""
    for owned, released, ok in run_workers(_owned, 2):
        assert owned and released and ok


# ---- N7, N11: NCCL's timeout above syncwise's; one timing stream per group ----------------------------------------
def test_nccl_timeout_is_set_above_the_watchdogs_report():
    from syncwise.comm import ops
    from syncwise.comm.watchdog import Watchdog
    import inspect

    grace = inspect.signature(Watchdog.__init__).parameters["grace_s"].default
    interval = inspect.signature(Watchdog.__init__).parameters["interval_s"].default
    for backend in ("nccl", "cuda:nccl,cpu:gloo"):
        assert ops.backend_timeout(60, backend).total_seconds() > 60 + grace + interval
    assert ops.backend_timeout(60, "gloo").total_seconds() == 60
    assert ops.backend_timeout(None, "nccl") is None


def test_one_timing_stream_per_group():
    from syncwise.comm import ops

    dev = torch.device("cuda", 0)
    a, b = object(), object()
    assert ops.timing_stream_key(dev, a) != ops.timing_stream_key(dev, b) != ops.timing_stream_key(dev, None)
    assert ops.timing_stream_key(dev, a) == ops.timing_stream_key(dev, a)


# ---- N4, N12, N13: chunks only on the CPU; pinned random-k indices; compressor matmuls in fp32 --------------------
def test_fp8_chunks_passes_only_on_the_cpu():
    from syncwise.compress.cast import FP8Compressor

    c = FP8Compressor()
    assert c._step(torch.device("cpu")) == FP8Compressor._CHUNK // c.config.block * c.config.block
    assert c._step(torch.device("cuda", 0)) >= 1 << 40  # one pass per bucket on a GPU (7ed2b6b: 2^18 there too)


def test_compressor_matmuls_are_fp32_on_the_cpu_and_fp64_rounded_on_a_gpu():
    from syncwise.compress.base import fp32_matmul

    seen = []

    def mm(a, b):
        seen.append(a.dtype)
        return a @ b

    a, b = torch.randn(4, 3), torch.randn(3, 2)
    assert torch.equal(fp32_matmul(mm, a, b), a @ b) and seen == [torch.float32]
