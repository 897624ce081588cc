"""Compressors at device speed: random draws on the tensors' device from replayable seeds, shared random-k
indices on every rank, exact resume, and no host sync on the thread DDP runs the compression hook on.

Everything runs on CPU; where CUDA is available each test also runs on it (2 gloo ranks share GPU 0 when
only one is visible: NCCL refuses that, gloo with CUDA tensors does not).
"""
import io
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers
from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec
from syncwise.compress.base import Verdict
from syncwise.compress.sparse import first_distinct, k_for

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DRAWING = ["int8", "int8:error_feedback=true", "randomk:ratio=0.05", "randomk:ratio=0.5",
           "powersgd:rank=2,start_iter=0,warm_start=false", "powersgd:rank=2,start_iter=1"]
SHAPES = {"w1": (64, 96), "w2": (128, 64), "b": (96,)}


def _device(name, rank=0):
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def _grads(step, device, rank=0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {k: torch.randn(s, generator=g).to(device) for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group in this process: the compressors' collectives become local copies."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def _step(comp, step, device, flags=(True, True, False)):
    ts = [t.clone() for t in _grads(step, device).values()]
    comp.average(ts, list(SHAPES), None, list(flags))
    return ts


# ---- draws on the device -----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", DRAWING)
def test_random_draws_come_from_a_generator_on_the_tensors_device(one_rank_group, monkeypatch, device, spec):
    dev = _device(device)
    inputs = [[t.clone() for t in _grads(step, dev).values()] for step in range(2)]  # drawn before the spying
    draws = []  # (what was drawn: its device, the generator's device)

    def record(out, kwargs):
        gen = kwargs.get("generator")
        draws.append((out.device, gen.device if gen is not None else None))

    for name in ("rand", "randn", "randperm", "randint"):
        def spy(*args, _real=getattr(torch, name), **kwargs):
            out = _real(*args, **kwargs)
            record(out, kwargs)
            return out
        monkeypatch.setattr(torch, name, spy)
    for name in ("uniform_", "normal_", "random_"):
        def spy_(self, *args, _real=getattr(torch.Tensor, name), **kwargs):
            out = _real(self, *args, **kwargs)
            record(out, kwargs)
            return out
        monkeypatch.setattr(torch.Tensor, name, spy_)
    comp = parse_compress_spec(spec)
    for ts in inputs:
        comp.average(ts, list(SHAPES), None, [True, True, False])
    monkeypatch.undo()
    assert draws, spec  # the compressor did draw
    for out_device, gen_device in draws:
        assert out_device.type == dev.type and gen_device is not None and gen_device.type == dev.type, draws
    # one generator per device, re-seeded per draw (no construction per call)
    assert [d.type for d in comp._generators] == [dev.type]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", DRAWING + ["topk:ratio=0.05,momentum=0.9", "sign", "fp8:error_feedback=true",
                                  "demo:chunk=8,topk=4", "topk:ratio=0.05,warmup=2"])
def test_state_dict_round_trip_through_a_file_replays_the_same_draws(one_rank_group, device, spec):
    """Resume exactness: the step counters seed every draw, so a checkpointed state gives the same next
    steps bit for bit; a compressor without that state draws differently."""
    dev = _device(device)
    a = parse_compress_spec(spec)
    for step in range(3):
        _step(a, step, dev)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = parse_compress_spec(spec)
    b.load_state_dict(torch.load(buf, map_location=dev, weights_only=False))
    fresh = parse_compress_spec(spec)
    for step in range(3, 5):
        out_a, out_b = _step(a, step, dev), _step(b, step, dev)
        assert all(torch.equal(x, y) for x, y in zip(out_a, out_b)), (spec, step)
    sa, sb = a.state_dict()["per_tensor"], b.state_dict()["per_tensor"]
    assert sa.keys() == sb.keys()
    assert sorted(sa) == ["w1", "w2"]  # the bias is sent uncompressed: no state
    for k in sa:
        assert sa[k]["count"] == sb[k]["count"] == 5, (k, sa[k]["count"])
        for n, v in sa[k].items():
            assert torch.equal(v, sb[k][n]) if torch.is_tensor(v) else v == sb[k][n], (spec, k, n)
    if spec.startswith(("int8", "randomk")) or "warm_start=false" in spec:  # draws seeded by the counters
        assert not torch.equal(_step(b, 5, dev)[0], _step(fresh, 5, dev)[0]), spec


