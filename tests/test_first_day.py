"""A user's first day (issue 43): what `--resume auto` found, data pitfalls, the install's extras."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import FailsAtStep3
from syncwise import OptimizedTrainer
from syncwise.cli import main


def test_resume_auto_without_a_checkpoint_says_it_starts_fresh_in_the_python_api(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, mixed_precision=False)
    assert trainer.train([(x, x)], steps=1, checkpoint_dir=str(tmp_path / "tpyo"), resume="auto")["steps"] == 1
    out = capsys.readouterr().out
    assert f"syncwise: resume auto found no checkpoint in {tmp_path / 'tpyo'}; starting a fresh run from step 0" \
        in out.splitlines(), out


def test_resume_auto_on_a_missing_run_dir_says_so_on_the_command_line(tmp_path, capsys):
    run = tmp_path / "tpyo"
    assert main(["train", "--nproc", "1", "--preset", "tiny", "--steps", "1", "--run-dir", str(run),
                 "--resume", "auto", "--data.seq_len=32", "--train.val_batches=1"]) == 0
    out = capsys.readouterr().out
    assert f"syncwise: resume auto found no checkpoint in {run / 'checkpoints'}; starting a fresh run from step 0" \
        in out.splitlines(), out


def test_a_json_lines_corpus_without_a_tokenizer_is_refused(tmp_path, capsys):
    import json

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40, "id": i}) + "\n" for i in range(200)))
    assert main(["train", "--check", "--preset", "tiny", "--data.corpus", str(corpus), "--data.seq_len=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "'data.tokenizer'" in err and "raw JSON/parquet bytes" in err, err
    folder = tmp_path / "shards"
    folder.mkdir()
    corpus.rename(folder / "a.jsonl")
    assert main(["train", "--check", "--preset", "tiny", "--data.corpus", str(folder), "--data.seq_len=32"]) == 2
    assert "'data.tokenizer'" in capsys.readouterr().err


def test_a_seq_len_beyond_the_models_positions_names_that_cause(tmp_path, capsys):
    import json

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 256}))
    corpus = tmp_path / "notes.txt"  # room for training windows of 1024, not for a validation batch of them
    corpus.write_text("a line of the user's own notes\n" * 2000)
    assert main(["train", "--check", "--model", f"hf:{folder}", "--data.corpus", str(corpus),
                 "--data.seq_len=1024"]) == 2
    err = capsys.readouterr().err
    assert "'data.seq_len': 1024" in err and "max_position_embeddings (256" in err, err
    assert "val_fraction" not in err


def test_the_core_install_leaves_drawing_to_the_report_extra_and_names_the_tested_torch():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "matplotlib" not in core
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["report"])
    torch_req = next(d for d in project["dependencies"] if d.startswith("torch"))
    # open above, so installing syncwise never replaces a user's (CUDA) torch; the tested release is pinned on the
    # install path (requirements.txt, what scripts/setup.sh and CI install) and named in pyproject's comment
    assert torch_req == "torch>=2.5", torch_req
    assert "torch==2.13.0" in (root / "requirements.txt").read_text().split()
    assert "tested on 2.13.0" in (root / "pyproject.toml").read_text()
    assert "matplotlib" in (root / "requirements.txt").read_text().split()  # the tests draw


def test_drawing_without_matplotlib_names_the_extra_in_one_line(monkeypatch):
    import sys

    import pytest

    from syncwise.commands.report import draw
    from syncwise.errors import SyncwiseError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what Python does for a package that is not installed
    with pytest.raises(SyncwiseError) as e:
        draw([])
    assert str(e.value) == ("syncwise report (its picture) needs matplotlib, which is not installed: "
                            "pip install 'syncwise[report]'")


def test_resume_auto_with_rows_but_no_checkpoint_sets_the_rows_aside_on_the_command_line(tmp_path, capsys):
    """A run that died after some steps but before its first checkpoint: --resume auto has nothing to continue and
    starts afresh; the rows it would have replaced are set aside, never deleted."""
    run = tmp_path / "run"
    run.mkdir()
    rows = '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'
    (run / "metrics.jsonl").write_text(rows)
    (run / "config.json").write_text("{}\n")
    assert main(["train", "--nproc", "1", "--preset", "tiny", "--steps", "1", "--run-dir", str(run),
                 "--resume", "auto", "--data.seq_len=32", "--train.val_batches=1"]) == 0
    captured = capsys.readouterr()
    (aside,) = (run / "failed-starts").iterdir()
    assert f"syncwise: {run} held a run with no checkpoint to continue from (config.json, metrics.jsonl); moved it " \
        f"to {aside} (nothing deleted), starting afresh" in captured.err.splitlines(), captured.err
    assert f"syncwise: resume auto found no checkpoint in {run / 'checkpoints'}; starting a fresh run from step 0" \
        in captured.out.splitlines(), captured.out
    assert (aside / "metrics.jsonl").read_text() == rows
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_auto_with_rows_but_no_checkpoint_sets_the_rows_aside_in_the_python_api(tmp_path, capsys):
    run = tmp_path / "run"
    x = torch.randn(8, 4)

    def trainer(model):
        return OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss,
                                mixed_precision=False, show_progress=False, run_dir=str(run))

    with pytest.raises(RuntimeError, match="step 3"):
        trainer(FailsAtStep3(4, 4)).train([(x, x)], steps=6, checkpoint_dir=str(run / "ckpt"))
    rows = (run / "metrics.jsonl").read_text()
    assert rows.strip() and not list((run / "ckpt").glob("step_*"))  # rows, no checkpoint
    capsys.readouterr()
    assert trainer(nn.Linear(4, 4)).train([(x, x)], steps=2, checkpoint_dir=str(run / "ckpt"),
                                          resume="auto")["steps"] == 2
    (aside,) = (run / "failed-starts").iterdir()
    err = capsys.readouterr().err
    assert f"syncwise: {run} held a run with no checkpoint to continue from (metrics.jsonl, ranks" in err, err
    assert f"moved it to {aside} (nothing deleted), starting afresh" in err
    assert (aside / "metrics.jsonl").read_text() == rows
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
