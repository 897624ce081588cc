"""`syncwise train --model hf:FOLDER`: Hugging Face causal LMs trained by syncwise's own loop (issue 29, part 4).

Every run is checked against a plain loop written here: the same Hugging Face model built by transformers at the
same seed, the same batches, torch's AdamW and cross-entropy — no syncwise model, trainer or wrapper in it."""
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from syncwise.cli import main  # noqa: E402
from syncwise.data import TokenBatchLoader, load_corpus  # noqa: E402

SEED, LR, SEQ, BATCH, STEPS = 1337, 1e-3, 32, 4, 3  # 1337: train.seed's default
COMMON = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **COMMON),
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64),
}
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _folder(tmp_path, family, **changes):
    cfg = FAMILIES[family]()
    cfg.architectures = [ARCH[family]]
    for k, v in changes.items():
        setattr(cfg, k, v)
    folder = tmp_path / family
    cfg.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    g = torch.Generator().manual_seed(1)
    path.write_bytes(bytes(torch.randint(32, 127, (40_000,), generator=g).tolist()))
    return path


def _args(folder, corpus, run_dir, *extra):
    return ["train", "--model", f"hf:{folder}", "--steps", str(STEPS), "--run-dir", str(run_dir),
            f"--data.corpus={corpus}", f"--data.seq_len={SEQ}", f"--data.batch_size={BATCH}", "--train.val_batches=1",
            f"--train.lr={LR}", "--train.warmup_steps=0", "--train.min_lr_ratio=1", "--train.weight_decay=0",
            "--train.clip_grad=0", "--train.mixed_precision=none", "--data.prefetch=0", "--ckpt.interval=0",
            f"--train.seed={SEED}", "--data.val_fraction=0.05", *extra]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference(folder, corpus, ranks=1, steps=STEPS, pretrained=False, clip=0.0, norms=None):
    """The plain loop: transformers' model at the seed, each rank's batches, mean loss over ranks, AdamW (after
    torch's clip_grad_norm_ when ``clip``; the norms go to the list ``norms``)."""
    torch.manual_seed(SEED)
    if pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder),
                                                              dtype=torch.float32)
    model.train()
    # DeepSeek-V3's aux-loss-free balancing (paper §2.1.2, which transformers does not train): after each step,
    # e_score_correction_bias += 1e-3 * sign(mean load - load), the load counted from the router's own top-k
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    counts = {}

    def count(router, args, out):
        n = router.e_score_correction_bias.numel()
        counts[router] = counts.get(router, 0) + torch.bincount(out[2].reshape(-1), minlength=n)

    for router in routers:
        router.register_forward_hook(count)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    train = load_corpus(str(corpus), val_fraction=0.05).train
    loaders = [TokenBatchLoader(train, BATCH, SEQ, r, ranks, seed=SEED) for r in range(ranks)]
    losses = []
    for _ in range(steps):
        loss = sum(_plain_loss(model, x, y) for x, y in (next(it) for it in loaders)) / ranks
        opt.zero_grad()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        with torch.no_grad():
            for router in routers:
                load = counts.pop(router).float()
                router.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        losses.append(loss.item())
    return losses


def _plain_loss(model, x, y):
    """Cross-entropy, plus transformers' router load-balancing loss × router_aux_loss_coef when the config turns it
    on (what MixtralForCausalLM adds to its own loss given labels)."""
    out = model(input_ids=x)
    loss = F.cross_entropy(out.logits.reshape(-1, model.config.vocab_size), y.reshape(-1))
    if getattr(model.config, "output_router_logits", False):
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_like_a_plain_loop(family, corpus, tmp_path):
    folder = _folder(tmp_path, family)
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, "--nproc", "1")) == 0
    got, want = _losses(run_dir), _reference(folder, corpus)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (got, want)
    assert got[-1] < got[0]  # it learns


def test_mixtral_router_aux_loss_is_in_the_loss(corpus, tmp_path):
    """output_router_logits=True: the trained loss is cross-entropy + router_aux_loss_coef × transformers' own
    load-balancing loss, as MixtralForCausalLM computes it (and differs from the run without it)."""
    from syncwise.models.hf_model import build_hf_model, router_aux_coef

    folder = _folder(tmp_path, "mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    assert router_aux_coef(build_hf_model(f"hf:{folder}")) == 0.5
    assert router_aux_coef(build_hf_model(f"hf:{_folder(tmp_path / 'off', 'mixtral')}")) == 0.0
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, "--nproc", "1")) == 0
    got, want = _losses(run_dir), _reference(folder, corpus)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (got, want)
    plain = _reference(_folder(tmp_path / "off", "mixtral"), corpus)
    assert got[0] > plain[0] + 0.5 * 0.9  # the aux loss is about top_k = 2 at init (1 for a perfect balance)


