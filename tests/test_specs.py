"""One spec parser (syncwise.specs) for --compress, --sync, the torch hooks and --inject-fault; config validates
each value by its owner's parser; compress.sync is read as its new key parallel.sync."""
import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncwise.checkpoint.interval import parse_interval
from syncwise.commands.train import check_run_dir, resolve_config
from syncwise.compress import parse_compress_spec
from syncwise.config import RunConfig, build_config, config_from_argv, format_config
from syncwise.errors import ConfigError, SyncwiseError
from syncwise.parallel import SyncSpec, TorchHookSpec
from syncwise.layout import COMPRESSORS, names_torch_hook
from syncwise.specs import (BOOL_ACCEPTED, NO, YES, parse_bool, parse_spec, read_bool, read_float, read_int,
                           spec_name)
from syncwise.train.faults import Fault, FaultPlan

NAMES = st.text(string.ascii_lowercase + string.digits + "-_", min_size=1, max_size=12)
KEYS = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10)
VALUES = st.text(string.ascii_letters + string.digits + ".-+_|", max_size=10)


@settings(max_examples=200, deadline=None)
@given(NAMES, st.dictionaries(KEYS, VALUES, max_size=5), st.sampled_from(["", " "]))
def test_parse_spec_round_trips_names_and_options(name, options, pad):
    text = name + (":" + ",".join(f"{pad}{k}{pad}={pad}{v}{pad}" for k, v in options.items()) if options else "")
    assert parse_spec(pad + text, "f", "x") == (name, options)


@settings(max_examples=200, deadline=None)
@given(NAMES, st.dictionaries(KEYS, VALUES, max_size=5), st.sampled_from(["", " "]), st.booleans())
def test_spec_name_is_the_name_parse_spec_reads(name, options, pad, upper):
    text = (name.upper() if upper else name) + (":" + ",".join(f"{k}={pad}{v}" for k, v in options.items())
                                                if options else "")
    assert spec_name(pad + text + pad) == parse_spec(pad + text + pad, "f", "x")[0] == name


def test_one_test_for_pytorchs_hooks():
    """names_torch_hook is the table's torch_hook, by name or by spec text in any case; anything else is not."""
    for name, spec in COMPRESSORS.items():
        assert names_torch_hook(name) is spec.torch_hook
        assert names_torch_hook(f" {name.upper()}:rank=2") is spec.torch_hook
    assert not names_torch_hook(None) and not names_torch_hook("torchft-diloco") and spec_name(None) == ""



@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_parse_spec_returns_or_raises_a_config_error_naming_the_field(text):
    try:
        name, options = parse_spec(text, "some.field", "WHAT IS ACCEPTED")
    except ConfigError as e:
        assert e.field == "some.field" and e.value == text and "WHAT IS ACCEPTED" in e.accepted
        assert "\n" not in str(e)
    else:
        assert name and name == name.strip().lower() and all(k and k == k.strip() for k in options)


def test_parse_spec_rejects_empty_and_options_without_a_value():
    for bad in ("", "  ", None, 5, ":a=1", "name:flag", "name:=3"):
        with pytest.raises(ConfigError) as e:
            parse_spec(bad, "compress", "NAME[:key=value]")
        assert e.value.field == "compress" and "NAME[:key=value]" in e.value.accepted
    assert parse_spec(" TopK : ratio = 0.1 ,, ", "f", "x") == ("topk", {"ratio": "0.1"})
    assert parse_spec("a:k=1,k=2", "f", "x") == ("a", {"k": "2"})  # the last of a repeated key wins


@pytest.mark.parametrize("word", [*YES, *NO, "YES", "Off", " True "])
def test_one_yes_no_vocabulary(word):
    expected = word.strip().lower() in YES
    assert parse_bool(word) is expected and read_bool(word, "f", "t", "k") is expected


