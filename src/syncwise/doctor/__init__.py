"""syncwise.doctor: why a run is slow — where its step goes, the causes ranked by time lost, what to change.

Pure Python over a run directory (no torch): ``load_run`` reads it, ``diagnose`` splits the step and ranks the
causes (predicting each recommendation's gain with ``syncwise.plan.whatif``), ``compare`` explains two runs'
difference. docs/doctor.md.
"""
from .analyze import CAUSES, PARTS, Diagnosis, Finding, diagnose
from .compare import Comparison, compare
from .report import headline, print_comparison, print_diagnosis
from .rundir import Run, load_run

__all__ = ["load_run", "Run", "diagnose", "Diagnosis", "Finding", "CAUSES", "PARTS", "compare", "Comparison",
           "print_diagnosis", "print_comparison", "headline"]