def test_deepseek_v3_router_bias_is_balanced_during_training(tmp_path):
    """transformers never updates e_score_correction_bias; syncwise does, by its own MoE rule: after a training
    forward, update_router_bias moves each router's bias by 1e-3 toward balance (down for the over-loaded experts),
    from the counts of the router's own top-k; evaluation forwards are not counted; the counts reset."""
    from syncwise.models.hf_model import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(f"hf:{_folder(tmp_path, 'deepseek_v3')}")
    routers = model._routers
    assert len(routers) == 1  # first_k_dense_replace=1 of 2 layers
    model.eval()
    model(torch.randint(0, 320, (2, SEQ)))
    model.update_router_bias()
    assert torch.count_nonzero(routers[0].e_score_correction_bias) == 0  # nothing counted in eval
    model.train()
    seen = []
    routers[0].register_forward_hook(lambda m, a, out: seen.append(torch.bincount(out[2].reshape(-1), minlength=4)))
    model(torch.randint(0, 320, (2, SEQ))).sum().backward()
    load = seen[0].float()
    model.update_router_bias()
    assert torch.equal(routers[0].e_score_correction_bias, 1e-3 * torch.sign(load.mean() - load))
    assert int(routers[0]._syncwise_counts.sum()) == 0
    assert "hf.model.layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()  # saved in checkpoints


def test_weights_are_loaded_from_safetensors(corpus, tmp_path):
    torch.manual_seed(123)  # not the run's seed: a random init at SEED would give other losses
    folder = tmp_path / "saved"
    saved = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"]())
    saved.save_pretrained(folder)
    assert list(folder.glob("*.safetensors"))
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, "--nproc", "1")) == 0
    got = _losses(run_dir)
    x, y = next(TokenBatchLoader(load_corpus(str(corpus), val_fraction=0.05).train, BATCH, SEQ, seed=SEED))
    with torch.no_grad():
        first = F.cross_entropy(saved(input_ids=x).logits.reshape(-1, 320), y.reshape(-1)).item()
    assert got[0] == pytest.approx(first, rel=1e-5)
    assert got == pytest.approx(_reference(folder, corpus, pretrained=True), rel=1e-5, abs=1e-5)
    torch.manual_seed(SEED)
    assert got[0] != pytest.approx(_reference(_folder(tmp_path, "llama"), corpus, steps=1)[0], rel=1e-3)


@pytest.mark.parametrize("family, extra, exact", [
    # DDP, gradients compressed by syncwise's hook (~25 s on 2 shared cores: slow)
    pytest.param("llama", ["--compress", "fp8"], False, marks=pytest.mark.slow),
    ("llama", ["--parallel.dp_shard=2"], True),        # FSDP2: one unit per decoder layer, then the root
    # DeepSeek-V3's router bias balanced from both ranks' counts (one all-reduce a step), as the plain loop does
    ("deepseek_v3", ["--parallel.dp_shard=2"], True),
])
def test_two_ranks_data_parallel(family, extra, exact, corpus, tmp_path):
    folder = _folder(tmp_path, family)
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, "--nproc", "2", *extra)) == 0
    got, want = _losses(run_dir), _reference(folder, corpus, ranks=2)
    assert got[0] == pytest.approx(want[0], rel=1e-5)  # the same model on both ranks, mean of their batches
    assert got == pytest.approx(want, rel=1e-5 if exact else 2e-3, abs=1e-5 if exact else 1e-3), (got, want)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert ("FSDP2" in summary["layout"]) == exact, summary["layout"]


@pytest.mark.slow  # ~20 s on 2 shared cores
def test_tensor_parallel_through_the_models_own_plan(corpus, tmp_path):
    """tp 2 with transformers' base_model_tp_plan: both tp ranks read the same batch, so the losses are the plain
    single-process loop's; the Linear layers really are split (tp bytes are counted)."""
    folder = _folder(tmp_path, "qwen2")
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, "--nproc", "2", "--parallel.tp=2")) == 0
    got, want = _losses(run_dir), _reference(folder, corpus)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (got, want)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["comm_bytes_tp"] > 0 for r in rows[:2])
    assert json.loads((run_dir / "summary.json").read_text())["layout"].startswith("tp 2")


