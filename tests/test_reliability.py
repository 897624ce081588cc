"""Pieces the reliability benchmark relies on: restart detection agreed across nodes, save-overlap metrics."""
import json
import os
import threading

import torch

from distributed import run_workers
from helpers import GatedCheckpointer
from syncwise.config import build_config
from syncwise.data import TokenBatchLoader
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw
from syncwise.commands.worker import resume_target


def _resume_decisions(rank, world, scenarios):
    decisions = []
    for counts in scenarios:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(counts[rank])
        decisions.append(resume_target(build_config(), rank))
    return decisions


def test_restart_seen_by_one_agent_makes_every_rank_resume():
    # As after a 2-node restart: the agent whose worker died counted a restart, the other agent restarted
    # its workers as a membership change and still says 0. Both ranks must resume, or neither.
    by_rank = run_workers(_resume_decisions, 2, [[0, 1], [0, 0]])
    assert by_rank == [["auto", "none"], ["auto", "none"]]


def test_in_flight_flag_and_save_costs(tmp_path):
    torch.manual_seed(0)
    gate = threading.Event()
    model = build_model("tiny", seq_len=16)
    tokens = torch.randint(0, 256, (5_000,), generator=torch.Generator().manual_seed(1))
    ckpt = GatedCheckpointer(tmp_path / "ck", interval=2, gate=gate)
    trainer = OptimizedTrainer(model, adamw(model, 1e-3, 0.0), run_dir=str(tmp_path),
                               checkpointer=ckpt)
    step_fn = trainer._train_step

    def step(batches):
        result = step_fn(batches)
        if trainer.step + 1 == 4:  # the save of step 2 stays unpublished through steps 3 and 4
            gate.set()
        return result

    trainer._train_step = step
    summary = trainer.train(TokenBatchLoader(tokens, 2, 16, 0, 1, seed=0), steps=5)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flags = [r["ckpt_in_flight"] for r in rows]
    assert flags[:4] == [False, False, True, True]
    assert all(isinstance(f, bool) for f in flags)
    saves = summary["checkpoint_saves"]
    assert [s["step"] for s in saves] == [2, 4, 5]
    assert all(0 < s["blocking_s"] <= s["total_s"] and s["bytes"] > 0 for s in saves)
