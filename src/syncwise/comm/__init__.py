"""Communication: instrumented collectives, CommContext, topology-aware collectives, comm-bench."""
from .context import CommContext, Topology
from .ops import all_gather, all_reduce, all_to_all, broadcast, reduce_op, reduce_scatter
from .stats import CommLedger, CommStats
from .topology import TopoAwareCollective, topo_allreduce_hook

# syncwise.comm.bench is not imported here: it is also run as `python -m syncwise.comm.bench`.
__all__ = ["CommLedger", "CommStats", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
           "reduce_op", "CommContext", "Topology", "TopoAwareCollective", "topo_allreduce_hook"]
