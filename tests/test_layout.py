"""syncwise.layout, the one owner of the layout (DESIGN.md §3.1b): the command line, the Python API and the planner
accept and refuse the same layouts with the same field named; the owner and the planner load no torch; the
compressor table agrees with the compressor classes."""
from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import typing

import pytest

from syncwise.errors import ConfigError
from syncwise.layout import COMPRESSORS, Layout, SyncSpec, parse_compress

COMPRESS = ("none", "fp8", "powersgd:rank=4", "topk:ratio=0.01")
SYNC = ("every-step", "localsgd:period=2", "diloco")
PRESET = "small"  # 4 layers, 4 heads, 16 routed experts: tp, pp and ep each meet the model's limits within 8 ranks


def _degrees(max_world: int = 8):
    """Every (world, pp, dp_replicate, dp_shard, tp, ep) with pp × dp_replicate × dp_shard × tp = world ≤ 8, ep ≤ 2."""
    for world in range(1, max_world + 1):
        for pp, dr, ds, tp in itertools.product(range(1, world + 1), repeat=4):
            if pp * dr * ds * tp == world:
                for ep in (1, 2):
                    yield world, pp, dr, ds, tp, ep


def _cli(world, pp, dr, ds, tp, ep, compress, sync):
    """The validation `syncwise train --check` runs (build_config → check_references), in-process."""
    from syncwise.config import build_config

    overrides = {"dist.nproc": world, "parallel.pp": pp, "parallel.dp_replicate": dr, "parallel.dp_shard": ds,
                 "parallel.tp": tp, "parallel.ep": ep, "compress.method": compress, "parallel.sync": sync,
                 "model.preset": PRESET, "data.batch_size": 2 * pp}   # divides into the 2 × pp microbatches
    try:
        build_config(None, {k: str(v) for k, v in overrides.items()})
    except ConfigError as e:
        return e.field
    return None


def _api(world, pp, dr, ds, tp, ep, compress, sync, model_config):
    """What OptimizedTrainer(parallel=..., compress_gradients=..., sync=...) checks: its compressor (the trainer's
    own resolution of the spec) and sync handed to parallelize, which checks before building anything."""
    from syncwise.parallel import ParallelSpec
    from syncwise.parallel.parallelize import check_layout
    from syncwise.train.trainer import _resolve_compressor

    try:
        spec = ParallelSpec(dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, ep=ep)
        check_layout(spec, _resolve_compressor(compress), SyncSpec.parse(sync), world, model_config)
    except ConfigError as e:
        return e.field
    return None


def _plan(world, pp, dr, ds, tp, ep, compress, sync, model):
    from syncwise.plan import Layout as PlanLayout, syncwise_refusal

    why = syncwise_refusal(PlanLayout(dp_replicate=dr, dp_shard=ds, tp=tp, pp=pp, ep=ep, compress=compress,
                                      sync=sync), model, world, 2 * pp)
    return None if why is None else re.match(r"(?:missing value for )?'([^']+)'", why).group(1)


def test_the_cli_the_python_api_and_the_planner_agree_on_every_layout():
    from syncwise.config import RunConfig, model_overrides
    from syncwise.models import resolve_config
    from syncwise.plan.model import from_model_config

    model_config = resolve_config(PRESET, **model_overrides(RunConfig(), 256))
    model = from_model_config(model_config, PRESET)
    disagree, verdicts = [], {}
    for degrees in _degrees():
        for compress, sync in itertools.product(COMPRESS, SYNC):
            got = (_cli(*degrees, compress, sync), _api(*degrees, compress, sync, model_config),
                   _plan(*degrees, compress, sync, model))
            if len(set(got)) != 1:
                disagree.append(f"{degrees} {compress} {sync}: cli {got[0]}, api {got[1]}, plan {got[2]}")
            verdicts[got[0]] = verdicts.get(got[0], 0) + 1
    assert not disagree, f"{len(disagree)} disagreements:\n" + "\n".join(disagree[:30])
    # the enumeration exercises accepted layouts and every layout rule's field
    assert verdicts.get(None, 0) > 50
    for fld in ("parallel.sync", "compress.method", "parallel.ep", "parallel.tp", "parallel.pp"):
        assert verdicts.get(fld, 0) > 0, verdicts


