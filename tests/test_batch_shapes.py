"""Batches as users have them (issue 43, row 1): ``(inputs, targets)``, a mapping passed as ``model(**batch)``, and a
model that returns its own loss — through the Python API, accumulation, dynamic batching, token counting, validation,
the pipeline's refusal, two ranks under torchrun with a compressor and a resume, and a run that dies before step 1."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from helpers import FailsAtStep3
from syncwise import ConfigError, OptimizedTrainer, SyncwiseError
from syncwise.train import batches
from syncwise.train.dynamic_batch import DynamicBatcher

VOCAB, SEQ = 32, 8


class Output:
    """What a Hugging Face model returns, in small: ``.loss`` (None without labels) and ``.logits``."""

    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class TinyLM(nn.Module):
    """``forward(input_ids, attention_mask=None, labels=None)`` → Output, as an HF causal LM is called."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Output(loss, logits)


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ), "labels": (ids[i] + 1) % VOCAB}
            for i in range(n)]


def _trainer(model=None, **kw):
    torch.manual_seed(0)
    model = model or TinyLM()
    kw.setdefault("mixed_precision", False)
    kw.setdefault("show_progress", False)
    return OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), **kw)


def test_mapping_batches_and_a_model_that_returns_its_loss_train_without_a_loss_fn(tmp_path):
    loader = DataLoader(_rows(32), batch_size=4, shuffle=True)   # default collate: a dict of tensors per batch
    trainer = _trainer(run_dir=str(tmp_path / "run"), val_loader=DataLoader(_rows(8, 1), batch_size=4),
                       val_interval=4)
    summary = trainer.train(loader, steps=8)
    assert summary["steps"] == 8 and summary["final_loss"] is not None
    assert summary["final_val_loss"] is not None
    assert trainer.tokens_seen == 8 * 4 * SEQ  # input_ids' elements, as (inputs, targets) token ids count


def test_loss_fn_gets_the_outputs_and_the_batch_for_mappings():
    seen = []

    def loss_fn(outputs, batch):
        seen.append(sorted(batch))
        return F.cross_entropy(outputs.logits.flatten(0, 1), batch["labels"].flatten())

    data = [{k: v for k, v in r.items() if k != "attention_mask"} for r in _rows(8)]
    _trainer(loss_fn=loss_fn).train(DataLoader(data, batch_size=4), steps=2)
    assert seen == [["input_ids", "labels"]] * 2


@pytest.mark.parametrize("returns", ["scalar", "dict"])
def test_a_model_returning_its_own_loss_needs_no_loss_fn_for_pairs(returns):
    class AutoEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            loss = ((self.lin(x) - x) ** 2).mean()
            return loss if returns == "scalar" else {"loss": loss, "out": x}

    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    summary = _trainer(AutoEncoder()).train([(x[:8], x[:8]), (x[8:], x[8:])], steps=6)
    assert summary["steps"] == 6 and summary["final_loss"] < 1.0


def _params(trainer):
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def test_accumulation_and_dynamic_batching_split_mappings_as_one_batch():
    rows = _rows(16)
    whole = [torch.utils.data.default_collate(rows[i:i + 8]) for i in (0, 8)]
    halves = [torch.utils.data.default_collate(rows[i:i + 4]) for i in (0, 4, 8, 12)]
    reference = _trainer()
    reference.train(whole, steps=2)
    accumulated = _trainer(grad_accum_steps=2)
    accumulated.train(halves, steps=2)
    dynamic = _trainer(dynamic_batch=DynamicBatcher(2, 2, memory_threshold=1.0, device="cpu"))
    dynamic.train(whole, steps=2)
    assert dynamic.batcher.size == 2  # split into micro-batches of 2 rows
    torch.testing.assert_close(_params(accumulated), _params(reference))
    torch.testing.assert_close(_params(dynamic), _params(reference))
    assert reference.tokens_seen == accumulated.tokens_seen == dynamic.tokens_seen == 16 * SEQ


def test_an_unusable_batch_is_refused_in_one_line_before_the_run_dir_is_claimed(tmp_path):
    run = tmp_path / "run"
    x = torch.randn(4, 6)
    bad = [(x, x, x)]
    with pytest.raises(ConfigError) as e:
        _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train(bad, steps=1)
    message = str(e.value)
    assert "\n" not in message
    assert "the loader yielded a tuple of 3 item(s) (Tensor, Tensor, Tensor)" in message
    assert "(inputs, targets) tuples, or a mapping of the model's keyword arguments" in message
    assert not (run / "metrics.jsonl").exists()
    # the fixed rerun in the same run directory starts
    assert _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=1)["steps"] == 1


def test_a_run_that_dies_before_step_1_does_not_block_the_rerun(tmp_path):
    """A loader that cannot be looked at ahead (an iterable) is checked at the first step; the run it ends leaves
    nothing that refuses the fixed rerun."""
    run = tmp_path / "run"
    x = torch.randn(4, 6)

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, batch):
            self.batch = batch

        def __iter__(self):
            return iter([self.batch] * 3)

    with pytest.raises(ConfigError, match="the loader yielded a str"):
        _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train(
            DataLoader(Stream("not a batch"), batch_size=None), steps=2)
    summary = _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train(
        DataLoader(Stream((x, x)), batch_size=None), steps=2)
    assert summary["steps"] == 2


