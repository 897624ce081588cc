import os

# Tests share 2 cores: keep each process to one thread so multi-process tests do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every collective syncwise issues is checked against the backend its group would have on a GPU run (issue 24:
# a CPU tensor on an NCCL-only group killed every multi-GPU run before step 1). Subprocesses inherit it.
os.environ.setdefault("SYNCWISE_STRICT_DEVICES", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _forget_declared_backends():
    """A backend one test declared (join_torchrun, CommContext) does not loosen the strict check of the next."""
    yield
    from syncwise.comm import ops

    ops.declare_backend(None)
