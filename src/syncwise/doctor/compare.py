"""Two runs side by side: which parts of the step changed, by how much, and what differs between the runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .analyze import PART_WORDS, PARTS, Diagnosis

_IGNORED = {"run_dir", "resume"}


def config_changes(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every configuration value that differs (sections flattened)."""
    out = []
    for key in sorted(set(a) | set(b)):
        if not prefix and key in _IGNORED:
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) or isinstance(vb, dict):
            out.extend(config_changes(va if isinstance(va, dict) else {}, vb if isinstance(vb, dict) else {},
                                      f"{prefix}{key}."))
        elif va != vb:
            out.append((f"{prefix}{key}", va, vb))
    return out


@dataclass
class Comparison:
    """Run B against run A."""

    a: Diagnosis
    b: Diagnosis
    changes: list[tuple[str, Any, Any]]
    parts: list[tuple[str, float, float]] = field(default_factory=list)   # (part, a seconds, b seconds), by |Δ|
    summary: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a.as_dict(), "b": self.b.as_dict(),
                "config_changes": [{"key": k, "a": va, "b": vb} for k, va, vb in self.changes],
                "parts": [{"part": k, "a_s": x, "b_s": y, "delta_s": y - x} for k, x, y in self.parts],
                "wall_step_s": {"a": self.a.wall_s, "b": self.b.wall_s},
                "efficiency": {"a": self.a.efficiency, "b": self.b.efficiency}, "summary": self.summary}


def compare(a: Diagnosis, b: Diagnosis) -> Comparison:
    """Explain how ``b``'s step differs from ``a``'s: the parts that moved most, and the findings behind them."""
    parts = sorted(((k, a.parts[k], b.parts[k]) for k in PARTS), key=lambda t: -abs(t[2] - t[1]))
    c = Comparison(a, b, config_changes(a.run.config, b.run.config), parts)
    delta = b.wall_s - a.wall_s
    ratio = b.wall_s / a.wall_s if a.wall_s else float("inf")
    verb = "slower" if delta > 0 else "faster"
    lines = [f"B's step is {abs(delta) * 1e3:,.0f} ms {verb} than A's ({a.wall_s * 1e3:,.0f} → {b.wall_s * 1e3:,.0f} "
             f"ms, ×{ratio:.2f}; efficiency {a.efficiency:.2f} → {b.efficiency:.2f})."]
    moved = [(k, x, y) for k, x, y in parts if abs(y - x) >= 0.1 * abs(delta) and abs(y - x) > 1e-4][:3]
    for k, x, y in moved:
        why = _why(k, a, b)
        lines.append(f"{PART_WORDS[k]}: {x * 1e3:,.0f} → {y * 1e3:,.0f} ms ({(y - x) * 1e3:+,.0f} ms)"
                     + (f" — {why}" if why else ""))
    if c.changes:
        shown = ", ".join(f"{k}: {va!r} → {vb!r}" for k, va, vb in c.changes[:6])
        lines.append(f"configuration differences: {shown}" + (" ..." if len(c.changes) > 6 else ""))
    else:
        lines.append("the configurations are the same (or not recorded): the difference is the machine or the run")
    c.summary = "\n".join(lines)
    return c


_CAUSE_OF_PART = {"straggler_wait": ("straggler",), "data_wait": ("data_loader",), "compress": ("compression",),
                  "comm_dp": ("link", "buckets_too_small", "buckets_too_large"), "pp_bubble": ("pipeline_bubble",),
                  "expert_wait": ("expert_imbalance",), "checkpoint": ("checkpoint",)}


def _why(part: str, a: Diagnosis, b: Diagnosis) -> str:
    """The finding of the run where ``part`` is larger that explains it."""
    bigger = b if b.parts[part] > a.parts[part] else a
    name = "B" if bigger is b else "A"
    for f in bigger.findings:
        if f.cause in _CAUSE_OF_PART.get(part, ()):
            return f"in {name}: {f.title}: {f.evidence}"
    return ""
