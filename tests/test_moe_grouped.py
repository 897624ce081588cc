"""The MoE expert implementations (grouped / padded / loop) compute the same thing, with no host
sync in the forward and without recompiling under torch.compile when the routing changes."""
import copy

import pytest
import torch
import torch.nn.functional as F

from syncwise.errors import ConfigError
from syncwise.models import MoE, build_model, resolve_config
from syncwise.models.moe import GroupedExperts, grouped_mm_supported

torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16]


def _fast_impls(device: str, dtype: torch.dtype) -> list[str]:
    """The no-sync implementations that run here: padded always, grouped where torch has it."""
    impls = ["padded"]
    if grouped_mm_supported(torch.device(device), dtype, (64, 64))[0]:
        impls.append("grouped")
    return impls


def _tol(device: str, dtype: torch.dtype) -> float:
    """Allowed max |difference| relative to the reference tensor's max |value|."""
    if dtype == torch.bfloat16:
        return 2e-2
    # fp32 on CUDA may run matmuls in TF32 when a caller enabled it.
    return 5e-3 if device == "cuda" and torch.backends.cuda.matmul.allow_tf32 else 1e-5


def _assert_close(ref: torch.Tensor, got: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    scale = ref.float().abs().max().clamp_min(1e-6)
    err = (got.float() - ref.float()).abs().max()
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} * {scale:.3g}"


def _run(moe: MoE, x: torch.Tensor, impl: str):
    """Forward + backward of a copy of ``moe`` with ``impl``; output, grads and load counts."""
    m = copy.deepcopy(moe)
    m.experts.impl = impl
    xx = x.detach().clone().requires_grad_()
    y = m(xx)
    # A loss with a dense, non-uniform gradient (exercises every gradient path).
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).square().sum().backward()
    grads = {"x": xx.grad, "router": m.router.weight.grad, "w1": m.experts.w1.grad,
             "w2": m.experts.w2.grad, "w3": m.experts.w3.grad}
    return y.detach(), grads, m.tokens_per_expert.clone()


def _moe(device: str, dtype: torch.dtype, **kw) -> MoE:
    torch.manual_seed(0)
    return MoE(resolve_config("tiny-moe", **kw)).to(device=device, dtype=dtype).train()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["balanced", "empty-experts", "one-token", "all-on-two"])
def test_every_impl_matches_the_loop_reference(device, dtype, case):
    moe = _moe(device, dtype, n_routed_experts=8, top_k=2)
    n = {"balanced": 96, "empty-experts": 40, "one-token": 1, "all-on-two": 33}[case]
    if case == "empty-experts":
        moe.expert_bias[:3] = 0.5          # experts 0-2 take most slots; several get none
    if case == "all-on-two":
        moe.expert_bias[[3, 6]] = 10.0     # every token goes to experts 3 and 6 only
    x = torch.randn(n, 64, device=device, dtype=dtype)
    ref_y, ref_g, ref_counts = _run(moe, x, "loop")
    if case in ("empty-experts", "all-on-two"):
        assert (ref_counts == 0).sum() >= 2, ref_counts
    for impl in _fast_impls(device, dtype):
        y, g, counts = _run(moe, x, impl)
        assert torch.equal(counts, ref_counts), impl    # load statistics are exactly the same
        _assert_close(ref_y, y, _tol(device, dtype), f"{impl} output")
        for name in ref_g:
            _assert_close(ref_g[name], g[name], _tol(device, dtype), f"{impl} grad {name}")
        if case == "all-on-two":   # experts without tokens get an exactly zero gradient
            assert g["w1"][counts == 0].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_grouped_matches_loop_exactly_on_cpu(dtype):
    # FIELD-NOTES: on CPU, _grouped_mm runs the same per-group mm as the loop: bitwise equal.
    if not grouped_mm_supported(torch.device("cpu"), dtype)[0]:
        pytest.skip("no torch._grouped_mm on CPU in this torch")
    moe = _moe("cpu", dtype)
    moe.expert_bias[:2] = 0.3
    x = torch.randn(50, 64, dtype=dtype)
    ref_y, ref_g, _ = _run(moe, x, "loop")
    y, g, _ = _run(moe, x, "grouped")
    assert torch.equal(y, ref_y)
    for name in ref_g:
        assert torch.equal(g[name], ref_g[name]), name


def test_autocast_bf16_matches_loop_and_keeps_gating_in_fp32():
    moe = _moe("cpu", torch.float32)
    x = torch.randn(2, 20, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_y, ref_g, _ = _run(moe, x, "loop")
        for impl in _fast_impls("cpu", torch.bfloat16):
            y, g, _ = _run(moe, x, impl)
            _assert_close(ref_y, y, 2e-2, f"{impl} output")
            for name in ref_g:
                _assert_close(ref_g[name], g[name], 2e-2, f"{impl} grad {name}")


def test_grouped_experts_alone_accept_a_stride_zero_gradient_and_a_count_list():
    # _grouped_mm's backward refuses the expanded gradient of y.sum(); the module hands on a
    # contiguous one. A list of counts (the old signature) still works.
    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 24)
    x = torch.randn(9, 16, requires_grad=True)
    counts = [3, 0, 5, 1]
    grads = {}
    for impl in ("loop", "padded") + (("grouped",) if grouped_mm_supported(x.device, x.dtype)[0] else ()):
        ex.impl = impl
        ex.zero_grad()
        x.grad = None
        ex(x, counts).sum().backward()
        grads[impl] = (x.grad.clone(), ex.w1.grad.clone())
    for impl, (gx, gw) in grads.items():
        torch.testing.assert_close(gx, grads["loop"][0])
        torch.testing.assert_close(gw, grads["loop"][1])


