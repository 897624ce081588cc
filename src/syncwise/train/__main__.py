"""``torchrun ... -m syncwise.train [--config FILE] [--section.key=value ...]``: one worker of a job."""
import os
import sys

from ..config import config_from_argv
from ..errors import SyncwiseError
from ..rundir import RunDirLock, held_by_launcher
from .main import run_worker


def main() -> int:
    try:
        cfg = config_from_argv(sys.argv[1:])
    except SyncwiseError as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return 2
    # Started by plain torchrun (not `syncwise train`, which holds the lock itself): rank 0 owns the run
    # directory for the life of the job.
    lock = None
    if cfg.run_dir and os.environ.get("RANK", "0") == "0" and not held_by_launcher(cfg.run_dir):
        try:
            lock = RunDirLock(cfg.run_dir).acquire()
        except SyncwiseError as e:
            print(f"syncwise: {e}", file=sys.stderr)
            return 2
    try:
        run_worker(cfg)  # prints its own failures
    except SyncwiseError:
        return 2
    finally:
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
