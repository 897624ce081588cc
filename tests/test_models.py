"""syncwise.models: shapes, causality, presets, MoE routing and bias balancing, MLA, learning, FLOPs."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from syncwise.errors import ConfigError, SyncwiseError
from syncwise.models import (PRESETS, MoE, build_model, count_params, flops_per_token, param_counts,
                             resolve_config, rope_tables)

torch.set_num_threads(1)

VARIANTS = [("tiny", {}), ("tiny-moe", {}), ("tiny", {"attention": "mla"}),
            ("tiny-moe", {"attention": "mla", "q_lora_rank": 32})]


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_logits_shape_and_finite(name, kw):
    torch.manual_seed(0)
    m = build_model(name, **kw)
    idx = torch.randint(0, 256, (3, 17))
    out = m(idx)
    assert out.shape == (3, 17, 256)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_changing_a_future_token_leaves_earlier_logits_unchanged(name, kw):
    torch.manual_seed(0)
    m = build_model(name, **kw).eval()
    idx = torch.randint(0, 256, (2, 24))
    idx2 = idx.clone()
    idx2[:, 10] = (idx[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = m(idx), m(idx2)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-5)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3   # the change is visible from position 10 on


def test_presets_param_counts_in_range_and_match_the_built_model():
    ranges = {"tiny": (0, 1e6), "tiny-moe": (0, 1e6), "small": (4e6, 6.5e6), "small-dense": (4e6, 6.5e6),
              "medium": (20e6, 30e6), "medium-dense": (20e6, 30e6), "large": (80e6, 120e6),
              "xl-dense": (300e6, 320e6), "xl": (800e6, 950e6)}
    assert set(ranges) == set(PRESETS)
    for name, (lo, hi) in ranges.items():
        total, active = param_counts(PRESETS[name])
        assert lo <= total < hi, (name, total)
        if PRESETS[name].is_moe:
            assert active < 0.75 * total, name
        else:
            assert active == total
    for name in ("tiny", "tiny-moe", "small"):   # the analytic count is exact (large is too slow to build)
        assert count_params(build_model(name)) == param_counts(PRESETS[name])[0]
    for name in ("xl-dense", "xl"):   # the GPU presets, built without memory on the meta device
        with torch.device("meta"):
            assert count_params(build_model(name)) == param_counts(PRESETS[name])[0]
    assert param_counts(PRESETS["xl-dense"])[0] >= 300e6
    assert build_model("tiny-moe").has_sparse_params is False


def test_tied_embeddings_share_one_matrix():
    m = build_model("tiny", tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert count_params(m) == param_counts(m.config)[0] == count_params(build_model("tiny")) - 256 * 64


def test_bad_config_raises_config_error_naming_the_field():
    with pytest.raises(ConfigError) as e:
        build_model("huge")
    assert e.value.field == "model.preset" and "tiny-moe" in e.value.accepted
    with pytest.raises(ConfigError) as e:
        build_model("tiny-moe", top_k=9)
    assert e.value.field == "model.top_k"
    with pytest.raises(ConfigError) as e:
        build_model("tiny", attention="gqa")
    assert e.value.field == "model.attention"
    with pytest.raises(ConfigError) as e:
        build_model("tiny", d_modle=32)
    assert e.value.field == "model.d_modle"
    with pytest.raises(SyncwiseError):
        build_model("tiny")(torch.zeros(1, 65, dtype=torch.long))   # tiny's seq_len is 64


def _moe(**kw):
    torch.manual_seed(0)
    return MoE(resolve_config("tiny-moe", **kw))


def test_routing_picks_exactly_k_distinct_experts_and_gates_sum_to_one():
    moe = _moe(n_routed_experts=8, top_k=3)
    x = torch.randn(50, 64)
    moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    r = moe.route(x)
    assert r.indices.shape == (50, 3)
    assert all(len(set(row.tolist())) == 3 for row in r.indices)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(50))
    # Gate weights come from the unbiased affinities; the bias only changes the selection.
    expected = r.scores.gather(-1, r.indices)
    torch.testing.assert_close(r.weights, expected / expected.sum(-1, keepdim=True))
    assert torch.equal(r.indices.sort(-1).values,
                       torch.topk(r.scores + moe.expert_bias, 3, dim=-1).indices.sort(-1).values)


def test_moe_forward_matches_per_token_reference():
    moe = _moe().eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        out = moe(x)
        flat = x.reshape(-1, 64)
        r = moe.route(flat)
        ex = moe.experts
        ref = moe.shared(flat).clone()
        for n in range(flat.shape[0]):
            for e, w in zip(r.indices[n].tolist(), r.weights[n]):
                h = F.silu(flat[n] @ ex.w1[e]) * (flat[n] @ ex.w3[e])
                ref[n] += w * (h @ ex.w2[e])
    torch.testing.assert_close(out.reshape(-1, 64), ref, rtol=1e-4, atol=1e-5)


def test_experts_without_tokens_still_get_gradients():
    # Why has_sparse_params is False: stacked expert weights always receive a gradient tensor.
    moe = _moe()
    moe.expert_bias[:2] = 10.0          # every token picks experts 0 and 1 only
    moe(torch.randn(20, 64)).sum().backward()
    assert moe.tokens_per_expert[2:].sum() == 0
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
    assert moe.experts.w1.grad[2:].abs().sum() == 0 and moe.experts.w1.grad[:2].abs().sum() > 0


def test_bias_balancing_moves_a_skewed_router_toward_uniform_load():
    moe = _moe(n_routed_experts=8, top_k=2, bias_update_rate=0.02)
    torch.manual_seed(1)
    mu = torch.randn(64)
    x = torch.randn(256, 64) * 0.5 + mu
    with torch.no_grad():   # experts 0 and 1 align with the common input direction: all tokens want them
        moe.router.weight[:2] = mu / mu.norm() * 0.3

    def imbalance():
        load = moe.tokens_per_expert.float()
        return (load.max() / load.mean()).item()

    imbalances = []
    for _ in range(60):
        moe(x)
        imbalances.append(imbalance())
        assert moe.tokens_per_expert.sum() == 256 * 2
        moe.update_bias()
        assert moe.tokens_per_expert.sum() == 0
    assert imbalances[0] > 3.5                       # ~all tokens on experts 0 and 1 (max 4.0)
    # A sign update settles into a small limit cycle around balance, not an exact fixed point.
    assert sum(imbalances[-10:]) / 10 < 1.7 and max(imbalances[-10:]) < 2.0
    assert moe.expert_bias[:2].max() < moe.expert_bias[2:].min()   # over-loaded experts pushed down


def test_model_update_router_bias_uses_reduced_counts_and_resets():
    torch.manual_seed(0)
    m = build_model("tiny-moe", n_layers=3, n_dense_layers=1, bias_update_rate=0.1)
    moes = list(m.moe_layers())
    assert len(moes) == 2
    idx = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        m.eval()(idx)
    assert all(x.tokens_per_expert.sum() == 0 for x in moes)   # eval / no-grad forwards do not count
    m.train()
    m(idx)
    m(idx)                                                       # two micro-batches accumulate
    local = [x.tokens_per_expert.clone() for x in moes]
    assert all(c.sum() == 2 * 4 * 32 * 2 for c in local)
    seen = []

    def fake_allreduce(t):  # stands in for a 2-rank all-reduce of identical counts
        seen.append(t.shape)
        t.mul_(2)

    m.update_router_bias(fake_allreduce)
    assert seen == [torch.Size([2, 8])]                          # one collective for all layers
    for x, c in zip(moes, local):
        c = c.float()
        torch.testing.assert_close(x.expert_bias, 0.1 * torch.sign(c.mean() - c))
        assert x.tokens_per_expert.sum() == 0
    loads = m.router_load()
    assert sorted(loads) == [1, 2]
    for layer_id, c in zip((1, 2), local):
        torch.testing.assert_close(loads[layer_id], c.float() / c.sum())


def test_activation_checkpoint_recompute_is_not_counted_twice():
    torch.manual_seed(0)
    m = build_model("tiny-moe").train()
    block = m.layers["1"]
    h = torch.randn(2, 16, 64, requires_grad=True)
    cos, sin = rope_tables(16, 16, 1e4)
    checkpoint(block, h, cos, sin, use_reentrant=False).sum().backward()
    assert block.ffn.tokens_per_expert.sum() == 2 * 16 * 2


def test_bf16_autocast_forward_runs():
    torch.manual_seed(0)
    m = build_model("tiny-moe", attention="mla")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randint(0, 256, (2, 16)))
    assert out.shape == (2, 16, 256) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name,kw", [("tiny", {}), ("tiny-moe", {"attention": "mla"})])
def test_a_few_optimizer_steps_reduce_loss_on_repeated_data(name, kw):
    torch.manual_seed(0)
    m = build_model(name, **kw).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 33))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        m.update_router_bias()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.3   # sane init: ~uniform logits
    assert losses[-1] < 0.6 * losses[0]


def test_flops_per_token_is_six_n_active_plus_attention():
    cfg = PRESETS["small"]
    _, active = param_counts(cfg)
    n = active - cfg.vocab_size * cfg.d_model                  # embedding lookup is not a matmul
    attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.seq_len
    assert flops_per_token(cfg) == 6 * n + attn
    assert flops_per_token("small") == flops_per_token(cfg)
    assert 1.0 < flops_per_token(cfg) / (6 * active) < 1.2
    # MoE: per-token cost follows active, not total, parameters.
    assert flops_per_token(cfg) < 0.6 * 6 * param_counts(cfg)[0]
    assert flops_per_token(cfg, seq_len=256) - flops_per_token(cfg) == attn
    # Top-k scaling: one more routed expert per token adds its 6 * 3 * d * moe_hidden per MoE layer.
    more = resolve_config(cfg, top_k=3)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    assert flops_per_token(more) - flops_per_token(cfg) == 6 * 3 * cfg.d_model * cfg.moe_hidden * n_moe
