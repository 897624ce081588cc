"""syncwise.plan: which layout to use on a cluster, before paying for it (pure Python, no torch.distributed).

``CloudConfig`` (+ cluster TOML and a hardware catalog with sources), model descriptions (presets, Hugging Face
``config.json``, TOML), memory per rank, step time per layout, ``predict`` and ``search``. Assumptions:
docs/plan.md. ``import syncwise.plan`` loads no torch; deciding whether syncwise can run a layout
(``syncwise_rules=True``) and reading a preset import syncwise.parallel / syncwise.models on first use.
"""
from .cloud import ACCELERATORS, FABRICS, Accelerator, CloudConfig, Fabric, cloud_from_dict, cluster, load_cluster
from .cost import Prediction, bus_factor, collective_time, compressor_wire, predict
from .emit import PlannedRun, not_a_preset, train_config
from .layout import MEGATRON, SYNCWISE, Layout, Training, parse_layout, syncwise_refusal
from .memory import Memory, memory_per_rank
from .model import ModelSpec, from_hf_config, from_model_config, from_preset, from_toml_dict, load_model
from .search import explain, search
from .check import check_training_run as _check_training_run

# The trainer (a layer below) reaches the planner's layout check through the CloudConfig it is given; the method
# is attached here so that cloud.py need not import check.py, which imports cloud.py (no import cycle in plan/).
CloudConfig.check_training_run = _check_training_run  # type: ignore[attr-defined]

__all__ = [
    "CloudConfig", "Accelerator", "Fabric", "ACCELERATORS", "FABRICS", "cluster", "cloud_from_dict", "load_cluster",
    "ModelSpec", "load_model", "from_hf_config", "from_preset", "from_model_config", "from_toml_dict",
    "Layout", "parse_layout", "Training", "SYNCWISE", "MEGATRON", "syncwise_refusal",
    "Memory", "memory_per_rank", "Prediction", "predict", "bus_factor", "collective_time", "compressor_wire",
    "search", "explain", "train_config", "PlannedRun", "not_a_preset",
]
