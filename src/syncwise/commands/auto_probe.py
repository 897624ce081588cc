"""auto's start-up probe (``compress.auto_probe``, docs/plan.md "Choosing the communication strategy"): before a
`syncwise train --compress auto` / `--sync auto` job on the built-in (not calibrated) cluster starts, train fp32 DDP
and the catalog's top candidates for a few steps each on the job's own workers, so that auto ranks them by what
this machine and link do rather than by the catalog's figures (issue 41: 4 workers sharing 2 cores, an MoE model).

Each probe is the job itself (its model, batch, layout and workers, through the launch table as `syncwise train`
starts it) with the candidate's strategy, no periodic validation or checkpoints (one of each at its end), faults or
monitoring, in a temporary run directory that is removed after. Its step time is the mean of rank 0's logged step
times over the last whole sync periods (a local-SGD step is cheap until its period's average), after its warm-up
steps (the first steps' one-off costs and the strategy's own uncompressed start, ``trainer.warmup_steps``)."""
from __future__ import annotations

import copy
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from ..config import RunConfig
from ..rundir import RunDir
from .console import output_to

#: steps run before the measured window besides the strategy's own warm-up (allocator, DDP bucket rebuild)
FIRST_STEPS = 2


def window(steps: int, period: int) -> int:
    """The measured steps: at least ``steps``, whole sync periods, at least two of them (their spread is the
    error) when the strategy averages every ``period`` > 1 steps."""
    period = max(1, period)
    if period == 1:
        return max(2, steps)
    return period * max(2, math.ceil(steps / period))


def probe_config(cfg: RunConfig, ranked, run_dir: Path) -> tuple[RunConfig, int, int]:
    """The probe of one candidate (``plan.strategy.Ranked``): the job with its strategy, for its warm-up and its
    measured window; (the config, the measured steps, the strategy's sync period: 1 every step)."""
    from ..train.trainer import warmup_steps

    sub = copy.deepcopy(cfg)
    sub.compress.method = ranked.compress.text
    sub.parallel.sync = str(ranked.sync) if ranked.sync is not None else "every-step"
    sub.run_dir, sub.resume, sub.inject_fault = str(run_dir), "none", []
    sub.train.val_interval, sub.ckpt.interval = 0, "0"
    sub.metrics.prometheus_port, sub.metrics.wandb = 0, False
    specs = sub.specs()
    period = int(getattr(specs.sync, "period", 1) or 1) if specs.sync is not None else 1
    measured = window(cfg.compress.auto_probe, period)
    sub.train.steps = warmup_steps(specs.compress, specs.sync) + FIRST_STEPS + measured
    return sub, measured, period


def measure(rows: Sequence[dict], measured: int, period: int):
    """A probe's :class:`~syncwise.plan.strategy.Measured` from rank 0's metrics rows: the mean step over the last
    ``measured`` steps; its standard error from the spread of the periods' means (of the steps' own, every step)."""
    from ..plan.strategy import Measured

    times = [float(r.get("step_time_s") or 0.0) for r in sorted(rows, key=lambda r: r["step"])][-measured:]
    block = max(1, period)
    means = [sum(times[i:i + block]) / block for i in range(0, len(times) - block + 1, block)]
    mean = sum(times) / len(times)
    n = len(means)
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (n - 1)) if n > 1 else mean
    return Measured(step_s=mean, rel_se=sd / math.sqrt(n) / mean if mean else 1.0, steps=len(times))


def run_probes(cfg: RunConfig, candidates: Sequence, start: Callable[[RunConfig], object]) -> tuple[dict, float]:
    """Probe each candidate in turn (fp32 DDP first) by ``start(config)`` (``syncwise train``'s start of a job:
    ``commands.train.probe``); ({spec: Measured}, the seconds it all took). The probes' console output goes to a
    log; a probe that fails shows its tail and stops the start (the job would fail too)."""
    from ..errors import SyncwiseError
    from ..metrics import read_jsonl

    top = [r for r in candidates if r.spec != "none"]
    print(f"syncwise: auto: probing fp32 DDP and the catalog's top {len(top)} ("
          + ", ".join(f"{r.spec} ~{r.sooner:.2g}×" for r in top) + f") for about {cfg.compress.auto_probe} steps "
          "each on this job's workers (--compress.auto_probe=0: rank by the catalog's figures)",
          file=sys.stderr, flush=True)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="syncwise-auto-probe-"))
    log = tmp / "probe.log"
    out = {}
    try:
        for i, ranked in enumerate(candidates):
            sub, measured, period = probe_config(cfg, ranked, tmp / f"{i}")
            try:
                with output_to(log):
                    start(sub)
            except (SyncwiseError, OSError) as e:
                tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
                raise SyncwiseError(f"auto's probe of {ranked.spec} failed ({e}); its last lines:\n"
                                    + "\n".join(tail) + "\n(--compress.auto_probe=0 ranks by the catalog's "
                                    "figures without running it)") from None
            out[ranked.spec] = measure(read_jsonl(RunDir(sub.run_dir).metrics), measured, period)
            print(f"syncwise: auto: probe {ranked.spec}: {1000 * out[ranked.spec].step_s:.1f} ms per step over "
                  f"{measured} steps", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, time.monotonic() - began