def test_readers_name_field_key_and_what_is_accepted():
    with pytest.raises(ConfigError) as e:
        read_bool("maybe", "parallel.sync", "diloco:nesterov=maybe", "nesterov")
    assert e.value.field == "parallel.sync" and e.value.value == "diloco:nesterov=maybe"
    assert BOOL_ACCEPTED in e.value.accepted and "nesterov" in e.value.accepted
    for raw in ("x", "1.5", str(2**63)):
        with pytest.raises(ConfigError, match="int64"):
            read_int(raw, "f", "t", "k")
    assert read_int(" 7 ", "f", "t", "k", 1, 9) == 7
    for raw in ("nan", "inf", "-inf", "x"):
        with pytest.raises(ConfigError, match="finite"):
            read_float(raw, "f", "t", "k")
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        read_float("2", "f", "t", "k", 0, 1)


@pytest.mark.parametrize("yes, no", [("yes", "no"), ("on", "off"), ("1", "0"), ("TRUE", "False")])
def test_every_owner_reads_the_same_yes_no_words(yes, no):
    assert SyncSpec.parse(f"diloco:nesterov={yes}").nesterov is True
    assert SyncSpec.parse(f"diloco:nesterov={no}").nesterov is False
    assert parse_compress_spec(f"topk:error_feedback={yes}").config.error_feedback is True
    assert parse_compress_spec(f"topk:error_feedback={no}").config.error_feedback is False
    cfg = build_config(None, {"parallel.sync": f"localsgd:nesterov={yes}", "train.deterministic": yes})
    assert cfg.specs().sync.nesterov is True and cfg.train.deterministic is True


def test_a_bad_yes_no_word_lists_the_vocabulary_for_compress_and_sync():
    for key, value in (("parallel.sync", "diloco:nesterov=maybe"), ("compress.method", "topk:error_feedback=maybe")):
        with pytest.raises(ConfigError) as e:
            build_config(None, {key: value})
        assert e.value.field == key and e.value.value == value and BOOL_ACCEPTED in e.value.accepted


def test_owners_keep_their_accepted_texts():
    with pytest.raises(ConfigError) as e:
        parse_compress_spec("topk:bogus=1")
    assert e.value.field == "compress" and "options of topk" in e.value.accepted
    with pytest.raises(ConfigError) as e:
        SyncSpec.parse("localsgd:stride=2")
    assert e.value.field == "parallel.sync" and "keys of localsgd" in e.value.accepted
    with pytest.raises(ConfigError) as e:
        TorchHookSpec.parse("torch-powersgd:rank=0")
    assert e.value.field == "compress" and "torch-powersgd[:rank=R" in e.value.accepted
    for bad in ("kill:step=3", "nan:step=0", "nan:step=x", "nan:step=1,when=2", "oops:step=1", "nan:step"):
        with pytest.raises(ConfigError) as e:
            Fault.parse(bad)
        assert e.value.field == "inject_fault" and "kill:rank=R,step=S" in e.value.accepted
    assert Fault.parse(" KILL : rank = 1 , step = 3 ") == Fault("kill", 3, 1)
    assert TorchHookSpec.parse("torch-powersgd: rank=2, start_iter=3").options == {"rank": 2, "start_iter": 3}
    assert TorchHookSpec.parse("powersgd:rank=2") is None
    assert SyncSpec.parse(" every-step ") is None
    with pytest.raises(ConfigError):
        SyncSpec.parse("every-step:period=2")


def test_the_config_hands_out_parsed_typed_specs():
    cfg = build_config(None, {"parallel.sync": "diloco:period=8,nesterov=no", "inject_fault": "nan:step=5;nan:step=7,rank=1"})
    specs = cfg.specs()
    assert specs.sync.method == "diloco" and specs.sync.period == 8 and specs.sync.nesterov is False
    assert specs.faults == [Fault("nan", 5), Fault("nan", 7, 1)]
    assert specs.compress.name == "none"
    assert FaultPlan(specs.faults).poison_loss(7, 1) and FaultPlan(["nan:step=7"]).poison_loss(7, 0)
    cfg = build_config(None, {"compress.method": "powersgd:rank=2"})
    first, second = cfg.specs().compress, cfg.specs().compress
    assert first.spec == "powersgd:rank=2" and first.config.rank == 2 and first is not second  # fresh state
    assert cfg.specs().sync is None
    assert build_config(None, {"compress.method": "torch-fp16"}).specs().compress == TorchHookSpec("fp16")


