"""Config fuzzing (issue 12, item 8): every field of every section, set to hostile values as ``--key=value``
and in TOML files, through the real CLI (``syncwise train --check``, in-process). Each case is either accepted
— exit 0, and the printed configuration reads back to the same values, each passing its field's check — or
rejected with exit 2 and exactly one stderr line naming that field. Never a traceback, never a worker.

Fields are enumerated from the dataclasses, so a new field is fuzzed without touching this file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncwise.cli import main
from syncwise.config import RunConfig, build_config, format_config, load_file
from syncwise.schema import option_of


def _fields() -> dict[str, dataclasses.Field]:
    out = {}
    for f in dataclasses.fields(RunConfig):
        value = getattr(RunConfig(), f.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{sf.name}": sf for sf in dataclasses.fields(value)})
        else:
            out[f.name] = f
    return out


FIELDS = _fields()
# x 2 styles x every field (33 today): about 800 generated cases; SYNCWISE_FUZZ_EXAMPLES=1000 for a long hunt
EXAMPLES_PER_FIELD = int(os.environ.get("SYNCWISE_FUZZ_EXAMPLES", "12"))

# Paths made by the `sandbox` fixture; "@NAME" in a value stands for one of them.
PLACES = ["@EMPTY", "@TINY", "@TEXT", "@ODDBIN", "@TOKENS", "@EMPTYDIR", "@NEWDIR", "@UNDERFILE"]
HOSTILE = [
    "nan", "NaN", "-nan", "inf", "-inf", "+inf", "Infinity", "1e309", "-1e309", "1e-320", "-0.0", "0", "-1", "1",
    "2", "3", "0.5", "10", "10.5", "100", "4096", str(2**31 - 1), str(2**31), str(2**32 - 1), str(2**32),
    str(2**63), str(10**26), "9" * 5000, "", " ", "true", "false", "yes", "off", "[5]", "[1, 2]", "{}", "{a = 1}",
    "None", "é", "日本語", "\u2028", "line\nbreak", "tab\there", "nul\x00byte", "x" * 300, "../x",
    "/dev/null", "/etc", "/nonexistent/path", "~nosuchuser_syncwise/x", "~",
    "none", "auto", "default", "dynamic", "300s", "5m", "2h", "0.5s", "1e3s", "1:2", "2:1", "0:1", "1:1025",
    "tiny", "small", "large", "mha", "mla", "bf16", "fp16", "nccl", "gloo", "stdlib",
    "powersgd:rank=0", "powersgd:rank=inf", "PowerSGD:rank=4", "topk:ratio=nan", "topk:ratio=0.01", "fp8",
    "int8:levels=300", "torch-powersgd:start_iter=1", "torch-powersgd:rank=4", "torch-fp16", "zip",
    "every-step", "localsgd:outer_lr=inf", "localsgd:period=4", "diloco:period=0", "diloco:period=8,delay=9",
    "pipesgd:dtype=fp16", "kill:rank=99,step=1", "kill:rank=1,step=3", "nan:step=5", "nan:step=999999",
    "nan:step=5,rank=1", "kill:step=0,rank=0", *PLACES,
]

# Valid values of the string fields (a field not listed draws from HOSTILE, which holds many valid ones).
VALID_STRINGS = {
    "run_dir": ["", "@NEWDIR", "relative/run"], "resume": ["none", "auto"], "model.preset": ["tiny", "small", "large"],
    "model.attention": ["default", "mha", "mla"], "data.corpus": ["stdlib", "@TEXT", "@TOKENS"],
    "train.mixed_precision": ["none", "bf16", "auto"], "dist.backend": ["auto", "gloo"], "dist.nnodes": ["1", "1:2"],
    "compress.method": ["none", "fp16", "powersgd:rank=4", "topk:ratio=0.01", "torch-powersgd:rank=2"],
    "parallel.sync": ["every-step", "localsgd:period=4", "diloco:period=8,delay=2", "pipesgd"],
    "ckpt.interval": ["dynamic", "0", "100", "300s", "5m"],
}

text_values = st.one_of(
    st.sampled_from(HOSTILE),
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.integers(min_value=-3, max_value=300).map(str),
    st.floats().map(repr),
    st.floats(min_value=-20, max_value=20).map(repr),
    st.text(max_size=24),
)
toml_scalars = st.one_of(
    st.sampled_from(HOSTILE),
    st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.integers(min_value=-3, max_value=300),
    st.floats(),
    st.floats(min_value=-20, max_value=20),
    st.text(max_size=24),
)
toml_values = st.recursive(  # wrong types too: lists (mixed), inline tables, nested ones
    toml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, max_size=2)),
    max_leaves=4)


def _default(key: str):
    obj = RunConfig()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _plausible(key: str) -> st.SearchStrategy:
    """Values of the field's own type around its default: most are accepted, some cross a bound."""
    default = _default(key)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(min_value=0, max_value=max(4 * default, 16))
    if isinstance(default, float):
        return st.floats(min_value=0, max_value=4 * default + 1)
    if isinstance(default, list):
        return st.lists(st.sampled_from(["nan:step=5", "nan:step=1,rank=1", "kill:rank=1,step=3"]), max_size=2)
    return st.sampled_from(VALID_STRINGS.get(key, HOSTILE))


