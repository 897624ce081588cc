"""syncwise.checkpoint: SmartCheckpointer (DCP, async, atomic publish, Young/Daly interval) and the
train state (global and per-rank ``Stateful`` components)."""
from .checkpointer import SaveStats, SmartCheckpointer, load
from .interval import DEFAULT_MTBF_S, parse_interval, young_daly_interval_s
from .state import Counters, ModelOptimizerState, RNGState, Stateful, TrainState
from .storage import corrupt_checkpoint, latest_valid, read_manifest, verify_checkpoint

__all__ = ["SmartCheckpointer", "SaveStats", "load", "latest_valid", "verify_checkpoint", "read_manifest",
           "corrupt_checkpoint", "TrainState", "Stateful", "ModelOptimizerState", "RNGState", "Counters",
           "young_daly_interval_s", "parse_interval", "DEFAULT_MTBF_S"]