@pytest.mark.parametrize("interval", ["5m", "0", "300s", "2h", "100", "dynamic"])
def test_ckpt_interval_accepts_what_the_checkpointer_documents(interval):
    assert build_config(None, {"ckpt.interval": interval}).ckpt.interval == interval
    parse_interval(interval)  # the owner accepts it too


def test_ckpt_interval_zero_is_only_the_final_checkpoint_and_bad_durations_list_what_is_accepted():
    assert parse_interval("0") == parse_interval(0) == ("final", 0.0)
    for bad in ("5 minutes", "-1", "0s", "soon"):
        with pytest.raises(ConfigError) as e:
            build_config(None, {"ckpt.interval": bad})
        assert e.value.field == "ckpt.interval" and e.value.value == bad
        assert all(word in e.value.accepted for word in ("0", "'5m'", "dynamic"))


def test_sync_lives_in_the_parallel_section():
    cfg = config_from_argv(["--sync", "diloco:period=8,nesterov=yes"])  # the --sync flag sets parallel.sync
    assert cfg.specs().sync.nesterov is True
    cfg = build_config(None, {"parallel.sync": "diloco:period=8"})
    assert cfg.parallel.sync == "diloco:period=8" and not hasattr(cfg.compress, "sync")
    assert '[parallel]\nsync = "diloco:period=8"' in format_config(cfg)
    from syncwise.config import FLAG_KEYS

    assert FLAG_KEYS["sync"] == "parallel.sync"


def test_compress_sync_is_read_as_parallel_sync_with_a_note(capsys, monkeypatch):
    import syncwise.config as config

    monkeypatch.setattr(config, "_noted", set())
    cfg = build_config({"compress": {"method": "none", "sync": "localsgd:period=4"}})
    assert cfg.parallel.sync == "localsgd:period=4"
    err = capsys.readouterr().err
    assert "compress.sync is now parallel.sync" in err and err.count("\n") == 1
    assert build_config(None, {"compress.sync": "diloco:period=2"}).parallel.sync == "diloco:period=2"
    assert capsys.readouterr().err == ""  # one note per process
    with pytest.raises(ConfigError) as e:  # the same source may not contradict itself
        build_config({"compress": {"sync": "localsgd:period=4"}, "parallel": {"sync": "diloco:period=8"}})
    assert e.value.field == "compress.sync" and "parallel.sync" in e.value.accepted
    # both set alike: fine
    assert build_config({"compress": {"sync": "pipesgd"}, "parallel": {"sync": "pipesgd"}}).parallel.sync == "pipesgd"


def test_an_old_run_config_with_compress_sync_resumes_and_refuses_a_different_sync(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = RunConfig().to_dict()
    del old["parallel"]
    old["compress"]["sync"] = "localsgd:period=4"  # a config.json written before parallel.sync
    old["run_dir"] = str(run)
    (run / "config.json").write_text(json.dumps(old))
    # a run that trained (a row and a checkpoint): one that never finished a step is set aside, not resumed
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    cfg = resolve_config(None, {"run_dir": str(run), "resume": "auto"})
    assert cfg.parallel.sync == "localsgd:period=4"
    check_run_dir(cfg, run)  # same sync: fine
    cfg = resolve_config(None, {"run_dir": str(run), "resume": "auto", "parallel.sync": "diloco:period=4"})
    with pytest.raises(SyncwiseError, match=r"parallel\.sync='localsgd:period=4'"):
        check_run_dir(cfg, run)