def _as_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ";".join(value)  # the command line's list syntax
    return repr(value) if isinstance(value, float) else str(value)


@pytest.fixture(scope="module")
def sandbox():
    """Files for path-valued fields; the cwd and HOME point inside, so relative paths and '~' stay here."""
    root = Path(tempfile.mkdtemp(prefix="syncwise-fuzz-"))
    (root / "home").mkdir()
    (root / "cwd" / "a" / "b").mkdir(parents=True)
    (root / "empty.txt").write_text("")
    (root / "tiny.txt").write_text("hello\n")
    (root / "text.txt").write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                                           for i in range(4000)))
    (root / "odd.bin").write_bytes(b"\x01\x02\x03")
    (root / "tokens").mkdir()
    np.arange(60_000, dtype=np.uint16).tofile(root / "tokens" / "train.bin")
    np.arange(6_000, dtype=np.uint16).tofile(root / "tokens" / "val.bin")
    (root / "emptydir").mkdir()
    places = {"@EMPTY": root / "empty.txt", "@TINY": root / "tiny.txt", "@TEXT": root / "text.txt",
              "@ODDBIN": root / "odd.bin", "@TOKENS": root / "tokens", "@EMPTYDIR": root / "emptydir",
              "@NEWDIR": root / "new" / "run", "@UNDERFILE": root / "tiny.txt" / "run"}
    cwd, home = os.getcwd(), os.environ.get("HOME")
    os.chdir(root / "cwd" / "a" / "b")
    os.environ["HOME"] = str(root / "home")
    try:
        yield root, {k: str(v) for k, v in places.items()}
    finally:
        os.chdir(cwd)
        if home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = home
        shutil.rmtree(root, ignore_errors=True)


def _place(value, places):
    if isinstance(value, str):
        return places.get(value, value)
    if isinstance(value, list):
        return [_place(v, places) for v in value]
    if isinstance(value, dict):
        return {k: _place(v, places) for k, v in value.items()}
    return value


def _walks_outside(key: str, value, root: Path) -> bool:
    """A corpus folder outside the sandbox (say '/') would be read file by file: not this test's business."""
    if key != "data.corpus" or not isinstance(value, (str, int, float)) or isinstance(value, bool):
        return False
    path = os.path.abspath(os.path.expanduser(str(value).strip()))
    return (os.path.exists(path) and not path.startswith(str(root))
            and path not in ("/etc", "/dev/null") and str(value) != "stdlib")


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--check", *argv])  # any exception fails the test: zero tracebacks
    return code, out.getvalue(), err.getvalue()


def _assert_outcome(key: str, code: int, out: str, err: str) -> None:
    if code == 0:
        assert err == "", err
        values = tomllib.loads(out)  # re-parseable ...
        cfg = build_config(values)  # ... valid by the same rules ...
        assert format_config(cfg) == out.rstrip("\n")  # ... and the same configuration
        for name, f in FIELDS.items():
            obj = cfg
            for part in name.split("."):
                obj = getattr(obj, part)
            assert not isinstance(obj, float) or math.isfinite(obj), (name, obj)
            assert option_of(f).validate(name, obj) == obj, (name, obj)  # its rule holds, canonical as kept
    else:
        assert code == 2, (code, err)
        assert out == ""
        lines = err.rstrip("\n").split("\n")
        assert len(lines) == 1, err
        assert lines[0].startswith(f"syncwise: invalid value for '{key}'"), (key, err)
        assert "Traceback" not in err


def _toml_string(text: str) -> str:
    escaped = "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c
                      for c in text)
    return f'"{escaped}"'


def _toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items()) + "}"


@pytest.mark.parametrize("key", list(FIELDS))
@settings(max_examples=EXAMPLES_PER_FIELD, deadline=None, database=None)
@given(data=st.data())
def test_fuzz_command_line_value(sandbox, key, data):
    root, places = sandbox
    plausible = _plausible(key).map(_as_text)
    value = _place(data.draw(st.one_of(text_values, plausible, plausible), label=key), places)
    if _walks_outside(key, value, root):
        return
    code, out, err = _cli([f"--{key}={value}"])
    _assert_outcome(key, code, out, err)


@pytest.mark.parametrize("key", list(FIELDS))
@settings(max_examples=EXAMPLES_PER_FIELD, deadline=None, database=None)
@given(data=st.data())
def test_fuzz_toml_value(sandbox, key, data):
    root, places = sandbox
    value = _place(data.draw(st.one_of(toml_values, _plausible(key), _plausible(key)), label=key), places)
    if _walks_outside(key, value, root):
        return
    section, _, name = key.rpartition(".")
    doc = f"[{section}]\n{name} = {_toml_literal(value)}\n" if section else f"{name} = {_toml_literal(value)}\n"
    path = root / "fuzz.toml"
    path.write_text(doc, encoding="utf-8")
    assert load_file(path)  # the document is valid TOML: what is fuzzed is the value, not the syntax
    code, out, err = _cli(["--config", str(path)])
    _assert_outcome(key, code, out, err)


