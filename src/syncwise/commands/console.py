"""Where a command's console goes while the workers it starts run (they inherit file descriptors 1 and 2)."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


@contextlib.contextmanager
def output_to(path: Path):
    """Everything written to this process's stdout/stderr -- and its workers', which inherit them -- goes to
    ``path`` for the duration: `syncwise bench` prints its table while each run's summary and progress stay in its run
    directory; auto's start-up probe prints one line per probe."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        # Python-level writers too, where sys.stdout is not file descriptor 1 (e.g. under a capturing harness)
        with open(path, "a", buffering=1) as text, contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
