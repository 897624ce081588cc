"""Pipeline parallel (syncwise.parallel.pipeline) on real gloo groups of 2 processes.

Every schedule torch 2.13 ships runs here at pp=2 (gpipe and 1f1b with one stage per rank; interleaved-1f1b,
looped-bfs and interleaved-zb with two, looped; zbv and dualpipev with two in a V), with and without overlapped
communication: the losses of 3 optimizer steps and every gradient equal one process running the whole model on
the same batch from the same initialisation.

Tolerance (fp32): losses within 1e-6 relative, gradients within atol 1e-6 + rtol 1e-5. Measured (tiny dense
model, 4 layers, d_model 32, batch 8 × 16 tokens, 4 microbatches, SGD): losses 8.6e-8 relative, gradients
1.5e-8 absolute — the microbatch split only reorders sums. MoE (AdamW, router bias updated every step): the same
loss bound holds (measured 8.6e-8); gradients match at 1.7e-8 on the first step and, once AdamW has moved the
parameters, at 1.8e-6 (bound 1e-5, see ADAMW_GRAD_ATOL); router token counts are equal.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_workers
from syncwise.errors import ConfigError
from syncwise.models import build_model
from syncwise.models.config import resolve_config
from syncwise.models.deepseek import flops_per_token
from syncwise.parallel import pipeline
from syncwise.parallel.pipeline import (SCHEDULE_SPECS, AsyncPipeline, build_stage_modules, check_pipeline,
                                        layer_flops, merge_stage_modules, split_layers,
                                        stage_ids_for_rank)
from syncwise.train.trainer import lm_loss

LOSS_RTOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5
# After AdamW steps: Adam divides by sqrt(v), so an element whose gradient differs at rounding level moves by up to
# lr; the next gradients then differ by ~1e-6 (measured 1.8e-6 at the third step, MoE) while losses stay at 1e-7.
ADAMW_GRAD_ATOL = 1e-5
STEPS, ROWS, SEQ, M = 3, 8, 16, 4
DENSE = dict(n_layers=4, d_model=32, seq_len=SEQ)
MOE = dict(n_layers=4, d_model=32, seq_len=SEQ, n_dense_layers=1)
# (schedule, stages per rank) for every schedule; the V schedules hold stages r and 3 − r on rank r.
ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2), ("interleaved-zb", 2), ("zbv", 2),
       ("dualpipev", 2)]


# ------------------------------------------------------------------------------------------------ pure checks
def test_schedules_listed_with_their_shapes():
    assert set(pipeline.SCHEDULES) == set(SCHEDULE_SPECS)  # torch 2.13 ships all seven
    assert {n for n, s in SCHEDULE_SPECS.items() if not s.multi_stage} == {"gpipe", "1f1b"}
    assert {n for n, s in SCHEDULE_SPECS.items() if s.v_shape} == {"zbv", "dualpipev"}
    assert stage_ids_for_rank(0, 2, 2, "zbv") == [0, 3] and stage_ids_for_rank(1, 2, 2, "dualpipev") == [1, 2]
    assert stage_ids_for_rank(1, 2, 2, "interleaved-1f1b") == [1, 3] and stage_ids_for_rank(1, 4, 1, "1f1b") == [1]


@pytest.mark.parametrize("args, field, says", [
    ((4, 2, "pipedream", 4, 1), "parallel.pp_schedule", "1f1b"),
    ((4, 5, "gpipe", 8, 1), "parallel.pp", "4 layers"),
    ((4, 2, "interleaved-1f1b", 8, 3), "parallel.stages_per_rank", "6 stages"),
    ((4, 2, "1f1b", 1, 1), "parallel.microbatches", "at least pp"),
    ((8, 4, "1f1b", 3, 1), "parallel.microbatches", "at least pp"),
    ((8, 2, "dualpipev", 3, 2), "parallel.microbatches", "2 × pp"),
    ((8, 2, "interleaved-1f1b", 5, 2), "parallel.microbatches", "rounds"),
    ((8, 2, "interleaved-zb", 7, 2), "parallel.microbatches", "rounds"),
    ((8, 2, "1f1b", 4, 2), "parallel.stages_per_rank", "single-stage"),
    ((8, 2, "interleaved-1f1b", 4, 1), "parallel.stages_per_rank", "≥ 2"),
    ((8, 2, "zbv", 4, 3), "parallel.stages_per_rank", "exactly 2"),
    ((8, 0, "1f1b", 4, 1), "parallel.pp", "≥ 1"),
    ((8, 2, "1f1b", 0, 1), "parallel.microbatches", "≥ 1"),
])
def test_check_pipeline_refuses(args, field, says):
    with pytest.raises(ConfigError) as e:
        check_pipeline(*args)
    assert e.value.field == field and says in e.value.accepted


def test_check_pipeline_accepts():
    for name, spr in ALL:
        assert check_pipeline(8, 2, name, 4, spr, backend="gloo").name == name
    check_pipeline(8, 2, "zbv", 1, 2)                  # the V schedules run one microbatch (checked on gloo)
    check_pipeline(8, 4, "interleaved-1f1b", 3, 2)     # one round of 3 < pp: torch runs it
    check_pipeline(4, 1, "1f1b", 1, 1)                 # pp=1: nothing is pipelined


def test_check_pipeline_refuses_what_torch_or_the_backend_cannot_run(monkeypatch):
    shipped = pipeline.torch_schedules()
    monkeypatch.setattr(pipeline, "torch_schedules", lambda: {k: v for k, v in shipped.items() if k != "dualpipev"})
    with pytest.raises(ConfigError, match="not available in this torch version") as e:
        check_pipeline(8, 2, "dualpipev", 4, 2)
    assert e.value.field == "parallel.pp_schedule"
    monkeypatch.undo()
    spec = SCHEDULE_SPECS["zbv"]
    monkeypatch.setitem(SCHEDULE_SPECS, "zbv", pipeline.ScheduleSpec(
        spec.name, spec.torch_name, spec.stages_per_rank, spec.microbatches, refused=(("gloo", "hangs"),)))
    with pytest.raises(ConfigError, match="runs on gloo: hangs") as e:
        check_pipeline(8, 2, "zbv", 4, 2, backend="gloo")
    assert e.value.field == "parallel.pp_schedule"
    check_pipeline(8, 2, "zbv", 4, 2, backend="nccl")


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "small", "medium", "xl"])
def test_layer_flops_are_the_models_own(preset):
    cfg = resolve_config(preset)
    per_layer, head = layer_flops(cfg)
    assert sum(per_layer) + head == round(flops_per_token(cfg))
    if cfg.is_moe:  # dense and MoE blocks cost differently
        assert per_layer[0] != per_layer[-1]


def _best_max(costs, n, head):
    """Brute force: the smallest possible largest stage cost over every contiguous split."""
    import itertools
    L, best = len(costs), None
    for cuts in itertools.combinations(range(1, L), n - 1):
        bounds = (0, *cuts, L)
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[-1] += head
        best = max(stage) if best is None else min(best, max(stage))
    return best


@pytest.mark.parametrize("preset, overrides, n", [("small", {}, 2), ("small", {}, 3), ("medium", {}, 3),
                                                  ("medium", {}, 4), ("large", {}, 4), ("xl", {}, 5),
                                                  ("tiny", {"n_layers": 4}, 4)])
def test_split_layers_is_contiguous_balanced_and_deterministic(preset, overrides, n):
    cfg = resolve_config(preset, **overrides)
    ranges = split_layers(cfg, n)
    assert ranges == split_layers(cfg, n)
    assert [i for r in ranges for i in r] == list(range(cfg.n_layers)) and all(ranges)
    per_layer, head = layer_flops(cfg)
    stage = [sum(per_layer[i] for i in r) for r in ranges]
    stage[-1] += head
    assert max(stage) == _best_max(per_layer, n, head)
    with pytest.raises(ConfigError):
        split_layers(cfg, cfg.n_layers + 1)


def test_stage_modules_keep_the_full_models_names_and_parameters():
    torch.manual_seed(0)
    model = build_model("tiny-moe", **MOE)
    full = dict(model.named_parameters())
    stages = build_stage_modules(model, 4, range(4))
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(full) and len(names) == len(set(names))   # a partition, same names
    assert all(p is full[n] for s in stages for n, p in s.named_parameters())  # shared, not copied
    assert [list(s.layers) for s in stages] == [["0"], ["1"], ["2"], ["3"]]
    assert stages[0].tok_embeddings is not None and stages[-1].output is not None
    assert all(s.tok_embeddings is None for s in stages[1:]) and all(s.output is None for s in stages[:-1])
    assert list(model.layers) == ["0", "1", "2", "3"] and model.output is not None   # the model is left whole
    # The stages chained are the model.
    x = torch.randint(0, 256, (2, SEQ))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    # A rank's two stages (a V: stages 0 and 3) as one module for checkpoints and optimizers: the same names.
    merged = merge_stage_modules([stages[0], stages[3]])
    assert dict(merged.named_parameters()) == {n: p for i in (0, 3) for n, p in stages[i].named_parameters()}
    assert set(merged.state_dict()) == set(stages[0].state_dict()) | set(stages[3].state_dict())
    assert merge_stage_modules([stages[1]]) is stages[1] and list(stages[0].layers) == ["0"]
    with pytest.raises(ConfigError) as e:
        build_stage_modules(build_model("tiny", tie_embeddings=True), 2, [0])
    assert e.value.field == "model.tie_embeddings"


def test_user_models_split_by_sequential_or_a_split_plan():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    stages = build_stage_modules(seq, 2, [0, 1])
    assert sorted(n for s in stages for n, _ in s.named_parameters()) == sorted(n for n, _ in seq.named_parameters())
    x = torch.randn(3, 8)
    torch.testing.assert_close(stages[1](stages[0](x)), seq(x), rtol=0, atol=0)

    calls = []

    def plan(model, stage_index, n_stages):
        calls.append((stage_index, n_stages))
        return model[stage_index]

    assert build_stage_modules(seq, 4, [1, 3], split_fn=plan) == [seq[1], seq[3]] and calls == [(1, 4), (3, 4)]
    with pytest.raises(ConfigError, match="split_fn"):
        build_stage_modules(nn.Linear(2, 2), 2, [0])


# ------------------------------------------------------------------------------------------------ on gloo
def _batches(steps=STEPS, rows=ROWS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (rows, SEQ), generator=g), torch.randint(0, 256, (rows, SEQ), generator=g))
            for _ in range(steps)]


def _np(t):
    return t.detach().numpy().copy()


def _run_case(rank, world, preset, overrides, schedule, spr, overlap, optim, update_bias=False):
    """One pipelined run and its single-process reference (same seed, same batches) on this rank: per step the
    pipeline's loss, the reference's, and the largest gradient difference (over this rank's parameters)."""
    torch.manual_seed(0)
    model = build_model(preset, **overrides)
    ref = copy.deepcopy(model)
    ids = stage_ids_for_rank(rank, world, spr, schedule)
    pipe = AsyncPipeline(build_stage_modules(model, world * spr, ids), microbatches=M,
                         overlap_communication=overlap, schedule=schedule)
    del model  # the stages share its parameters; the full model must not be stepped or saved
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optim == "sgd" else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt, ref_opt = make(pipe.module.parameters()), make(ref.parameters())   # this rank's stages, full names
    ref_params = dict(ref.named_parameters())
    out = {"names": [n for n, _ in pipe.named_parameters()], "steps": [], "optim": optim}
    for x, y in _batches():
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        grads = {n: (_np(p.grad), _np(ref_params[n].grad)) for n, p in pipe.named_parameters()}
        counts = None
        if update_bias:  # each stage balances its own MoE layers; router counts are compared before the update
            mine = {b.layer_id: _np(b.ffn.tokens_per_expert) for m in pipe.stage_modules for b in m.layers.values()
                    if b.moe}
            counts = {i: (c, _np(ref.layers[str(i)].ffn.tokens_per_expert)) for i, c in mine.items()}
            pipe.module.update_router_bias()
            ref.update_router_bias()
        out["steps"].append({"loss": float(loss), "ref": float(ref_loss.detach()), "grads": grads, "counts": counts,
                             "bubble": pipe.last_bubble, "bytes": pipe.last_p2p_bytes})
        opt.step()
        ref_opt.step()
    return out


def _check_case(results, spr, schedule, full_names):
    assert sorted(results[0]["names"] + results[1]["names"]) == full_names, schedule   # the stages partition it
    for step in range(STEPS):
        rows = [r["steps"][step] for r in results]
        assert rows[0]["loss"] == rows[1]["loss"]                       # broadcast to every pp rank
        assert abs(rows[0]["loss"] - rows[0]["ref"]) <= LOSS_RTOL * abs(rows[0]["ref"]), (schedule, step, rows[0])
        atol = ADAMW_GRAD_ATOL if results[0]["optim"] == "adamw" and step > 0 else GRAD_ATOL
        for row in rows:
            for name, (got, want) in row["grads"].items():
                np.testing.assert_allclose(got, want, atol=atol, rtol=GRAD_RTOL, err_msg=f"{schedule} {name} {step}")
            if row["counts"] is not None:
                for layer, (got, want) in row["counts"].items():
                    np.testing.assert_array_equal(got, want, err_msg=f"{schedule} router counts, layer {layer}")
            assert 0.0 <= row["bubble"] < 1.0
        # Bytes, counted from the sends: each stage boundary between two ranks carries, per microbatch, one
        # activation forward and one input gradient backward of ROWS / M × SEQ × d_model fp32. At pp=2 such
        # boundaries: 1 (one stage per rank), 3 (4 stages looped over 2 ranks), 2 (a V: stages 1 and 2 share a rank).
        boundaries = 2 if schedule in ("zbv", "dualpipev") else 2 * spr - 1
        assert sum(row["bytes"] for row in rows) == boundaries * 2 * M * (ROWS // M) * SEQ * 32 * 4


def _full_names(preset, overrides):
    return sorted(n for n, _ in build_model(preset, **overrides).named_parameters())


def _dense_worker(rank, world, overlap):
    return [_run_case(rank, world, "tiny", DENSE, name, spr, overlap, "sgd") for name, spr in ALL]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_every_schedule_matches_one_process(overlap):
    """pp=2, each schedule: 3 SGD steps' losses and all gradients equal the unsharded model's; the union of the
    stages' parameter names is the full model's; the loss reaches both ranks; bytes and bubble are measured."""
    per_rank = run_workers(_dense_worker, 2, overlap, timeout=120)
    for i, (name, spr) in enumerate(ALL):
        _check_case([per_rank[0][i], per_rank[1][i]], spr, name, _full_names("tiny", DENSE))


def _moe_and_api_worker(rank, world):
    out = {"moe": [_run_case(rank, world, "tiny-moe", MOE, name, spr, True, "adamw", update_bias=True)
                   for name, spr in (("1f1b", 1), ("zbv", 2))]}
    # The seed API: a stage count, microbatch_size, partition_model, step((inputs, targets)), a loss weight; then
    # evaluation between training steps.
    torch.manual_seed(0)
    model = build_model("tiny", **DENSE)
    ref = copy.deepcopy(model)
    pipe = AsyncPipeline(stages=2, microbatch_size=2, overlap_communication=True)
    pipe.partition_model(model)
    (x, y), (vx, vy) = _batches(2)
    loss = pipe.step((x, y), weight=0.5)
    (lm_loss(ref(x), y) * 0.5).backward()
    ref_params = dict(ref.named_parameters())
    out["api"] = {"loss": float(loss), "ref": float(lm_loss(ref(x), y).detach() * 0.5),
                  "grads": {n: (_np(p.grad), _np(ref_params[n].grad)) for n, p in pipe.named_parameters()},
                  "eval": float(pipe.eval_loss(vx, vy)), "ref_eval": float(lm_loss(ref(vx), vy).detach()),
                  "again": float(pipe.step(x, y)), "n_microbatches": pipe.n_microbatches}
    try:
        pipe.step(x[:2], y[:2])   # one microbatch of 2 rows: fewer than pp, which 1f1b refuses (on every rank)
    except ConfigError as e:
        out["api"]["error"] = e.field
    return out


def test_moe_pipeline_and_the_seed_api():
    """tiny-moe (1 dense + 3 MoE blocks) at pp=2 under 1f1b and zbv with AdamW and the router bias updated each
    step by each stage for its own layers: losses and gradients equal one process's, and the router counts too
    (torch's shape inference runs in eval mode, so it is not counted). Then the seed API: AsyncPipeline(stages=2,
    microbatch_size=2) + partition_model, a weighted step, evaluation, and a batch that splits into too few
    microbatches for 1f1b, refused."""
    per_rank = run_workers(_moe_and_api_worker, 2, timeout=120)
    for i, (name, spr) in enumerate((("1f1b", 1), ("zbv", 2))):
        _check_case([per_rank[0]["moe"][i], per_rank[1]["moe"][i]], spr, name, _full_names("tiny-moe", MOE))
    for r in per_rank:
        api = r["api"]
        assert abs(api["loss"] - api["ref"]) <= LOSS_RTOL * api["ref"]
        assert abs(api["eval"] - api["ref_eval"]) <= LOSS_RTOL * api["ref_eval"]
        assert np.isfinite(api["again"]) and api["n_microbatches"] == ROWS // 2
        for name, (got, want) in api["grads"].items():
            np.testing.assert_allclose(got, want, atol=GRAD_ATOL, rtol=GRAD_RTOL, err_msg=name)
        assert api["error"] == "parallel.microbatches"
    assert per_rank[0]["api"]["loss"] == per_rank[1]["api"]["loss"]
