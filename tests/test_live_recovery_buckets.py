"""The cross-replica gradient buckets of live recovery (syncwise.train.live_buckets.ReplicaBuckets), on a real
single-process gloo group: bucket assignment, buckets sent from gradient hooks during backward in bucket order, an
unused parameter's zeros, and the averages written back to ``.grad``. (The replica groups themselves:
tests/test_live_recovery.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncwise.errors import ConfigError
from syncwise.train.live_buckets import ReplicaBuckets, assign_buckets


def test_buckets_reverse_order_caps_and_dtypes():
    params = [torch.zeros(256), torch.zeros(256), torch.zeros(256, dtype=torch.float64), torch.zeros(512),
              torch.zeros(100)]
    # 1 KiB each for fp32 256; the first bucket closes at 1 KiB, then at 3 KiB; a dtype change closes one too
    assert assign_buckets(params, cap_bytes=3072, first_bytes=1024) == [[4, 3], [2], [1, 0]]
    assert assign_buckets(params) == [[4, 3], [2], [1, 0]]  # (default caps: only the dtype splits these)
    with pytest.raises(ConfigError, match="bucket_cap_bytes"):
        assign_buckets(params, cap_bytes=0)


def test_buckets_go_out_during_backward_in_order_and_come_back_averaged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    unused = nn.Linear(4, 4)  # (an MoE expert no token chose: no gradient this step)
    params = [*model.parameters(), *unused.parameters()]
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for p in params:
        p.grad = None

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)  # a real gloo group of one: the sum is the tensor itself
    sent = []

    def issue(flat):
        sent.append((flat.numel(), sum(p.grad is not None for p in params)))  # gradients ready when it went out
        return pg.allreduce([flat])

    buckets = ReplicaBuckets(params, issue, overlap=True, cap_bytes=1024, first_bytes=512)
    assert len(buckets.buckets) >= 3 and buckets.buckets[0][0] == len(params) - 1
    for step in range(2):  # the same buffers serve every step
        for p in params:
            p.grad = None
        buckets.arm()
        model(x).square().mean().backward()
        in_backward = buckets.issued
        buckets.finish()
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g)
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
    # the unused parameters sit in the first bucket (reverse order): it waits for them, and so does every
    # bucket after it (sent in order) -- so the order test uses the model alone
    assert in_backward == 0 and [n for n, _ in sent[:len(buckets.buckets)]] == [f.numel() for f in buckets.flats]
    buckets.close()

    sent.clear()
    params = list(model.parameters())
    buckets = ReplicaBuckets(params, issue, overlap=True, cap_bytes=1024, first_bytes=512)
    for p in params:
        p.grad = None
    buckets.arm()
    model(x).square().mean().backward()
    assert buckets.issued == len(buckets.buckets)  # every bucket went out from the hooks, during backward
    assert sent[0][1] < len(params)  # the first one before the first layers' gradients existed
    buckets.finish()
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g)
    buckets.close()
    for p in params:  # closed: no hook left on the parameters
        p.grad = None
    buckets.arm()
    model(x).square().mean().backward()
    assert buckets.issued == 0


@pytest.mark.parametrize("compress, dtype, tol", [("bf16", torch.bfloat16, 1e-2), ("fp16", torch.float16, 1e-3)])
def test_a_16_bit_compress_method_sends_half_the_bytes_and_the_average_comes_back_in_fp32(compress, dtype, tol):
    """compress.method=bf16/fp16 under live recovery: every bucket goes out cast (half the bytes on the wire), the
    gradients come back fp32 within the cast's precision; the compressors torchft cannot carry are refused."""
    from syncwise.train.live_buckets import wire_dtype

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    params = list(model.parameters())
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in params]
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    sent = []

    def issue(wire):
        sent.append((wire.dtype, wire.numel() * wire.element_size()))
        return pg.allreduce([wire])

    buckets = ReplicaBuckets(params, issue, overlap=False, wire_dtype=wire_dtype(compress))
    for p in params:
        p.grad = None
    buckets.arm()
    model(x).square().mean().backward()
    buckets.finish()
    assert {d for d, _ in sent} == {dtype}
    assert sum(b for _, b in sent) * 2 == sum(p.numel() * 4 for p in params)
    for p, g in zip(params, expected):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, g, rtol=tol, atol=tol)
    assert wire_dtype("none") is None and wire_dtype(None) is None and wire_dtype("powersgd:rank=4") is None
