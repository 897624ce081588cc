"""The DDP hook adapter on real gloo processes: many small buckets, every compressor, no hangs."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers
from syncwise.compress import (CompressionHookState, CompressionPolicy, GradientCompressor, compression_hook,
                               parse_compress_spec, torch_reference_hook)

SPECS = ["none", "fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.1,momentum=0.5", "randomk:ratio=0.1",
         "powersgd:rank=2,start_iter=1"]
STEPS = 4


class Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.l1 = nn.Linear(32, 128)
        self.norm = nn.LayerNorm(128)
        self.l2 = nn.Linear(128, 64)
        self.l3 = nn.Linear(64, 8)
        self.spare = nn.Linear(8, 8) if unused else None  # never used: exercises find_unused_parameters

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.norm(self.l1(x))))))


def _train(rank, spec, steps, via_seed_api=False, unused=False):
    torch.manual_seed(0)
    model = DDP(Net(unused), bucket_cap_mb=0.01, find_unused_parameters=unused)  # ~2.6k floats per bucket
    policy = CompressionPolicy(min_numel=1024)
    if via_seed_api:
        gc = GradientCompressor(0.1, spec)
        state = gc.register(model, policy=policy)
    else:
        names = {p: n for n, p in model.module.named_parameters()}
        state = CompressionHookState(parse_compress_spec(spec), None, names, policy)
        model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    stats = state.compressor.stats  # the compressor's own counter: its collectives, counted where issued
    before = stats.total_bytes
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = x[:, :8].sum(1, keepdim=True).expand(-1, 8)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    sent = stats.total_bytes - before
    counted = state.compressor.counters["bytes_sent"]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    sd = state.state_dict()
    keys = sorted(sd["compressor"]["per_tensor"])
    state.close()
    return {"params": flat, "losses": losses, "sent": sent, "steps": sd["steps"], "keys": keys,
            "counted": counted}


def _all_specs(rank, world):
    out = {spec: _train(rank, spec, STEPS) for spec in SPECS}
    out["seed_api:powersgd"] = _train(rank, "powersgd", 2, via_seed_api=True)
    out["unused:powersgd"] = _train(rank, "powersgd:start_iter=0", 3, unused=True)
    # plain DDP (its own all-reduce hook) for the lossless comparison
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g)
        y = x[:, :8].sum(1, keepdim=True).expand(-1, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["plain"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    # torch's own bf16 cast path as a peer runs on gloo through the reference helper
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    model.register_comm_hook(*torch_reference_hook("bf16"))
    model(torch.randn(4, 32)).sum().backward()
    out["torch_bf16_ok"] = all(p.grad is not None for p in model.parameters())
    out["n_buckets_hint"] = sum(p.numel() for p in model.parameters()) / (0.01 * 2 ** 20 / 4)
    dist.barrier()
    return out


def test_every_compressor_trains_with_many_buckets_and_ranks_agree():
    r0, r1 = run_workers(_all_specs, 2)
    assert r0["n_buckets_hint"] > 4
    assert r0["torch_bf16_ok"] and r1["torch_bf16_ok"]  # really many buckets
    fp32_bytes = r0["none"]["sent"]
    for spec in SPECS + ["seed_api:powersgd", "unused:powersgd"]:
        a, b = r0[spec], r1[spec]
        assert (a["params"] == b["params"]).all(), f"{spec}: parameters diverged across ranks"
        assert all(l == l for l in a["losses"]), f"{spec}: NaN loss"
        assert a["steps"] == len(a["losses"]), spec  # the hook saw every backward, last bucket included
        assert a["keys"] == b["keys"]
        assert a["sent"] == a["counted"] > 0, spec  # its counter saw exactly the compressor's payloads
    # lossless path matches DDP's own all-reduce
    assert abs(r0["none"]["params"] - r0["plain"]).max() < 1e-5
    # per-tensor state is keyed by parameter name (stable across bucket rebuilds and restarts)
    assert "l1.weight" in r0["topk:ratio=0.1,momentum=0.5"]["keys"]
    assert "l2.weight" in r0["powersgd:rank=2,start_iter=1"]["keys"]
    # compressed paths really send less than fp32
    for spec in ["fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.1,momentum=0.5", "randomk:ratio=0.1",
                 "powersgd:rank=2,start_iter=1"]:
        assert r0[spec]["sent"] < fp32_bytes, spec
    # training makes progress under the lossy compressors too
    for spec in SPECS:
        assert r0[spec]["losses"][-1] < r0[spec]["losses"][0] * 1.5, spec


def _fp8_direct_vs_exact(rank, world, spec):
    """One backward under DDP with the fp8 hook against the exact fp32 average of the same gradients."""
    torch.manual_seed(0)
    plain = Net()
    model = DDP(Net(), bucket_cap_mb=0.01)
    model.module.load_state_dict(plain.state_dict())
    names = {p: n for n, p in model.module.named_parameters()}
    state = CompressionHookState(parse_compress_spec(spec), None, names, CompressionPolicy(min_numel=1024))
    model.register_comm_hook(state, compression_hook)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    out = {}
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        exact = q.grad.clone()
        dist.all_reduce(exact)
        exact /= world
        rel = (p.grad - exact).abs().max().item() / exact.abs().max().item()
        out[name] = (state.policy.compress(p), rel)
    state.close()
    return out


def test_fp8_sends_raw_tensors_exactly_and_compressed_ones_within_e4m3_precision():
    # one all-gather per bucket straight from the hook, the raw fp32 tensors riding behind the fp8 codes
    for spec in ["fp8", "fp8:error_feedback=true"]:
        for errors in run_workers(_fp8_direct_vs_exact, 2, spec):
            assert sum(compressed for compressed, _ in errors.values()) == 2  # l1.weight, l2.weight
            for name, (compressed, rel) in errors.items():
                if compressed:  # e4m3 keeps 3 mantissa bits: ≤ 2^-4 of the block's largest value per rank
                    assert 0 < rel <= 2 ** -4, (spec, name, rel)
                else:  # small or 1-D: left uncompressed by the policy, sent as fp32 bytes
                    assert rel < 1e-6, (spec, name, rel)


NAN_SPECS = SPECS + ["fp8:error_feedback=true", "int8:error_feedback=true", "topk:ratio=0.1",
                     "powersgd:rank=2,start_iter=0", "demo:chunk=8,topk=4", "demo:sign=no", "topk:ratio=0.1,warmup=1"]


def _one_rank_nan(rank, world):
    """Rank 1's gradients are NaN at step 2 (of 4): every rank must skip that step alike — no hang, no
    collective mismatch — and the compressor's state after it must equal its state before it."""
    out = {}
    for spec in NAN_SPECS:
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)
        names = {p: n for n, p in model.module.named_parameters()}
        state = CompressionHookState(parse_compress_spec(spec), None, names, CompressionPolicy(min_numel=1024))
        model.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        skipped, states = [], []
        for step in range(1, 5):
            x = torch.randn(16, 32, generator=g)
            y = x[:, :8].sum(1, keepdim=True).expand(-1, 8)
            loss = nn.functional.mse_loss(model(x), y)
            if step == 2 and rank == 1:
                loss = loss * float("nan")
            opt.zero_grad()
            before = state.state_dict()
            loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if finite:
                opt.step()
            else:
                skipped.append(step)
                states.append((before, state.state_dict()))
        state.close()
        unchanged = all(_same_state(a, b) for a, b in states)
        out[spec] = {"skipped": skipped, "unchanged": unchanged,
                     "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()}
    return out


def _same_state(a, b):
    pa, pb = a["compressor"]["per_tensor"], b["compressor"]["per_tensor"]
    if set(pa) != set(pb):
        return False
    for k in pa:
        for n, v in pa[k].items():
            w = pb[k].get(n)
            if torch.is_tensor(v) and not (torch.is_tensor(w) and torch.equal(v, w)) or (
                    not torch.is_tensor(v) and v != w):
                return False
    return True


def test_nan_on_one_rank_is_skipped_by_every_rank_with_state_untouched():
    r0, r1 = run_workers(_one_rank_nan, 2)
    for spec in NAN_SPECS:
        assert r0[spec]["skipped"] == r1[spec]["skipped"] == [2], spec
        assert r0[spec]["unchanged"] and r1[spec]["unchanged"], spec
        assert (r0[spec]["params"] == r1[spec]["params"]).all(), spec  # replicas stay identical


def _peak_rss_growth_mb(rank, world, spec, warm, steps):
    """How much the process's peak resident set (the trainer's CPU peak-memory metric) grew from DDP step ``warm`` to
    step ``steps`` of 4 MB layers in one 16 MB bucket under ``spec``."""
    from syncwise.metrics import peak_memory_mb
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]), bucket_cap_mb=25)
    state = CompressionHookState(parse_compress_spec(spec), None, model.module, CompressionPolicy())
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        model(torch.randn(64, 1024, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == warm:
            warmed = peak_memory_mb()
    state.close()
    return peak_memory_mb() - warmed


def test_fp8_peak_memory_stops_growing_after_warm_up():
    # issue 26: fp8 decoded each bucket into fresh bucket-sized buffers on gloo's callback thread; on CPU glibc's
    # arenas fragmented and the resident set grew every step (2,409 MB vs fp32 DDP's 617 MB over 400 `small`
    # steps). The absolute peak is no measure (the process's baseline differs by machine: fp32 DDP peaked at 325 to
    # 376 MB); its growth once warm is. Measured from step 10 to 30: before the fix 96 and 192 MB, after it 0 to 8 MB
    # (fp32 DDP 0 to 4). The bound is two buckets: anything bucket-sized allocated per step outgrows it.
    growth = run_workers(_peak_rss_growth_mb, 2, "fp8", 10, 30)
    assert max(growth) <= 2 * 16, growth
