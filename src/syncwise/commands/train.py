"""`syncwise train`: validate the configuration, then start the workers (local, or across the lab)."""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from ..config import RunConfig, add_train_arguments, build_config, describe_fields, load_file, overrides_from_args
from ..errors import SyncwiseError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..compress import describe_compressors

    add_train_arguments(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("Every configuration field can be set as --section.key=value (or in a TOML file):\n"
                     + describe_fields() + "\n\nGradient compressors (--compress NAME[:key=value,...]):\n"
                     + describe_compressors())


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Choose/create the run directory; refuse to overwrite a previous run unless resuming it."""
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(cfg.run_dir)
    previous = [n for n in ("metrics.jsonl", "summary.json", "checkpoints") if (run_dir / n).exists()]
    if previous and cfg.resume == "none":
        raise SyncwiseError(
            f"the run directory {run_dir} already holds a run ({', '.join(previous)}). Nothing was started, so "
            "nothing of it is overwritten: pass --resume auto to continue that run, or choose another --run-dir.")
    saved = run_dir / "config.json"
    if previous and saved.exists():
        before = json.loads(saved.read_text())
        for section in ("model", "data"):
            for key, old in before.get(section, {}).items():
                new = getattr(getattr(cfg, section), key, old)
                if section == "model" or key in ("seq_len", "corpus"):
                    if new != old:
                        raise SyncwiseError(
                            f"--resume: the run in {run_dir} was trained with {section}.{key}={old!r}, not {new!r}; "
                            "its checkpoints cannot continue under a different model or data layout. Resume with "
                            "the original setting, or start a new run with another --run-dir.")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(saved)
    return run_dir


def launch(cfg: RunConfig) -> dict:
    """Start the workers for ``cfg`` and return rank 0's summary."""
    from ..train.main import run_worker

    if cfg.dist.lab:
        from ..lab.launch import lab_torchrun

        code = lab_torchrun(["-m", "syncwise.train", "--config", str(Path(cfg.run_dir) / "config.json")],
                            nproc_per_node=cfg.dist.nproc, max_restarts=cfg.dist.max_restarts)
        if code != 0:
            raise SyncwiseError(f"the lab job failed (exit code {code}); see the worker output above")
        return json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    if cfg.dist.nproc == 1 and cfg.dist.max_restarts == 0 and cfg.dist.nnodes == "1":
        return run_worker(cfg)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..launch import run_local

    try:
        results = run_local(run_worker, cfg.dist.nproc, cfg, max_restarts=cfg.dist.max_restarts,
                            log_dir=str(Path(cfg.run_dir) / "logs"), nnodes=cfg.dist.nnodes)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        raise SyncwiseError(f"worker rank {rank} failed: {message or 'exit code ' + str(failure.exitcode)}"
                            f" (worker logs: {Path(cfg.run_dir) / 'logs'}; SYNCWISE_DEBUG=1 shows the agent's "
                            "tracebacks)") from None
    return results[0]


def run(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = build_config(load_file(args.config) if args.config else None, overrides_from_args(args, extra))
    run_dir = prepare_run_dir(cfg)
    summary = launch(cfg)
    print(f"run directory: {run_dir}  (final loss {summary.get('final_loss'):.4f}, "
          f"val loss {summary.get('final_val_loss') or float('nan'):.4f})")
    return 0

