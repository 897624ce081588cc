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



# Under pytest-xdist (scripts/test.sh: -n 2) tests that use a machine-wide resource take turns: the network lab (one
# set of namespaces, `swlab`) and the local Slurm controller. A file lock held for the test's length, not xdist's
# groups (--dist loadgroup did not keep groups on one worker with pytest 9.2 / xdist 3.8 here); a worker waiting on
# it leaves its core to the test that holds it.
_SHARED = {"lab": ("test_lab.py", "test_ft_lab.py"), "slurm": ("test_launch_slurm.py",)}


def _shared_resource(item) -> "str | None":
    for name, files in _SHARED.items():
        if item.path.name in files:
            return name
    return "lab" if item.get_closest_marker("lab") else None


@pytest.fixture(autouse=True)
def _take_turns_on_shared_resources(request):
    name = _shared_resource(request.node)
    if name is None:
        yield
        return
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), f"syncwise-tests-{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
