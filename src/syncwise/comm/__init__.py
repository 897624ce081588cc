"""Communication: instrumented collectives, CommContext, topology-aware collectives, comm-bench."""
from .ops import all_gather, all_reduce, all_to_all, broadcast, reduce_op, reduce_scatter
from .stats import STATS, CommStats

__all__ = ["STATS", "CommStats", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
           "reduce_op"]