# ----------------------------------------------------------------------------- the issue's defects, one by one

def _empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    return str(tmp_path / "empty.txt")


@pytest.mark.parametrize("argv, key", [
    (["--train.lr=inf"], "train.lr"),                              # trained to NaN, exit 0
    (["--train.weight_decay=inf"], "train.weight_decay"),
    (["--sync=localsgd:outer_lr=inf"], "parallel.sync"),
    (["--train.seed=4294967296"], "train.seed"),                   # numpy.random.seed traceback in the workers
    ([f"--train.grad_accum={10**26}"], "train.grad_accum"),
    (["--ckpt.mtbf_s=inf"], "ckpt.mtbf_s"),
    (["--dist.timeout_s=inf"], "dist.timeout_s"),                  # timedelta overflow in the workers
    (["--dist.bucket_cap_mb=inf"], "dist.bucket_cap_mb"),
    (["--dist.bucket_cap_mb=1e-300"], "dist.bucket_cap_mb"),       # 0 bytes: one bucket per tensor
    (["--nnodes=2"], "dist.nnodes"),                               # hung: nobody can join a 127.0.0.1 rendezvous
    (["--max-restarts=1", "--inject-fault=kill:rank=99,step=1"], "inject_fault"),  # rank 99 of 2: ignored
    (["--data.corpus=/dev/null"], "data.corpus"),                  # rejected only inside the workers
    (["--data.corpus=@EMPTY"], "data.corpus"),
    (["--resume=/etc"], "resume"),
    ([f"--data.seq_len={10**6}"], "data.seq_len"),
    ([f"--data.batch_size={10**6}"], "data.batch_size"),
])
def test_issue_defects_are_rejected_before_any_worker(argv, key, tmp_path):
    argv = [a.replace("@EMPTY", _empty_file(tmp_path)) for a in argv]
    code, out, err = _cli(["--run-dir", str(tmp_path / "run"), *argv])
    assert code == 2 and err.startswith(f"syncwise: invalid value for '{key}'") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_nccl_without_cuda_is_rejected():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid backend here")
    code, _, err = _cli(["--dist.backend=nccl"])
    assert code == 2 and err.startswith("syncwise: invalid value for 'dist.backend': 'nccl'"), err


def test_toml_inject_fault_of_non_strings_names_the_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("inject_fault = [5]\n")  # was a TypeError traceback
    code, _, err = _cli(["--config", str(path)])
    assert code == 2 and err.startswith("syncwise: invalid value for 'inject_fault': [5]"), err


def test_spec_errors_name_the_config_key_and_echo_the_value_as_typed():
    code, _, err = _cli(["--compress", "PowerSGD:rank=0"])  # was: 'compress': 'powersgd:rank=0'
    assert code == 2 and err.startswith("syncwise: invalid value for 'compress.method': 'PowerSGD:rank=0' "
                                        "— accepted: rank >= 1"), err
    code, _, err = _cli(["--compress.method=torch-powersgd:rank=0"])
    assert code == 2 and err.startswith("syncwise: invalid value for 'compress.method': "
                                        "'torch-powersgd:rank=0'"), err
    code, _, err = _cli(["--sync", "diloco:period=8,delay=9"])
    assert code == 2 and err.startswith("syncwise: invalid value for 'parallel.sync': 'diloco:period=8,delay=9' "
                                        "— accepted: delay: "), err


def test_a_step_too_big_for_this_machine_is_rejected():
    from syncwise.models import resolve_config, train_memory_bytes

    argv = ["--preset=large", "--data.seq_len=8192", "--data.batch_size=24"]  # fits the stdlib corpus
    need = train_memory_bytes(resolve_config("large", seq_len=8192), 24)
    if need < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        pytest.skip("this machine could hold that step")
    code, _, err = _cli(argv)
    assert code == 2 and err.startswith("syncwise: invalid value for 'data.seq_len'") and "GiB" in err, err


def test_check_prints_a_configuration_that_reads_back_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = _cli(["--run-dir", str(run_dir), "--preset", "tiny", "--ckpt.interval=5m",
                           "--sync", "localsgd:period=4", "--train.lr=0.01"])
    assert (code, err) == (0, "")
    assert not run_dir.exists()  # neither created nor locked
    saved = tmp_path / "resolved.toml"
    saved.write_text(out)
    values = tomllib.loads(out)
    assert values["model"]["preset"] == "tiny" and values["train"]["lr"] == 0.01
    assert values["ckpt"]["interval"] == "5m" and values["parallel"]["sync"] == "localsgd:period=4"
    code2, out2, _ = _cli(["--config", str(saved)])
    assert code2 == 0 and out2 == out


def test_help_lists_each_fields_bounds(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--check" in text and "4,294,967,295" in text and "from 1e-9 to 10" in text