@pytest.mark.parametrize("argv, field", [
    (["--nproc=2", "--compress=fp8", "--sync=localsgd:period=2"], "parallel.sync"),
    (["--nproc=2", "--parallel.tp=2", "--compress=topk:ratio=0.01"], "compress.method"),
])
def test_a_real_check_subprocess_refuses_what_the_owner_refuses(argv, field):
    p = subprocess.run([sys.executable, "-m", "syncwise.cli", "train", "--check", *argv], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"'{field}'" in p.stderr


def test_the_python_api_refuses_a_compressor_with_local_sgd_as_the_cli_does():
    """Formerly accepted by OptimizedTrainer (the CLI refused it): the rule now has one owner."""
    with pytest.raises(ConfigError) as e:
        Layout.of(compress="fp8", sync="localsgd:period=2").check(2)
    assert e.value.field == "parallel.sync"
    assert _api(2, 1, 2, 1, 1, 1, "fp8", "localsgd:period=2", None) == "parallel.sync"


def test_the_owner_and_the_planner_load_no_torch():
    """predict() with data parallel + fp8, DiLoCo, local SGD, and pp 2 (interleaved) × ep 2 with an fp8 dispatch and
    an fp8 compressor: the pipeline's rules are the owner's (torch-free); a pipeline the schedule refuses is
    refused torch-free too."""
    code = ("import sys, syncwise.layout, syncwise.plan as P\n"
            "m = P.ModelSpec('m', 32000, 1024, 8, 16, 4096)\n"
            "c = P.cluster('h100-sxm', 2)\n"
            "p = P.predict(c, m, P.parse_layout('dp=8,tp=2,compress=fp8:error_feedback=yes', 16), 64, 1024)\n"
            "q = P.predict(c, m, P.parse_layout('dp=16,sync=diloco', 16), 64, 1024)\n"
            "moe = P.ModelSpec('moe', 32000, 1024, 8, 16, 4096, n_routed_experts=8, top_k=2, moe_hidden=512)\n"
            "r = P.predict(c, moe, P.parse_layout('dp=8,pp=2,ep=2,schedule=interleaved-1f1b,v=2,ep_dispatch=fp8,"
            "compress=fp8', 16), 64, 1024)\n"
            "s = P.predict(c, m, P.parse_layout('dp=16,sync=localsgd:period=4', 16), 64, 1024)\n"
            "bad = P.predict(c, m, P.parse_layout('dp=8,pp=2,schedule=zbv', 16), 64, 1024)\n"  # zbv: 2 stages/rank
            "assert p.runnable and q.runnable and r.runnable and s.runnable, (p.not_runnable, q.not_runnable, "
            "r.not_runnable, s.not_runnable)\n"
            "assert not bad.runnable and 'parallel.stages_per_rank' in bad.not_runnable, bad.not_runnable\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_error_feedback_memory_follows_the_compressor_flag():
    """The planner counts residuals by the compressor's own option (any yes/no word), not a substring."""
    from syncwise.plan import SYNCWISE, ModelSpec, parse_layout
    from syncwise.plan.memory import state_bytes

    m = ModelSpec("m", 32000, 1024, 8, 16, 4096)
    for text, has in (("fp8:error_feedback=yes", True), ("fp8", False), ("topk:error_feedback=false", False),
                      ("topk", True), ("powersgd:rank=4", True), ("bf16", False), ("torch-powersgd", True)):
        parts = state_bytes(m, parse_layout(f"dp=2,compress={text}", 2), SYNCWISE, False)
        assert ("compressor_state" in parts) == has, text
    # the state size is the spec's: residuals, plus DGC momentum's buffer when it is on
    one = state_bytes(m, parse_layout("dp=2,compress=topk", 2), SYNCWISE, False)["compressor_state"]
    two = state_bytes(m, parse_layout("dp=2,compress=topk:momentum=0.9", 2), SYNCWISE, False)["compressor_state"]
    assert two == 2 * one


def test_each_spec_is_parsed_once_per_process(monkeypatch):
    """`syncwise train --check` (the launcher) parses --compress and --sync once; the worker's path (specs, the
    resolved layout, OptimizedTrainer → parallelize) parses each once too (formerly 5 and 8 compressor parses)."""
    import torch

    import syncwise.layout as owner
    from syncwise.config import build_config
    from syncwise.models import build_model
    from syncwise.train.trainer import OptimizedTrainer

    calls, real = [], owner.parse_spec
    monkeypatch.setattr(owner, "parse_spec", lambda text, *a, **k: calls.append(text) or real(text, *a, **k))
    cfg = build_config(None, {"compress.method": "powersgd:rank=4", "parallel.sync": "every-step", "dist.nproc": "2"})
    assert calls == ["powersgd:rank=4", "every-step"]
    calls.clear()
    specs = cfg.specs()   # the worker: commands/worker.py's order
    model = build_model("tiny", seq_len=32)
    OptimizedTrainer(model, torch.optim.AdamW(model.parameters()), compress_gradients=specs.compress,
                     sync=specs.sync, parallel=specs.layout.resolve(1), device=torch.device("cpu"))
    assert calls == ["powersgd:rank=4", "every-step"]


def test_a_spec_is_parsed_once_and_travels_as_an_object():
    """The command line's parsed compressor spec is the one the compressor instance, the planner's layout and
    parallelize's resolved layout hold (no string round trip)."""
    from syncwise.config import build_config
    from syncwise.parallel.parallelize import check_layout
    from syncwise.plan import Layout as PlanLayout

    specs = build_config(None, {"compress.method": "powersgd:rank=2", "dist.nproc": "2"}).specs()
    parsed = specs.layout.compress
    assert parsed.options["rank"] == 2 and specs.compress.parsed is parsed
    assert check_layout(specs.layout, specs.compress, specs.sync, 2).compress is parsed
    assert PlanLayout(dp_replicate=2, compress=parsed).compress is parsed
    assert parse_compress("fp8:block=64").bytes_per_element == 1 + 4 / 64


def test_the_compressor_table_is_what_the_classes_take():
    """syncwise.layout.COMPRESSORS (torch-free) and each compressor's Config agree: names, types, defaults."""
    from syncwise.compress.registry import COMPRESSORS as REGISTRY

    for name, info in REGISTRY.items():
        hints = typing.get_type_hints(info.cls.Config)
        real = {f.name: (hints[f.name].__name__, f.default) for f in dataclasses.fields(info.cls.Config)}
        assert {k: v[:2] for k, v in COMPRESSORS[name].options.items()} == real, name
        assert COMPRESSORS[name].bytes_per_element == info.cls.bytes_per_element, name
    assert set(REGISTRY) == {n for n, s in COMPRESSORS.items() if not s.torch_hook}
    assert parse_compress("fp8:error_feedback=on").error_feedback and not parse_compress("fp8").error_feedback


def test_top_level_names_are_lazy():
    code = ("import sys, syncwise\nassert 'torch' not in sys.modules\nfrom syncwise import CloudConfig\n"
            "assert 'torch' not in sys.modules\nfrom syncwise import AsyncPipeline\nprint(AsyncPipeline.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "AsyncPipeline", out.stderr


def test_live_recovery_layout_rule_is_one_rule_for_both_front_ends():
    """check_live_layout: the command line's per-field error and the Python API's 'parallel' error come from one rule;
    DDP / FSDP2 inside a replica group pass."""
    from syncwise.layout import check_live_layout

    check_live_layout(1, 1, 1)
    check_live_layout(1, 1, 1, "parallel")
    for degrees, name in (((2, 1, 1), "tp"), ((1, 2, 1), "pp"), ((1, 1, 4), "ep")):
        with pytest.raises(ConfigError) as cli:
            check_live_layout(*degrees)
        assert cli.value.field == f"parallel.{name}" and "ft.replicas" in str(cli.value)
        with pytest.raises(ConfigError) as api:
            check_live_layout(*degrees, "parallel")
        assert api.value.field == "parallel" and f"{name}=" in str(api.value)
        assert str(cli.value).split("accepted")[-1] == str(api.value).split("accepted")[-1]


# ------------------------------------------------------------------- the step's rules: one owner, both doors
STEP_CASES = [  # (layout, the step fields that break a rule) -> the rule's key in config.CLI_STEP_FIELDS /
    # train.options.API_STEP_FIELDS
    ({"dp_shard": 2}, {"dynamic_batch": True}, "dynamic_batch"),
    ({"pp": 2}, {"grad_accum": 2}, "grad_accum"),
    ({"dp_shard": 2}, {"grad_accum": 2}, None),   # accumulation is fine without a pipeline
]


def _step_api_worker(rank, world):
    """OptimizedTrainer on 2 real ranks, each STEP_CASES row: the field its ConfigError names (None: accepted)."""
    import torch
    from syncwise.models import build_model
    from syncwise.train import DynamicBatcher, OptimizedTrainer

    out = []
    for degrees, fields, _ in STEP_CASES:
        torch.manual_seed(0)
        model = build_model("tiny", vocab_size=64, seq_len=16)
        try:
            OptimizedTrainer(model, torch.optim.AdamW(model.parameters()), parallel=degrees, mixed_precision="none",
                             show_progress=False, grad_accum_steps=fields.get("grad_accum", 1),
                             dynamic_batch=DynamicBatcher(initial_size=2, max_size=2) if fields.get("dynamic_batch")
                             else None)
            out.append(None)
        except ConfigError as e:
            out.append((e.field, e.accepted))
    import torch.distributed as dist

    dist.barrier()  # rank 0 holds the store: it stays until the other rank's last mesh is built (a broken pipe else)
    return out


def test_the_step_rules_are_one_rule_for_both_front_ends():
    """dynamic batching needs replicas and a pipeline takes no accumulation: the command line refused them and the
    Python API did not (and fp16 × pipeline the other way round); both now ask layout.check_step."""
    from distributed import run_workers
    from syncwise.config import CLI_STEP_FIELDS, build_config
    from syncwise.train.options import API_STEP_FIELDS

    cli = []
    for degrees, fields, _ in STEP_CASES:
        overrides = {"dist.nproc": "2", "model.preset": "tiny", "data.batch_size": "4",
                     **{f"parallel.{k}": str(v) for k, v in degrees.items()},
                     "train.dynamic_batch": str(fields.get("dynamic_batch", False)).lower(),
                     "train.grad_accum": str(fields.get("grad_accum", 1))}
        try:
            build_config(None, overrides, here=False)
            cli.append(None)
        except ConfigError as e:
            cli.append((e.field, e.accepted))
    api = run_workers(_step_api_worker, 2)[0]
    assert [c and c[0] for c in cli] == [CLI_STEP_FIELDS[k] if k else None for _, _, k in STEP_CASES]
    assert [a and a[0] for a in api] == [API_STEP_FIELDS[k] if k else None for _, _, k in STEP_CASES]
    assert [c and c[1] for c in cli] == [a and a[1] for a in api]  # the same words: one rule (layout.check_step)
    with pytest.raises(ConfigError) as e:  # fp16 × pipeline, formerly the trainer's alone, now the CLI's too
        build_config(None, {"dist.nproc": "2", "parallel.pp": "2", "model.preset": "tiny",
                            "train.mixed_precision": "fp16"}, here=False)
    assert e.value.field == "train.mixed_precision" and "pipeline" in str(e.value)


def test_the_step_rules_field_names_are_read_off_each_doors_fields():
    """check_step's fields, as each door spells them, come from the dataclass fields whose Option carries the rule
    (schema.rule_fields): every rule field is behind both doors, and a shared Option gives both spellings."""
    from syncwise import schema
    from syncwise.config import CLI_STEP_FIELDS, _sections
    from syncwise.layout import STEP_FIELDS
    from syncwise.train.options import API_STEP_FIELDS, GROUPS

    assert set(CLI_STEP_FIELDS) == set(API_STEP_FIELDS) == set(STEP_FIELDS)
    assert CLI_STEP_FIELDS == {"dynamic_batch": "train.dynamic_batch", "grad_accum": "train.grad_accum",
                               "mixed_precision": "train.mixed_precision", "sync": "parallel.sync"}
    assert API_STEP_FIELDS == {"dynamic_batch": "dynamic_batch", "grad_accum": "grad_accum_steps",
                               "mixed_precision": "mixed_precision", "sync": "sync"}
    for rule, key in CLI_STEP_FIELDS.items():  # each spelling is a real field of that door, carrying that rule
        section, name = key.split(".")
        cli = next(f for f in dataclasses.fields(_sections()[section]) if f.name == name)
        api = next(f for kind in GROUPS.values() for f in dataclasses.fields(kind) if f.name == API_STEP_FIELDS[rule])
        assert schema.option_of(cli).rule == schema.option_of(api).rule == rule
    with pytest.raises(ValueError, match="carried twice"):
        schema.rule_fields({"a": _sections()["train"], "b": _sections()["train"]}, qualified=True)


# ------------------------------------------------------ the training fields' own rules: one Option, both doors
def _shared_options():
    """{Option: (its command-line key, its OptimizedTrainer keyword)} for every option behind both doors, found by
    identity: each door's dataclass field carries the one syncwise.schema.Option."""
    from syncwise.config import _sections
    from syncwise.schema import option_of
    from syncwise.train.options import GROUPS

    cli = {option_of(f): f"{name}.{f.name}" for name, kind in _sections().items() for f in dataclasses.fields(kind)}
    api = {option_of(f): f.name for kind in GROUPS.values() for f in dataclasses.fields(kind) if option_of(f)}
    return {opt: (cli[opt], api[opt]) for opt in api if opt in cli}


BAD_VALUES = {  # the command-line key -> values both doors must refuse (as Python values; the CLI gets their text)
    "train.grad_accum": [0, 65537, -3, 1.5, "two"],
    "train.clip_grad": [-1.0, float("nan"), float("inf"), 1e-9, 1e7, "high"],
    "train.mixed_precision": ["fp64", "int8", "bf17"],
    "train.compile": ["maybe", 2],
    "train.activation_checkpointing": ["sometimes"],
    "train.val_interval": [-1, 10**9 + 1, 0.5],
    "train.log_interval": [0, -5, 2.5],
    "dist.bucket_cap_mb": [0.0, 0.0005, 1e5, float("nan"), "big"],
    "dist.timeout_s": [0.5, 1e9, -1.0, "soon"],
    "compress.min_numel": [-1, 2**31, 1.5],
    "ckpt.preempt_grace_s": [-1.0, 86401.0, float("nan")],
    "profile.steps": ["0:3", "5:2", "x", "1:2000"],
    "profile.every": [1, -2, 1.5],
}
GOOD_VALUES = {  # ... and values both accept: (Python value, command-line text)
    "train.grad_accum": [(65536, "65536")], "train.clip_grad": [(0, "0"), (1e-6, "1e-6")],
    "train.mixed_precision": [("half", "half"), ("bfloat16", "bfloat16"), (False, "false"), (True, "true")],
    "train.val_interval": [(0, "0")], "train.log_interval": [(10**9, "1000000000")],
    "dist.bucket_cap_mb": [(0.001, "0.001"), (10_000, "10000")], "dist.timeout_s": [(1, "1")],
    "compress.min_numel": [(0, "0")], "ckpt.preempt_grace_s": [(0, "0")], "profile.steps": [("2:4", "2:4")],
    "profile.every": [(2, "2")],
}


def _refusal(make):
    try:
        make()
    except ConfigError as e:
        return e
    return None


def test_the_cli_and_the_python_api_refuse_a_bad_training_value_alike():
    """Each option behind both doors is one syncwise.schema.Option: `syncwise train`'s command line (config_from_argv)
    and OptimizedTrainer's keyword refuse the same value with the same line but for the name each door spells
    (the value echoed as the user gave it: the command line's text, or the number it parses to), and accept the same
    values."""
    import torch
    from torch import nn

    from syncwise.config import build_config, config_from_argv
    from syncwise.train import OptimizedTrainer
    from syncwise.train.options import GROUPS

    shared = _shared_options()
    assert set(BAD_VALUES) <= {key for key, _ in shared.values()}, "a listed option is no longer shared"
    assert {key for key, _ in shared.values()} <= set(BAD_VALUES), "a shared option without bad values here"
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrong = []
    for key, keyword in shared.values():
        group = next(g for g in GROUPS.values() if keyword in {f.name for f in dataclasses.fields(g)})
        for value in BAD_VALUES[key]:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            cli = _refusal(lambda: config_from_argv([f"--{key}={text}"]))
            api = _refusal(lambda: OptimizedTrainer(model, opt, show_progress=False, **{keyword: value}))
            if cli is None or api is None:
                wrong.append(f"{key}={text!r}: cli {cli}, api {api}")
                continue
            if (cli.field, api.field) != (key, keyword) or cli.accepted != api.accepted:
                wrong.append(f"{key}={text!r}: cli {cli} | api {api}")
            elif cli.value == value and str(cli).replace(f"'{key}'", f"'{keyword}'") != str(api):
                wrong.append(f"{key}={text!r}: cli {cli} | api {api}")
        for value, text in GOOD_VALUES.get(key, []):
            group(**{keyword: value})   # the API's group takes it ...
            build_config(None, {key: text}, here=False)   # ... and so does the command line
    assert not wrong, "\n".join(wrong)


def test_a_jobs_shared_options_reach_the_trainer_under_its_keywords():
    """The worker hands `syncwise train`'s values to OptimizedTrainer by the schema's pairing (shared_keywords), so
    every shared option set on the command line arrives, under the keyword of the same Option."""
    from syncwise.config import build_config
    from syncwise.train.options import shared_keywords

    cfg = build_config(None, {"train.grad_accum": "3", "train.clip_grad": "0.5", "train.mixed_precision": "half",
                              "train.log_interval": "7", "dist.bucket_cap_mb": "2.5", "dist.timeout_s": "90",
                              "compress.min_numel": "16", "ckpt.preempt_grace_s": "5", "profile.every": "4"},
                       here=False)
    got = shared_keywords(cfg)
    assert set(got) == {keyword for _, keyword in _shared_options().values()}
    assert {k: got[k] for k in ("grad_accum_steps", "clip_grad_norm", "mixed_precision", "log_interval",
                                "bucket_cap_mb", "collective_timeout_s", "min_numel", "preempt_grace_s",
                                "profile_every")} == {
        "grad_accum_steps": 3, "clip_grad_norm": 0.5, "mixed_precision": "fp16", "log_interval": 7,
        "bucket_cap_mb": 2.5, "collective_timeout_s": 90.0, "min_numel": 16, "preempt_grace_s": 5.0,
        "profile_every": 4}


def test_the_memory_threshold_is_one_rule_for_the_cli_and_dynamic_batcher():
    """train.memory_threshold's Python door is DynamicBatcher(memory_threshold=): the same Option's default and rule."""
    from syncwise.config import TrainSection, config_from_argv
    from syncwise.train import DynamicBatcher

    assert DynamicBatcher(1, 2, device="cpu").memory_threshold == TrainSection().memory_threshold
    for value in (0.0, 1.5, float("nan"), -0.1):
        cli = _refusal(lambda: config_from_argv([f"--train.memory_threshold={value}"]))
        api = _refusal(lambda: DynamicBatcher(1, 2, memory_threshold=value, device="cpu"))
        assert (cli.field, api.field) == ("train.memory_threshold", "memory_threshold")
        assert str(cli).replace("train.memory_threshold", "memory_threshold") == str(api)