STATEFUL = ["int8:error_feedback=true", "sign", "topk:ratio=0.05,momentum=0.9", "randomk:ratio=0.05", "fp8:error_feedback=true",
            "powersgd:rank=2,start_iter=0", "powersgd:rank=2,start_iter=0,warm_start=false", "demo:chunk=8,topk=4",
            "demo:sign=no", "sign:warmup=1"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", STATEFUL)
def test_a_non_finite_bucket_comes_back_nan_with_the_state_untouched(one_rank_group, device, spec):
    """Decided on the device: the whole bucket (the uncompressed bias too) is NaN, the state and counters
    are as before, and the next step equals that of a compressor that never saw the bad one."""
    dev = _device(device)
    comp = parse_compress_spec(spec)
    for step in range(2):
        _step(comp, step, dev)
    before = comp.state_dict()
    bad = [t.clone() for t in _grads(2, dev).values()]
    bad[1][3, 5] = float("inf") if "sign" in spec else float("nan")
    comp.average(bad, list(SHAPES), None, [True, True, False])
    assert all(bool(torch.isnan(t).all()) for t in bad), spec
    after = comp.state_dict()
    for k, slot in before["per_tensor"].items():
        for n, v in slot.items():
            w = after["per_tensor"][k][n]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (spec, k, n)
    twin = parse_compress_spec(spec)
    twin.load_state_dict(before)
    assert all(torch.equal(x, y) for x, y in zip(_step(comp, 3, dev), _step(twin, 3, dev))), spec


def test_first_distinct_draws_k_distinct_uniformly_and_replayably():
    g = torch.Generator()
    for n, k in [(1, 1), (5, 1), (100, 25), (1000, 10), (4 << 20, k_for(4 << 20, 0.01))]:
        a = first_distinct(n, k, g.manual_seed(7))
        assert torch.equal(a, first_distinct(n, k, g.manual_seed(7)))
        assert a.numel() == k and (a.diff() > 0).all() and 0 <= int(a[0]) and int(a[-1]) < n
    # every 2-subset of range(6) equally likely (15 of them, 6000 draws: 400 each, sd ~19)
    counts = {}
    for s in range(6000):
        key = tuple(first_distinct(6, 2, g.manual_seed(s)).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 15 and min(counts.values()) > 300 and max(counts.values()) < 500, counts


@pytest.mark.parametrize("device", DEVICES)
def test_randomk_indices_are_k_distinct_on_the_device_and_change_per_step(one_rank_group, device):
    dev = _device(device)
    comp = parse_compress_spec("randomk:ratio=0.05")
    n = 64 * 96
    seen = []
    for step in range(3):
        i = comp.indices("w1", n, dev)
        assert i.device.type == dev.type and i.numel() == k_for(n, 0.05) and i.unique().numel() == i.numel()
        assert torch.equal(i, comp.indices("w1", n, dev))  # same step, same draw
        seen.append(i.cpu())
        _step(comp, step, dev)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


def test_verdict_on_cpu_is_read_without_waiting():
    v = Verdict(torch.tensor(False), 10, ["a"])
    assert v.ready() and v.value() is False and v.keys == frozenset({"a"})
    assert Verdict(True, 1, ()).value() is True


def test_booked_verdicts_stay_bounded_and_fold_into_the_counters():
    comp = parse_compress_spec("fp8")
    comp._MAX_VERDICTS = 4
    for i in range(10):
        comp.book(torch.tensor(i % 3 != 0), 100, ["w"])  # steps 0, 3, 6, 9 skipped
        assert len(comp._verdicts) <= 5
    assert comp.counters["elements"] == 600 and not comp._verdicts
    assert comp.state_dict()["per_tensor"]["w"]["count"] == 6


# ---- on 2 real gloo ranks ------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 128)
        self.norm = nn.LayerNorm(128)
        self.l2 = nn.Linear(128, 64)
        self.l3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.norm(self.l1(x))))))


