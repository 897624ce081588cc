import os

# Tests share 2 cores: keep each process to one thread so multi-process tests do not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")
