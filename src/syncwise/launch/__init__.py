"""Launching workers: local (torchrun's elastic API), the network lab, Slurm/Kubernetes generation."""
from .local import free_port, run_local, threads_per_worker

__all__ = ["run_local", "free_port", "threads_per_worker"]
