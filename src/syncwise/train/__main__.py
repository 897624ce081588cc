"""``torchrun ... -m syncwise.train [--config FILE] [--section.key=value ...]``: one worker of a job."""
import sys

from ..errors import SyncwiseError
from .main import run_worker
from ..config import config_from_argv


def main() -> int:
    try:
        run_worker(config_from_argv(sys.argv[1:]))
    except SyncwiseError as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
