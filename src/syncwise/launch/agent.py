"""``python -m syncwise.launch.agent TORCHRUN_ARGS ...``: torchrun's elastic agent, with an exit code that says
when the job stopped for preemption.

torchrun forwards SIGTERM (and SIGUSR1, when given ``--signals-to-handle``) to its workers and waits for them,
then dies of the signal itself (exit 1, a traceback): the workers' own exit code — 83, "stopped and saved" — is
lost. This wrapper runs the very same agent (``torch.distributed.run.run``, same arguments) and, when the workers
left ``RUN_DIR/preempted.json``, prints what they saved and exits with their code (83, or 84 when the grace ran
out). So a scheduler can tell a preemption from a failure by the exit code alone: the generated Slurm script
requeues on it, the Kubernetes JobSet's podFailurePolicy ignores it (a replacement pod resumes).
It is also PID 1 of the Kubernetes container: a Python process that handles SIGTERM, unlike a shell.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ..train.preemption import describe, read_marker


def _run_dir(args: list[str]) -> Optional[str]:
    for i, a in enumerate(args):
        if a == "--run-dir" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


def main(argv: Optional[list[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .. import bind, live_env
    from .local import parse_nnodes

    argv = sys.argv[1:] if argv is None else argv
    args = get_args_parser().parse_args(argv)
    # This node's endpoints (rendezvous store, workers' store, live recovery's manager and heal server) listen on
    # the job's address only: loopback when the whole job is on this machine, else this node's own address
    bind.register_rendezvous()
    if not os.environ.get(bind.ENV_BIND):
        bind.job_env(args.local_addr or bind.bind_host_for(parse_nnodes(args.nnodes)[1], args.rdzv_endpoint,
                                                           os.environ.get(live_env.LIGHTHOUSE, "")))
    if not args.local_addr:  # (the workers' store: rank 0's node advertises, and listens on, this address)
        args.local_addr = os.environ[bind.ENV_BIND]
    if args.rdzv_backend == "c10d":  # (the same rendezvous, its store bound by the rule)
        args.rdzv_backend = bind.RDZV_BACKEND
    run_dir = _run_dir(list(args.training_script_args))
    try:
        run(args)
        return 0
    except (SignalException, ChildFailedError) as e:
        record = read_marker(run_dir)
        if record:
            print(f"syncwise: {describe(record, run_dir)}", file=sys.stderr, flush=True)
            return int(record.get("exit_code", 83))
        if isinstance(e, SignalException):
            print(f"syncwise: the agent got {e.sigval.name}; the workers saved nothing new", file=sys.stderr)
            return 128 + int(e.sigval)
        rank, failure = e.get_first_failure()
        print(f"syncwise: worker rank {rank} failed (exit code {failure.exitcode})", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