@pytest.mark.parametrize("block_size", [1, 3, 16, 512])
def test_padded_is_exact_for_any_block_size(block_size):
    moe = _moe("cpu", torch.float32)
    moe.experts.block_size = block_size
    moe.expert_bias[5] = 10.0               # one expert gets every token: the worst case for padding
    x = torch.randn(45, 64)
    ref_y, ref_g, _ = _run(moe, x, "loop")
    y, g, _ = _run(moe, x, "padded")
    _assert_close(ref_y, y, 1e-5, "output")
    for name in ref_g:
        _assert_close(ref_g[name], g[name], 1e-5, f"grad {name}")


@pytest.mark.parametrize("preset,shape", [("tiny-moe", (2, 24)), ("small", (2, 32))])
def test_full_model_loss_and_grads_agree_across_impls(preset, shape):
    torch.manual_seed(0)
    base = build_model(preset)
    idx = torch.randint(0, 256, shape)
    results = {}
    for impl in ("loop", "padded", "grouped"):
        if impl == "grouped" and not grouped_mm_supported(torch.device("cpu"), torch.float32)[0]:
            continue
        m = copy.deepcopy(base)
        for moe in m.moe_layers():
            moe.experts.impl = impl
        loss = F.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()},
                         [moe.tokens_per_expert.clone() for moe in m.moe_layers()])
    ref_loss, ref_grads, ref_counts = results.pop("loop")
    for impl, (loss, grads, counts) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(counts, ref_counts)), impl
        for name, g in ref_grads.items():
            _assert_close(g, grads[name], 1e-5, f"{impl} {name}")


class _NoHostSync:
    """Make every Python-level tensor→host read raise while active."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(*a, **k):
                raise AssertionError(f"host sync: Tensor.{name} called in MoE.forward")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["auto", "grouped", "padded"])
def test_forward_reads_nothing_back_to_the_host(device, impl):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if impl == "grouped" and impl not in _fast_impls(device, dtype):
        pytest.skip(f"torch._grouped_mm has no sync-free path on {device} {dtype}")
    moe = _moe(device, dtype, moe_impl=impl)
    x = torch.randn(3, 10, 64, device=device, dtype=dtype)
    moe(x)                                      # first call moves the load counter to the device
    with _NoHostSync():
        y = moe(x)
    y.float().square().sum().backward()          # backward may read what it likes
    # The loop reference does sync (that is why it is not the default):
    moe.experts.impl = "loop"
    with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
        moe(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cuda_forward_has_no_synchronizing_call(dtype):
    # CUDA's own detector: any device→host copy or stream sync in the forward raises.
    moe = _moe("cuda", dtype)
    x = torch.randn(4, 32, 64, device="cuda", dtype=dtype)
    moe(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("impl,dtype", [("auto", torch.float32), ("padded", torch.float32),
                                        ("auto", torch.bfloat16)], ids=["auto-fp32", "padded-fp32", "auto-bf16"])
def test_compiled_moe_does_not_recompile_when_the_routing_changes(impl, dtype):
    # aot_eager: dynamo + AOT autograd with fake tensors (where _grouped_mm's meta rules apply),
    # without inductor's C++ compile, which would take minutes on a shared 2-core machine.
    torch._dynamo.reset()
    moe = _moe("cpu", dtype, moe_impl=impl)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(moe, backend=backend, fullgraph=False)
    loads = set()
    for i in range(6):
        moe.expert_bias.zero_()
        if i % 2:
            moe.expert_bias[i] = 10.0        # expert i takes every token; others get none
        x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
        before = moe.tokens_per_expert.clone()
        y = compiled(x)
        y.float().square().sum().backward()
        loads.add(tuple((moe.tokens_per_expert - before).tolist()))
        if i == 0:
            first = len(graphs)
    assert len(loads) == 6                           # six different routings...
    assert len(graphs) == first                      # ...and no graph compiled after the first call
    assert first <= 2, [g.code for g in graphs]      # (one graph break: the checkpoint-recompute probe)
    # The compiled layer still computes what eager does.
    eager = copy.deepcopy(moe)
    x = torch.randn(2, 16, 64, dtype=dtype)
    _assert_close(eager(x), compiled(x), _tol("cpu", dtype), "compiled vs eager")
    torch._dynamo.reset()


def test_auto_resolution_and_config_validation():
    ex = GroupedExperts(4, 16, 16)
    x32, x16 = torch.zeros(2, 16), torch.zeros(2, 16, dtype=torch.bfloat16)
    cpu_grouped = grouped_mm_supported(torch.device("cpu"), torch.float32)[0]
    assert ex.resolve_impl(x32) == ("grouped" if cpu_grouped else "padded")
    assert ex.resolve_impl(x16) in ("grouped", "padded")
    for impl in ("loop", "padded", "grouped"):
        ex.impl = impl
        assert ex.resolve_impl(x32) == impl
    ok, reason = grouped_mm_supported(torch.device("cpu"), torch.int64)
    assert not ok and "int64" in reason
    assert resolve_config("small").moe_impl == "auto"
    with pytest.raises(ConfigError) as e:
        resolve_config("small", moe_impl="fast")
    assert e.value.field == "model.moe_impl" and "grouped" in e.value.accepted
    with pytest.raises(ValueError):
        GroupedExperts(2, 8, 8, impl="fast")
