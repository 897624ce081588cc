"""Expert parallel on real gloo groups (2 processes; each rank feeds its own tokens).

One launch checks an MoE layer under ep=2 against the same layer without EP on the same tokens, for each
dispatch precision and three routings (random and uneven; every token to rank 0's experts, so rank 1 receives
no rows and two experts no tokens; every token to the peer's experts): outputs, input / router / shared-expert
gradients, expert gradients (summed over the ranks' tokens, as the dispatch sums them), the load counts and
bias update, the bytes of each all-to-all, and the padded / loop implementations and bf16 autocast. A second
launch trains a tiny DeepSeek MoE model at ep=2 for a few SGD (momentum) steps against one model on the union
batch, then reshards DCP checkpoints (model and optimizer) ep2 → ep1 and ep1 → ep2.

Tolerances. fp32 dispatch: the expert matmuls see the same rows, only grouped differently, so outputs and
gradients agree to 1e-6 of their largest element (measured: 0 to 3.1e-7). bf16 and fp8 lose precision on the
wire; errors are max |EP − local| / max |local| over a tensor (measured, ep=2, d_model 32, weights N(0, 0.2)):
bf16 outputs ≤ 0.43 %, input and expert gradients ≤ 0.65 %, router gradient ≤ 1.5 % (a sum over tokens and
experts with cancellation); fp8 e4m3 with 1×128 block scales (combine and backward in bf16) outputs ≤ 3.0 %,
input gradients ≤ 2.9 %, expert gradients ≤ 6.0 %, router gradient ≤ 6.8 % (fp8's own rounding is at most
1/28 ≈ 3.6 % of a row block's largest element). Bounds: 2.5 % (bf16), 10 % (fp8). Model: the losses of 4 SGD
steps at ep=2 equal one process on the union batch within 2e-6 (measured ≤ 4.8e-7); forgetting the 1/dp rule
for expert gradients moves the weights by 1.5e-3, far outside the 1e-5 checked.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from distributed import run_workers
from syncwise.errors import ConfigError
from syncwise.models.config import ModelConfig
from syncwise.models.moe import MoE
from syncwise.parallel.expert_parallel import (check_dispatch, check_expert_parallel, decode_fp8_rows,
                                               encode_fp8_rows, wire_row_bytes)

D, K, E = 32, 2, 4
ROW = {"fp32": 4 * D, "bf16": 2 * D, "fp8": D + 4}     # bytes of one d=32 row on the wire (one fp8 scale)
BOUND = {"fp32": 1e-6, "bf16": 0.025, "fp8": 0.1}
MODEL = dict(d_model=D, n_heads=4, n_layers=2, n_dense_layers=1, n_routed_experts=E, top_k=K, moe_hidden=16,
             ffn_hidden=64, seq_len=16, n_shared_experts=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the tensor's scale."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------- the layer, one launch
def _layer_run(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from syncwise.comm import CommStats
    from syncwise.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)                                    # the same weights on every rank
    base = MoE(ModelConfig(**MODEL)).train()
    base.reset_parameters(0.2, 0.2)
    with torch.no_grad():
        base.router.weight.normal_(0, 0.3)
    n = 5 if rank == 0 else 3                               # uneven token counts
    g = torch.Generator().manual_seed(100 + rank)
    x, gout = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    far = torch.tensor([10.0, 10.0, 0.0, 0.0])              # a bias that forces experts 0 and 1 (rank 0's)
    biases = {"random": torch.zeros(E), "all-to-rank0": far, "all-to-peer": far if rank == 1 else far.flip(0)}
    lo = rank * (E // world)
    out: dict = {"errors": {}, "bytes": {}, "recv_rows": {}, "impls": {}}
    for dispatch in ("fp32", "bf16", "fp8"):
        for case, bias in biases.items():
            ref, epm = copy.deepcopy(base), copy.deepcopy(base)
            ref.expert_bias.copy_(bias)
            epm.expert_bias.copy_(bias)
            stats = CommStats()
            apply_expert_parallel(epm, dist.group.WORLD, dispatch, stats=stats)   # bytes into stats
            xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr = ref(xr)
            (yr * gout).sum().backward()
            stats.reset()
            ye = epm(xe)
            fwd = stats.snapshot()["all_to_all"]
            stats.reset()
            (ye * gout).sum().backward()
            bwd = stats.snapshot()["all_to_all"]
            # Routing and load statistics are the MoE's own code, on this rank's tokens: identical.
            assert torch.equal(epm.tokens_per_expert, ref.tokens_per_expert)
            total = ref.tokens_per_expert.clone()
            dist.all_reduce(total)
            # The bias update sees the counts summed over the ranks on both sides.
            for m in (ref, epm):
                c = m.tokens_per_expert.clone()
                dist.all_reduce(c)
                m.update_bias(c)
            assert torch.equal(epm.expert_bias, ref.expert_bias)
            # Expert gradients under EP sum every rank's tokens for this rank's experts.
            err = {"output": _rel(ye.detach(), yr.detach()), "input_grad": _rel(xe.grad, xr.grad),
                   "router_grad": _rel(epm.router.weight.grad, ref.router.weight.grad)}
            for name in ("w1", "w3", "w2"):
                full = getattr(ref.experts, name).grad.clone()
                dist.all_reduce(full)
                got = getattr(epm.experts, name).grad.to_local()
                err[f"expert_{name}_grad"] = _rel(got, full[lo:lo + E // world])
            for name, p in epm.shared.named_parameters():
                err[f"shared_{name}_grad"] = _rel(p.grad, dict(ref.shared.named_parameters())[name].grad)
            out["errors"][(dispatch, case)] = err
            out["bytes"][(dispatch, case)] = (fwd["calls"], fwd["bytes"], bwd["calls"], bwd["bytes"])
            out["recv_rows"][case] = int(total[lo:lo + E // world].sum())
    out["sent_rows"] = n * K
    # The local compute is GroupedExperts' own, whichever implementation, also under bf16 autocast.
    for impl, autocast in (("padded", False), ("loop", False), ("grouped", True)):
        ref, epm = copy.deepcopy(base), copy.deepcopy(base)
        ref.experts.impl = epm.experts.impl = impl
        apply_expert_parallel(epm, dist.group.WORLD, "fp32")
        ys = []
        for m in (ref, epm):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = m(xi)
            (y.float() * gout).sum().backward()
            ys.append((y.detach(), xi.grad))
        out["impls"][(impl, autocast)] = max(_rel(a, b) for a, b in zip(*ys))
    try:
        apply_expert_parallel(MoE(ModelConfig(**{**MODEL, "n_routed_experts": 3})), dist.group.WORLD)
    except ConfigError as e:
        out["refused"] = e.field
    return out


def test_ep2_layer_matches_local_moe():
    results = run_workers(_layer_run, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["refused"] == "parallel.ep"
        assert max(res["impls"].values()) <= 1e-6, res["impls"]
        for (dispatch, case), err in res["errors"].items():
            worst = max(err.values())
            assert worst <= BOUND[dispatch], (rank, dispatch, case, err)
        # Every token to rank 0's experts: rank 1 receives nothing; to the peer: each gets the other's rows.
        assert (res["recv_rows"]["all-to-rank0"] == 0) == (rank == 1)
        assert res["recv_rows"]["all-to-peer"] == results[1 - rank]["sent_rows"]
        for (dispatch, case), (fc, fb, bc, bb) in res["bytes"].items():
            sent, recv = res["sent_rows"], res["recv_rows"][case]
            combine = "bf16" if dispatch == "fp8" else dispatch
            grad = "bf16" if dispatch == "fp8" else dispatch
            # forward: counts (E int64), dispatch (the rows this rank routes), combine (the rows it computed)
            assert (fc, fb) == (3, 8 * E + sent * ROW[dispatch] + recv * ROW[combine]), (dispatch, case)
            # backward: the combine's gradient (dispatch-shaped), then the dispatch's (combine-shaped)
            assert (bc, bb) == (2, sent * ROW[grad] + recv * ROW[combine]), (dispatch, case)
    # fp8 actually loses precision on the wire, fp32 does not (the bounds above are not vacuous)
    fp8 = max(e["output"] for r in results for (d, _), e in r["errors"].items() if d == "fp8")
    fp32 = max(max(e.values()) for r in results for (d, _), e in r["errors"].items() if d == "fp32")
    assert fp8 > 1e-3 and fp32 <= 1e-6


# ----------------------------------------------------------------- a model, training and checkpoints
def _step(model, idx, y) -> torch.Tensor:
    loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach()


def _model_run(rank: int, world: int, ckpt: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from syncwise.models import build_model
    from syncwise.parallel.expert_parallel import apply_expert_parallel, expert_parameters, reduce_expert_gradients

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)

    def ep_step(m, opt, idx, y) -> float:
        """One data-parallel step of an EP model on this rank's half of the batch."""
        loss = _step(m, idx[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        experts = {id(p) for p in expert_parameters(m).values()}
        for p in m.parameters():                       # dense: averaged over the 2 data-parallel ranks
            if id(p) not in experts and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        reduce_expert_gradients(m, dp_size=world)     # experts: already summed by the dispatch; one replica
        opt.step()
        opt.zero_grad()
        m.update_router_bias(dist.all_reduce)
        dist.all_reduce(loss)
        return (loss / world).item()

    def ref_step(m, opt, idx, y) -> float:
        loss = _step(m, idx, y)
        opt.step()
        opt.zero_grad()
        m.update_router_bias()
        return loss.item()

    def weights_diff(m, ref) -> float:
        """max |m - ref| over every parameter, expert shards against their slice, and the selection biases."""
        refs = dict(ref.named_parameters())
        worst = 0.0
        for name, p in m.named_parameters():
            r = refs[name].detach()
            if hasattr(p, "to_local"):
                p, n = p.to_local(), p.to_local().shape[0]
                r = r[rank * n:(rank + 1) * n]
            worst = max(worst, (p.detach() - r).abs().max().item())
        for a, b in zip(m.moe_layers(), ref.moe_layers()):
            worst = max(worst, (a.expert_bias - b.expert_bias).abs().max().item())
        return worst

    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
               for _ in range(6)]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    model = build_model("tiny-moe", **{**MODEL, "bias_update_rate": 0.01})
    ref = copy.deepcopy(model)
    apply_expert_parallel(model, mesh, "fp32")
    out: dict = {"params": (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in ref.parameters()))}
    opt, ref_opt = sgd(model), sgd(ref)
    out["losses"] = [(ep_step(model, opt, *b), ref_step(ref, ref_opt, *b)) for b in batches[:4]]
    out["trained_diff"] = weights_diff(model, ref)
    out["bias_moved"] = max(m.expert_bias.abs().max().item() for m in ref.moe_layers())

    # ep2 → ep1: a fresh model without EP (other seed) resumes from the EP checkpoint, optimizer included.
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/ep2")
    torch.manual_seed(1)
    plain = build_model("tiny-moe", **{**MODEL, "bias_update_rate": 0.01})
    plain_opt = sgd(plain)
    psd, posd = get_state_dict(plain, plain_opt)
    dcp.load({"model": psd, "optim": posd}, checkpoint_id=f"{ckpt}/ep2")
    set_state_dict(plain, plain_opt, model_state_dict=psd, optim_state_dict=posd)
    out["ep1_loaded_diff"] = weights_diff(model, plain)

    # ep1 → ep2: the reference's checkpoint into a fresh EP model (other seed).
    rsd, rosd = get_state_dict(ref, ref_opt)
    dcp.save({"model": rsd, "optim": rosd}, checkpoint_id=f"{ckpt}/ep1")
    torch.manual_seed(2)
    fresh = apply_expert_parallel(build_model("tiny-moe", **{**MODEL, "bias_update_rate": 0.01}), mesh, "fp32")
    fresh_opt = sgd(fresh)
    fsd, fosd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": fsd, "optim": fosd}, checkpoint_id=f"{ckpt}/ep1")
    set_state_dict(fresh, fresh_opt, model_state_dict=fsd, optim_state_dict=fosd)
    out["ep2_loaded_diff"] = weights_diff(fresh, ref)
    # The momentum buffers came along: one more step from each resumed copy stays on the reference's path.
    b = batches[4]
    out["resumed"] = [ep_step(fresh, fresh_opt, *b), ep_step(model, opt, *b)]
    out["resumed_ref"] = [ref_step(plain, plain_opt, *b), ref_step(ref, ref_opt, *b)]
    out["resumed_diff"] = max(weights_diff(fresh, ref), weights_diff(plain, ref))

    # Activation checkpointing re-runs the MoE forward, all-to-alls included, inside backward: same gradients.
    from syncwise.parallel.activation_checkpoint import apply_activation_checkpointing
    ac = copy.deepcopy(fresh)
    apply_activation_checkpointing(ac)
    idx, y = batches[5]
    grads = []
    for m in (fresh, ac):
        m.zero_grad()
        _step(m, idx[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        grads.append([p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in m.parameters()])
    out["checkpointed_diff"] = max((a - b).abs().max().item() for a, b in zip(*grads))
    return out


def test_ep2_model_trains_like_one_process_and_reshards(tmp_path):
    for res in run_workers(_model_run, 2, str(tmp_path), timeout=120):
        assert res["params"][0] == res["params"][1]            # DTensor experts keep their global shape
        for ep_loss, ref_loss in res["losses"]:
            assert ep_loss == pytest.approx(ref_loss, abs=2e-6)
        assert res["bias_moved"] > 0                           # the bias update ran and agreed
        assert res["trained_diff"] < 1e-5
        assert res["ep1_loaded_diff"] == 0.0 and res["ep2_loaded_diff"] == 0.0   # exact copies after resharding
        assert res["resumed"] == pytest.approx(res["resumed_ref"], abs=2e-6)
        assert res["resumed_diff"] < 1e-5
        assert res["checkpointed_diff"] == 0.0


# ------------------------------------------------------------------------------ no processes needed
def test_checks_refuse_bad_values():
    check_expert_parallel(8, 4)
    check_expert_parallel(0, 1)
    with pytest.raises(ConfigError) as e:
        check_expert_parallel(6, 4)
    assert e.value.field == "parallel.ep" and "1, 2, 3, 6" in str(e.value)
    with pytest.raises(ConfigError):
        check_expert_parallel(0, 2)
    assert check_dispatch("fp8") == ("fp8", "bf16")
    assert check_dispatch("fp32") == ("fp32", "fp32")
    assert check_dispatch("fp8", "fp32") == ("fp8", "fp32")
    with pytest.raises(ConfigError) as e:
        check_dispatch("fp16")
    assert e.value.field == "parallel.ep_dispatch"
    with pytest.raises(ConfigError) as e:
        check_dispatch("bf16", "fp8")
    assert e.value.field == "parallel.ep_combine"


@pytest.mark.parametrize("d", [32, 128, 200])
def test_fp8_rows_codec(d):
    """Per-row 1×128 blocks: the payload splits by rows; each element within 1/28 of its block's maximum
    (e4m3's half-ulp at the top binade, 16 / 448), the row-wise relative error ~2.5 %."""
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(d)) * torch.logspace(-3, 3, 9)[:, None]
    payload = encode_fp8_rows(x)
    assert payload.dtype == torch.uint8 and payload.shape == (9, wire_row_bytes(d, "fp8"))
    assert wire_row_bytes(d, "fp8") < wire_row_bytes(d, "bf16") < wire_row_bytes(d, "fp32")
    back = decode_fp8_rows(payload, d, torch.float32)
    for b in range(0, d, 128):                          # per block of 128 along each row
        blk, got = x[:, b:b + 128], back[:, b:b + 128]
        assert ((got - blk).abs() <= blk.abs().amax(1, keepdim=True) / 28 * 1.0001).all()
    # Rows decode independently: a split of the payload decodes to the same rows.
    assert torch.equal(decode_fp8_rows(payload[3:5], d, torch.float32), back[3:5])
    assert torch.equal(decode_fp8_rows(encode_fp8_rows(x[:0]), d, torch.bfloat16), x[:0].bfloat16())
