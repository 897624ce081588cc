"""syncwise.lab: an emulated multi-node cluster on one host (network namespaces + tbf-shaped links)."""
from .cluster import (LabNode, LabState, check_supported, down, exec_in, format_rate, parse_rate, qdisc_stats,
                      require, shape, state_path, status, up)
from .launch import lab_python, lab_torchrun
from .sizing import equivalent_rate

__all__ = ["LabNode", "LabState", "up", "down", "status", "shape", "require", "exec_in", "qdisc_stats",
           "check_supported", "parse_rate", "format_rate", "state_path", "lab_torchrun", "lab_python",
           "equivalent_rate"]