HOOK_SPECS = ["none", "fp16", "bf16", "fp8", "fp8:error_feedback=true", "int8", "int8:error_feedback=true", "sign",
              "topk:ratio=0.1,momentum=0.5", "randomk:ratio=0.1", "powersgd:rank=2,start_iter=1",
              "powersgd:rank=2,start_iter=0,warm_start=false"]
# Tensor methods that read a value on the host (on a GPU each waits for the device's stream).
HOST_READS = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero"]


def _batch(g, device):
    x = torch.randn(16, 32, generator=g)
    return x.to(device), x[:, :8].sum(1, keepdim=True).expand(-1, 8).to(device)


def _ddp(spec, device, hook_threads):
    torch.manual_seed(0)
    model = DDP(Net().to(device), bucket_cap_mb=0.01)  # ~2.6k floats per bucket: many buckets
    names = {p: n for n, p in model.module.named_parameters()}
    state = CompressionHookState(parse_compress_spec(spec), None, names, CompressionPolicy(min_numel=1024))

    def hook(st, bucket):  # records which thread DDP runs the hook on (CPU: the caller's; CUDA: autograd's)
        hook_threads.add(threading.get_ident())
        return compression_hook(st, bucket)

    model.register_comm_hook(state, hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05)


def _host_syncs(rank, world, device_name):
    """Per spec and backward pass, the host reads made on the hook's thread and on the threads that run the
    collectives' callbacks (everything but the compressor's own worker thread); NaN on rank 1 at step 2."""
    device = _device(device_name, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hook_threads, calls, out = set(), [], {}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        real = originals[name]

        def wrapper(self, *args, **kwargs):
            if threading.get_ident() in hook_threads:
                calls.append(("hook thread", name))
            elif threading.current_thread().name != "syncwise-compress":
                calls.append(("callback thread", name))
            return real(self, *args, **kwargs)
        return wrapper

    for spec in HOOK_SPECS:
        model, state, opt = _ddp(spec, device, hook_threads)
        g = torch.Generator().manual_seed(rank)
        counts, skipped = [], []
        for step in range(1, 4):
            x, y = _batch(g, device)
            loss = nn.functional.mse_loss(model(x), y)
            if step == 2 and rank == 1:
                loss = loss * float("nan")
            opt.zero_grad()
            del calls[:]
            for name in HOST_READS:
                setattr(torch.Tensor, name, counting(name))
            try:
                loss.backward()
            finally:
                for name, real in originals.items():
                    setattr(torch.Tensor, name, real)
            counts.append(list(calls))
            if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                opt.step()
            else:
                skipped.append(step)
        sd = state.state_dict()
        state.close()
        out[spec] = {"calls": counts, "skipped": skipped, "hook_threads": len(hook_threads),
                     "counts": sorted({k: v["count"] for k, v in sd["compressor"]["per_tensor"].items()}.items()),
                     "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()}
    return out


def _randomk_ranks(rank, world, device_name):
    """Each rank draws random-k indices itself: they must be the same, and the all-reduce of the values
    at them must be the exact average there (zero elsewhere, without error feedback)."""
    device = _device(device_name, rank)
    comp = parse_compress_spec("randomk:ratio=0.05,error_feedback=false")
    out = []
    for step in range(3):
        grads = _grads(step, device, rank)
        idx = {k: comp.indices(k, t.numel(), device).cpu().numpy() for k, t in grads.items()}
        exact = {}
        for k, t in grads.items():
            e = t.clone()
            dist.all_reduce(e)
            exact[k] = e / world
        ts = [t.clone() for t in grads.values()]
        comp.average(ts, list(grads), None)
        ok = True
        for (k, t), i in zip(grads.items(), idx.values()):
            mask = torch.zeros(t.numel(), dtype=torch.bool, device=device)
            mask[torch.from_numpy(i).to(device)] = True
            got = ts[list(grads).index(k)].reshape(-1)
            ok &= bool(torch.equal(got[~mask], torch.zeros_like(got[~mask])))
            ok &= bool(torch.allclose(got[mask], exact[k].reshape(-1)[mask], atol=1e-6))
        out.append({"idx": idx, "matches_exact_average": ok})
    return out


def _resume(rank, world, device_name, spec):
    """4 steps straight vs 2 steps, a checkpoint (model, compressor) and a fresh DDP + hook for 2 more."""
    device = _device(device_name, rank)

    def train(model, state, opt, g, steps):
        for _ in range(steps):
            x, y = _batch(g, device)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, state, opt = _ddp(spec, device, set())
    g = torch.Generator().manual_seed(rank)
    train(model, state, opt, g, 4)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    state.close()

    model, state, opt = _ddp(spec, device, set())
    g = torch.Generator().manual_seed(rank)
    train(model, state, opt, g, 2)
    buf = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "compress": state.state_dict()}, buf)
    state.close()
    buf.seek(0)
    ckpt = torch.load(buf, map_location=device, weights_only=False)
    model, state, opt = _ddp(spec, device, set())
    model.module.load_state_dict(ckpt["model"])
    state.load_state_dict(ckpt["compress"])
    train(model, state, opt, g, 2)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    state.close()
    return bool(torch.equal(straight, resumed))


