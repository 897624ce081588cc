"""torchft's DiLoCo as a peer of the time-to-loss benchmark (issue 26): an independently written DiLoCo, on gloo.

torchft (``pip install torchft``; 0.2.0 imports on CPU with torch 2.13) needs, besides the training loop:

- a **lighthouse**: ``torchft._torchft.LighthouseServer(bind="[::]:0", min_replicas=R)`` (a Rust server shipped in
  the wheel), started once per job — here in the parent process;
- per replica group a **Manager** with its own ``ProcessGroupGloo``, a TCPStore (``store_addr``/``store_port``), a
  ``replica_id``, the lighthouse address, ``use_async_quorum=False`` (DiLoCo requires it) and
  ``state_dict``/``load_state_dict`` callbacks (used to heal a replica that joins late);
- the inner optimizer's steps wrapped in ``torchft.local_sgd.DiLoCo(manager, [model], inner_opt, outer_opt,
  sync_every=H)``: its step hook averages the pseudo-gradients every H steps and steps the outer optimizer
  (SGD lr 0.7, momentum 0.9, Nesterov, as torchft's own tests and the paper).

Each replica group here is one process (world size 1 inside the group; R groups = R data-parallel replicas), built
from the same ``RunConfig`` as a ``syncwise train`` run: model, corpus, data shard, AdamW and LR schedule, held-out
batches. Replica r writes ``metrics.r.jsonl``; the parent writes ``metrics.jsonl`` (replica 0's steps, the
validation loss averaged over the replicas' shards, as syncwise's trainer averages it) and ``summary.json``.
torchft's collectives bypass syncwise.comm: ``comm_bytes`` is the nominal fp32 pseudo-gradient a replica hands to
its all-reduce at a sync step (4 B × parameters), as syncwise counts its own all-reduces.

    python benchmarks/torchft_diloco.py --run-dir runs/tft --preset tiny --steps 60 --period 8 --replicas 2
    python benchmarks/time_to_loss.py --lab 20mbit --configs diloco:period=16 --peers torchft-diloco:period=16

Across the network lab (``cfg.dist.lab``, ``time_to_loss.py --lab``): the lighthouse runs on lab node 0 and replica
``r`` on node ``r``, inside the node's namespaces, so its all-reduces cross the shaped link.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def run(cfg: Any, period: int, replicas: int, threads: int, lab_prefix: "str | None" = None) -> dict[str, Any]:
    """Train ``cfg`` (a RunConfig; its run_dir receives the files) with torchft's DiLoCo; return the summary.

    ``lab_prefix``: across the network lab instead of this host's loopback (``cfg.dist.lab``): the lighthouse on
    node 0 and replica ``r`` on node ``r`` (one replica per node), each in the node's network namespace and a UTS
    namespace named after it (``syncwise.launch.ft_lab.in_node``: torchft advertises its host name), so the
    pseudo-gradient all-reduces cross the lab's shaped link as syncwise's own do."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    procs: list[subprocess.Popen] = []
    logs = []
    state = lighthouse = server = None
    try:
        if cfg.dist.lab:
            from syncwise.lab.cluster import PREFIX, require
            from syncwise.launch.ft import _lighthouse_program
            from syncwise.launch.ft_lab import in_node, wait_listening
            from syncwise.live_env import HOST

            state = require(lab_prefix or PREFIX)
            if replicas != state.num_nodes:
                from syncwise.errors import ConfigError

                raise ConfigError("dist.nproc", cfg.dist.nproc, f"1 per lab node for torchft-diloco (one replica per "
                                  f"node; the lab has {state.num_nodes} nodes, {replicas} replicas asked)")
            port = random.randint(20000, 28999)
            logs.append(open(run_dir / "lighthouse.log", "wb"))
            lighthouse = subprocess.Popen(in_node(state, 0, [_lighthouse_program(), "--bind", f"[::]:{port}",
                                                             "--min_replicas", str(replicas)]),
                                          stdout=logs[-1], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
            wait_listening(state, 0, port, lighthouse, run_dir / "lighthouse.log")
            address = f"http://{state.node(0).namespace}:{port}"
        else:
            from torchft._torchft import LighthouseServer

            server = LighthouseServer(bind="[::]:0", min_replicas=replicas)
            address = server.address()
        for r in range(replicas):
            logs.append(open(run_dir / f"replica{r}.log", "wb"))
            argv = [sys.executable, __file__, "--worker", "--run-dir", str(run_dir), "--replica", str(r),
                    "--replicas", str(replicas), "--period", str(period), "--lighthouse", address]
            renv = env if state is None else {**env, "GLOO_SOCKET_IFNAME": state.node(r).ifname,
                                               HOST: state.node(r).namespace}
            procs.append(subprocess.Popen(argv if state is None else in_node(state, r, argv), env=renv,
                                          stdout=logs[-1], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=state is not None))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs + ([lighthouse] if lighthouse is not None else []):
            if p.poll() is None:
                if state is not None:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
                p.wait()
        if server is not None:
            server.shutdown()
        for log in logs:
            log.close()
    if any(codes):
        from syncwise.errors import SyncwiseError

        raise SyncwiseError(f"a torchft replica failed (exit codes {codes}); see {run_dir}/replica*.log")
    return merge(run_dir, replicas, period)


def merge(run_dir: Path, replicas: int, period: int) -> dict[str, Any]:
    """metrics.jsonl (replica 0's steps, validation loss averaged over the replicas) and summary.json."""
    rows = [[json.loads(line) for line in (run_dir / f"metrics.{r}.jsonl").read_text().splitlines()]
            for r in range(replicas)]
    merged = []
    for steps in zip(*rows):
        row = dict(steps[0])
        vals = [s["val_loss"] for s in steps if s.get("val_loss") is not None]
        if vals:
            row["val_loss"] = sum(vals) / len(vals)
        merged.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in merged))
    cut = max(1, len(merged) // 10)  # as syncwise's summary: the first steps' one-off costs left out of rates
    steady = merged[cut:] or merged
    summary = {"steps": len(merged), "world_size": replicas, "final_loss": merged[-1]["loss"],
               "final_val_loss": next((r["val_loss"] for r in reversed(merged) if r.get("val_loss") is not None), None),
               "mean_step_time_s": sum(r["step_time_s"] for r in steady) / len(steady),
               "comm_bytes_per_step": sum(r["comm_bytes"] for r in steady) / len(steady),
               "comm_exposed_share": None, "peak_mem_mb": None, "compressor": "torchft DiLoCo",
               "sync": f"torchft-diloco:period={period}"}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from syncwise.config import build_config
    from syncwise.data import TokenBatchLoader, evaluation_batches, load_corpus
    from syncwise.models import build_model, count_params
    from syncwise.train import adamw, warmup_cosine
    from syncwise.live_env import HOST
    from syncwise.train.trainer import lm_loss

    run_dir, r, replicas = Path(args.run_dir), args.replica, args.replicas
    cfg = build_config(json.loads((run_dir / "config.json").read_text()), {})
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(cfg.data.corpus, val_fraction=cfg.data.val_fraction)
    model = build_model(cfg.model.preset, vocab_size=corpus.vocab_size, seq_len=cfg.data.seq_len)
    inner = adamw(model, cfg.train.lr, cfg.train.weight_decay)
    schedule = warmup_cosine(inner, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    loader = iter(TokenBatchLoader(corpus.train, cfg.data.batch_size, cfg.data.seq_len, r, replicas, seed=cfg.train.seed))
    val = evaluation_batches(corpus.val, cfg.data.batch_size, cfg.data.seq_len, cfg.train.val_batches, r, replicas)
    # the peers reach this replica's store at its advertised host (the lab node's name; torchft's manager
    # hands store_addr to the other replicas for the cross-replica process group)
    host = os.environ.get(HOST, "localhost")
    store = dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=replicas, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica{r}", store_addr=host, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, port=_free_port(), timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=60))
    n_params = count_params(model)
    tokens = cfg.data.batch_size * cfg.data.seq_len * replicas
    out = open(run_dir / f"metrics.{r}.jsonl", "w")
    with DiLoCo(manager, [model], inner, outer, sync_every=args.period, backup_device=torch.device("cpu"),
                pin_memory=False):
        for step in range(1, cfg.train.steps + 1):
            start = time.perf_counter()
            x, y = next(loader)
            loss = lm_loss(model(x), y)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad)
            inner.step()  # DiLoCo's step hook syncs every `period` steps (inside this call: timed)
            schedule.step()
            dt = time.perf_counter() - start
            row = {"step": step, "loss": float(loss.detach()), "step_time_s": dt, "tokens_per_s": tokens / dt,
                   "comm_bytes": 4 * n_params if step % args.period == 0 else 0}
            if cfg.train.val_interval and (step % cfg.train.val_interval == 0 or step == cfg.train.steps) or \
                    step == cfg.train.steps:
                model.eval()
                with torch.no_grad():
                    row["val_loss"] = sum(float(lm_loss(model(vx), vy)) for vx, vy in val) / len(val)
                model.train()
            out.write(json.dumps(row) + "\n")
            out.flush()
    out.close()
    print(f"torchft: replica {r} finished {cfg.train.steps} steps, {manager.current_step()} outer steps", flush=True)
    manager.shutdown(wait=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--period", type=int, default=16, help="sync_every H (default 16)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from syncwise.config import build_config
    from syncwise.launch.local import threads_per_worker

    overrides = dict(s.split("=", 1) for s in args.sets)
    cfg = build_config(None, {"model.preset": args.preset, "train.steps": str(args.steps), "run_dir": args.run_dir,
                              **overrides})
    print(json.dumps(run(cfg, args.period, args.replicas, threads_per_worker(args.replicas)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
