import os

# Tests share 2 cores: keep each process to one thread so multi-process tests do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every collective syncwise issues is checked against the backend its group would have on a GPU run (issue 24:
# a CPU tensor on an NCCL-only group killed every multi-GPU run before step 1). Subprocesses inherit it.
os.environ.setdefault("SYNCWISE_STRICT_DEVICES", "1")