def test_a_model_that_raises_on_its_first_batch_leaves_its_files_aside_not_in_the_way(tmp_path, capsys):
    """The Python API's door: what the dead start wrote (an empty metrics.jsonl, ranks/, tb/ ...) is moved to
    run_dir/failed-starts/<time>/ with one line, the fixed rerun's files hold that run alone, and a run that
    finished a step is still refused."""
    run = tmp_path / "run"
    x = torch.randn(4, 6)

    class Broken(nn.Linear):
        def forward(self, inputs):
            raise RuntimeError("the user's bug")

    with pytest.raises(RuntimeError, match="the user's bug"):
        _trainer(Broken(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=2)
    left = sorted(p.name for p in run.iterdir() if p.name != ".syncwise.lock")
    assert "metrics.jsonl" in left and not (run / "metrics.jsonl").read_text().strip()
    capsys.readouterr()
    summary = _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=2)
    assert summary["steps"] == 2
    (aside,) = (run / "failed-starts").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == left  # moved whole, nothing deleted
    err = capsys.readouterr().err
    assert f"syncwise: {run} held only what a start that never finished a step left ({', '.join(left)}); moved it " \
        f"to {aside} (nothing deleted), starting afresh" in err.splitlines(), err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.raises(SyncwiseError, match="already holds a run"):
        _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=2)
    assert len(list((run / "failed-starts").iterdir())) == 1


def test_a_run_that_fails_after_its_first_rows_is_not_overwritten_by_a_rerun_in_the_same_process(tmp_path):
    """A notebook's next cell: the failed run's lock (and the variable saying a launcher holds it) must not outlive
    it, or the rerun skips the claim and replaces the rows."""
    run = tmp_path / "run"
    x = torch.randn(4, 6)

    with pytest.raises(RuntimeError, match="step 3"):
        _trainer(FailsAtStep3(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=6)
    rows = (run / "metrics.jsonl").read_text()
    assert rows.strip()  # the steps that finished were logged
    with pytest.raises(SyncwiseError, match="already holds a run \\(metrics.jsonl\\)"):
        _trainer(nn.Linear(6, 6), loss_fn=F.mse_loss, run_dir=str(run)).train([(x, x)], steps=2)
    assert (run / "metrics.jsonl").read_text() == rows
    assert not (run / "failed-starts").exists()


def test_a_mapping_model_without_a_loss_names_loss_fn():
    data = [{"input_ids": r["input_ids"]} for r in _rows(4)]
    with pytest.raises(ConfigError, match="'loss_fn'.*model\\(\\*\\*batch\\) returned Output with no loss"):
        _trainer().train(DataLoader(data, batch_size=2), steps=1)


def test_pipeline_refuses_mappings_in_one_line():
    with pytest.raises(ConfigError, match="with keys \\['input_ids', 'labels'\\]; OptimizedTrainer accepts "
                                          "\\(inputs, targets\\) tuples with pipeline parallel"):
        batches.as_pair({"input_ids": torch.zeros(1), "labels": torch.zeros(1)}, pipeline=True)
    assert batches.as_pair([1, 2]) == (1, 2)


def _two_ranks_mapping_powersgd_resume(root):
    """Straight 6 steps vs 3 steps + a resumed run to 6, a mapping batch and a model returning its loss, PowerSGD:
    run under torchrun (the trainer joins the job from torchrun's environment), each rank writes what it saw."""
    import json
    import os

    def run(ckpt, steps, resume=None):
        trainer = _trainer(compress_gradients="powersgd:rank=2", min_numel=16)
        loader = DataLoader(_rows(64), batch_size=4, shuffle=True)
        summary = trainer.train(loader, steps=steps, checkpoint_dir=f"{root}/{ckpt}", resume=resume)
        return trainer, summary

    straight, s1 = run("a", 6)
    run("b", 3)
    resumed, s2 = run("b", 6, resume="auto")
    out = (s1["steps"], s2["steps"], s1["comm_bytes_per_step"], straight.tokens_seen,
           _params(straight).tolist(), _params(resumed).tolist())
    with open(f"{root}/rank{os.environ['RANK']}.json", "w") as f:
        json.dump(out, f)


def test_mapping_batches_under_torchrun_with_powersgd_and_resume(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from distributed import free_port

    script = tmp_path / "job.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      f"from test_batch_shapes import _two_ranks_mapping_powersgd_resume\n"
                      f"_two_ranks_mapping_powersgd_resume({str(tmp_path)!r})\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for steps_a, steps_b, comm, tokens, straight, resumed in out:
        assert steps_a == steps_b == 6 and comm > 0
        assert tokens == 6 * 4 * SEQ * 2  # the job's tokens: this rank's batches × 2 ranks
        assert resumed == straight  # the resume is exact
    assert out[0][4] == out[1][4]  # one model, trained together


def test_a_real_hugging_face_model_trains_from_its_own_batches():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                    bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    rows = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"].long(), "labels": r["input_ids"]}
            for r in _rows(8)]
    summary = _trainer(model).train(DataLoader(rows, batch_size=4), steps=2)
    assert summary["steps"] == 2 and summary["final_loss"] > 0
