"""Pick a lab link rate that reproduces a real cluster's communication/computation ratio.

For data-parallel training the time on the wire per step is ``k * b * P * 8 / R`` (k = 2(n-1)/n for
a ring all-reduce, b bytes per gradient element on the wire, P parameters, R link rate in bit/s) and
the compute time is ``6 * P * T / F`` (T tokens per replica per step, F achieved FLOP/s). Their
ratio ``rho = k * 8 * b * F / (6 * T * R)`` does not depend on the model size P, so the lab matches
a real cluster when ``R_lab = R_real * (F_lab / F_real) * (T_real / T_lab) * (b_lab / b_real)``.
"""
from __future__ import annotations

from ..errors import ConfigError
from .cluster import format_rate, parse_rate

# Measured here (docs/network-lab.md): fwd+bwd of a 23.2 M-parameter GPT, batch 8 x 256, on one core
# takes ~3.5 s, i.e. ~87 GFLOP/s achieved. An H100 at a realistic 40-50 % MFU achieves ~400-500
# TFLOP/s in bf16: about 5,000x more.
DEFAULT_SLOWDOWN = 5000.0


def equivalent_rate(real_rate: str | int, slowdown: float = DEFAULT_SLOWDOWN, tokens_ratio: float = 1.0,
                    wire_bytes_ratio: float = 1.0) -> str:
    """The lab rate (tc units) giving the same comm/compute ratio as ``real_rate`` on the real cluster.

    ``slowdown`` = F_real / F_lab (per worker), ``tokens_ratio`` = T_real / T_lab (tokens per replica
    per step), ``wire_bytes_ratio`` = b_lab / b_real (e.g. 2.0 if the lab sends fp32 where the real
    run sends bf16). Example: 100gbit at the default slowdown -> '20mbit'.
    """
    bps = parse_rate(real_rate, "real_rate")
    for name, v in (("slowdown", slowdown), ("tokens_ratio", tokens_ratio), ("wire_bytes_ratio", wire_bytes_ratio)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(name, v, "a positive number")
    lab_bps = bps / slowdown * tokens_ratio * wire_bytes_ratio
    # Round to 3 significant figures so the result is a clean tc rate.
    return format_rate(parse_rate(int(float(f"{lab_bps:.3g}")), "equivalent rate"))