@pytest.mark.slow  # 4 ranks: ~1 min each on 2 shared cores
@pytest.mark.parametrize("extra, dp", [
    (["--parallel.tp=2", "--parallel.dp_shard=2"], 2),         # FSDP2 over the TP plan's DTensors
    (["--parallel.tp=2", "--parallel.dp_replicate=2"], 2),     # DDP over them
    (["--parallel.dp_replicate=2", "--parallel.dp_shard=2"], 4),  # HSDP
])
def test_four_ranks_match_the_plain_loop_with_clipping(extra, dp, corpus, tmp_path):
    """tp × dp and HSDP of a Hugging Face model: the losses and the gradient norm that clipping uses (clipping at 0.3
    is active: the norms are above it) are the plain loop's on the global batch."""
    folder = _folder(tmp_path, "llama")
    run_dir = tmp_path / "run"
    args = _args(folder, corpus, run_dir, "--nproc", "4", *extra)
    args[args.index("--train.clip_grad=0")] = "--train.clip_grad=0.3"
    assert main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    norms = []
    want = _reference(folder, corpus, ranks=dp, clip=0.3, norms=norms)
    assert [r["loss"] for r in rows] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-5), (rows, norms)
    assert min(norms) > 0.3


def test_the_tp_plan_is_transformers_own(tmp_path):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from syncwise.models.hf_model import build_hf_model, hf_tp_plan

    model = build_hf_model(f"hf:{_folder(tmp_path, 'llama')}")
    plan = hf_tp_plan(model)
    assert isinstance(plan["hf.model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["hf.model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert len(plan) == len(model.hf.config.base_model_tp_plan)
    assert all(model.get_submodule(k.replace("*", "0")) is not None for k in plan)  # the names resolve


def test_fsdp_units_are_the_decoder_layers(tmp_path):
    from syncwise.models.hf_model import build_hf_model
    from syncwise.parallel.activation_checkpoint import apply_activation_checkpointing
    from syncwise.parallel.fsdp import fsdp_units

    model = build_hf_model(f"hf:{_folder(tmp_path, 'mixtral')}")
    assert fsdp_units(model) == list(model.hf.model.layers) and len(fsdp_units(model)) == 2
    assert apply_activation_checkpointing(model) == 2
    x = torch.randint(0, 256, (2, SEQ))
    model(x).sum().backward()  # the checkpointed blocks recompute in backward
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("make, extra, field, words", [
    (lambda t: _gpt2(t), [], "model.preset", ["GPT2LMHeadModel", *ARCH.values()]),
    (lambda t: t / "nothing-here", [], "model.preset", ["config.json"]),
    (lambda t: _folder(t, "qwen3"), ["--nproc", "2", "--parallel.tp=2"], "parallel.tp",
     ["LlamaForCausalLM, Qwen2ForCausalLM", "base_model_tp_plan"]),
    (lambda t: _folder(t, "llama", num_key_value_heads=1), ["--nproc", "2", "--parallel.tp=2"], "parallel.tp",
     ["num_key_value_heads (1)"]),
    (lambda t: _folder(t, "llama"), ["--nproc", "2", "--parallel.pp=2"], "parallel.pp", ["pipeline parallel"]),
    (lambda t: _folder(t, "mixtral"), ["--nproc", "2", "--parallel.ep=2"], "parallel.ep", ["expert parallel"]),
    (lambda t: _folder(t, "llama", vocab_size=200), [], "model.preset", ["vocab_size 200", "256"]),
    (lambda t: _folder(t, "llama", max_position_embeddings=16), [], "data.seq_len", ["max_position_embeddings (16"]),
    (lambda t: _folder(t, "llama"), ["--model.attention=mla"], "model.attention", ["config.json"]),
    (lambda t: _raw(t, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320}), [],
     "model.preset", ["hidden_size"]),                                            # the planner needs the shape
    (lambda t: _raw(t, {"architectures": ["MixtralForCausalLM"], "model_type": "llama", "vocab_size": 320}), [],
     "model.preset", ["'mixtral'"]),
])
def test_refused_before_any_worker_in_one_line(make, extra, field, words, corpus, tmp_path, capsys):
    folder = make(tmp_path)
    run_dir = tmp_path / "run"
    assert main(_args(folder, corpus, run_dir, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{field}'" in err and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert not run_dir.exists()


def _raw(tmp_path, values):
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def _gpt2(tmp_path):
    folder = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4, architectures=["GPT2LMHeadModel"]
                            ).save_pretrained(folder)
    return folder


def test_the_planner_describes_the_model_for_the_memory_check(tmp_path):
    from syncwise.config import hf_model_spec
    from syncwise.models.hf import hf_train_memory_bytes, read_hf_model

    info = read_hf_model(f"hf:{_folder(tmp_path, 'qwen3')}")
    spec = hf_model_spec(info, SEQ)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3"]())
    counted = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    assert spec.param_counts()[0] == pytest.approx(counted, rel=0.02)  # the q/k norms aside
    assert hf_train_memory_bytes(spec, BATCH) > 16 * counted


def test_a_run_resumes_from_its_checkpoint(corpus, tmp_path):
    """The wrapper's parameters go through syncwise's DCP checkpoint: 2 steps + resume = 3 steps straight."""
    folder = _folder(tmp_path, "qwen2")
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    assert main(_args(folder, corpus, straight, "--nproc", "1")) == 0
    first = _args(folder, corpus, parts, "--nproc", "1")
    first[first.index("--steps") + 1] = "2"
    assert main(first) == 0
    assert main(_args(folder, corpus, parts, "--nproc", "1", "--resume", "auto")) == 0
    assert _losses(parts)[-1] == pytest.approx(_losses(straight)[-1], rel=1e-6)


def test_preset_and_model_flags_together_are_refused(capsys):
    assert main(["train", "--check", "--preset", "tiny", "--model", "hf:/somewhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'--model'" in err and "not both" in err, err


def test_bench_baseline_counts_the_hf_models_parameters(corpus, tmp_path):
    """`syncwise bench --preset hf:DIR`'s fp32 baseline: every parameter of the Hugging Face model, 4 bytes each."""
    from syncwise.commands.bench import _fp32_bytes
    from syncwise.config import build_config

    folder = _folder(tmp_path, "mixtral")
    cfg = build_config(None, {"model.preset": f"hf:{folder}", "data.seq_len": "32", "data.corpus": str(corpus)})
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["mixtral"]())
    assert _fp32_bytes(cfg) == 4.0 * sum(p.numel() for p in model.parameters())


def _sharded_build(rank, world, folder):
    """build_hf_model(sharded=True), FSDP2 over both ranks, one forward: what each rank held and the loss."""
    from syncwise.models.deepseek import lm_loss
    from syncwise.models.hf_model import build_hf_model
    from syncwise.parallel.fsdp import apply_fsdp

    torch.manual_seed(SEED)
    model = build_hf_model(f"hf:{folder}", sharded=True)
    held = {"real_before": sum(t.numel() for t in (*model.parameters(), *model.buffers()) if not t.is_meta),
            "whole_kept": model._full_on_rank0 is not None, "rng": float(torch.rand(()))}
    model.to(torch.device("cpu"))  # (as the trainer does before parallelizing: the model waits on the meta device)
    held["meta_after_to"] = all(p.is_meta for p in model.parameters())
    apply_fsdp(model, None)
    held["local"] = sum(p.to_local().numel() for p in model.parameters())
    held["total"] = sum(p.numel() for p in model.parameters())
    held["whole_kept_after"] = model._full_on_rank0 is not None
    x = torch.randint(0, COMMON["vocab_size"], (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    held["loss"] = float(lm_loss(model(x[:, :-1]), x[:, 1:]).detach())
    return held


@pytest.mark.parametrize("pretrained", [False, True])
def test_sharded_build_materialises_per_shard_and_computes_the_same_loss(pretrained, tmp_path):
    """FSDP2 over 2 gloo ranks of a model built on the meta device (build_hf_model(sharded=True)): rank 1 never holds
    a real tensor of the model before its shards, rank 0 only its one load (the folder's weights, or the RNG's at the
    seed); each rank ends with its shards only, and the loss is the single-process model's. Tolerance: the same fp32
    weights through the same kernels, only gathered by FSDP2 into other buffers: a few fp32 ulps at most (2e-7
    relative each) where a matmul blocks its sums differently."""
    from distributed import run_workers
    from syncwise.models.deepseek import lm_loss
    from syncwise.models.hf_model import build_hf_model

    folder = _folder(tmp_path, "llama")
    if pretrained:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).save_pretrained(
            folder)
    torch.manual_seed(SEED)
    whole = build_hf_model(f"hf:{folder}")
    rng_after_build = float(torch.rand(()))
    x = torch.randint(0, COMMON["vocab_size"], (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    want = float(lm_loss(whole(x[:, :-1]), x[:, 1:]).detach())
    ranks = run_workers(_sharded_build, 2, folder)
    assert ranks[0]["whole_kept"] and not ranks[1]["whole_kept"]  # rank 0's one load, until its shards are filled
    assert ranks[1]["real_before"] == 0                            # rank 1: the structure only, on the meta device
    assert all(r["meta_after_to"] and not r["whole_kept_after"] for r in ranks)
    assert sum(r["local"] for r in ranks) == ranks[0]["total"] == sum(p.numel() for p in whole.parameters())
    assert all(r["local"] < r["total"] for r in ranks)             # each rank: its shards, not the whole model
    assert ranks[0]["rng"] == ranks[1]["rng"]                      # every rank's RNG stream alike after the build
    assert not pretrained or ranks[0]["rng"] == rng_after_build    # (from weights: no draw at all)
    for r in ranks:
        assert r["loss"] == pytest.approx(want, rel=1e-6), (r["loss"], want)