def _all(rank, world, device_name):
    return {"syncs": _host_syncs(rank, world, device_name), "randomk": _randomk_ranks(rank, world, device_name),
            "resume": {spec: _resume(rank, world, device_name, spec)
                       for spec in ["int8", "randomk:ratio=0.1", "powersgd:rank=2,start_iter=1,warm_start=false",
                                    "topk:ratio=0.1,momentum=0.5"]}}


@pytest.fixture(scope="module", params=DEVICES)
def ranks(request):
    return run_workers(_all, 2, request.param, timeout=300)


def test_no_host_read_on_the_hook_thread_or_in_the_collectives_callbacks(ranks):
    for r in ranks:
        for spec, res in r["syncs"].items():
            assert res["hook_threads"] >= 1, spec
            assert res["calls"] == [[], [], []], (spec, res["calls"])


def test_nan_step_still_skipped_everywhere_with_counters_untouched(ranks):
    r0, r1 = ranks
    for spec in HOOK_SPECS:
        a, b = r0["syncs"][spec], r1["syncs"][spec]
        assert a["skipped"] == b["skipped"] == [2], spec
        assert (a["params"] == b["params"]).all(), spec
        assert a["counts"] == b["counts"], spec
        for _, count in a["counts"]:
            assert count == 2, (spec, a["counts"])  # 3 backward passes, one skipped


def test_randomk_indices_identical_on_both_ranks(ranks):
    r0, r1 = ranks
    for step, (a, b) in enumerate(zip(r0["randomk"], r1["randomk"])):
        assert a["idx"].keys() == b["idx"].keys()
        for k in a["idx"]:
            assert (a["idx"][k] == b["idx"][k]).all(), (step, k)
            assert len(set(a["idx"][k].tolist())) == k_for(int(torch.Size(SHAPES[k]).numel()), 0.05)
        assert a["matches_exact_average"] and b["matches_exact_average"], step
    assert not (r0["randomk"][0]["idx"]["w1"] == r0["randomk"][1]["idx"]["w1"]).all()


def test_resume_under_ddp_is_exact(ranks):
    for r in ranks:
        for spec, same in r["resume"].items():
            assert same, spec
