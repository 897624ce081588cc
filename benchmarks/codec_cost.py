"""What a compressor's encode + decode costs on this CPU, against what the planner charges for it (issue 28).

The planner prices a compressor's own compute (its prediction's ``compress_compute``) from the accelerator's
measured codec cost (``[accelerator.codec_cost]``: ns per element + µs per tensor, written by ``syncwise plan
--calibrate`` from two synthetic gradient sets and the reference preset's) where it has one, else as memory
traffic per element (``CODEC_COST``) at the memory bandwidth plus FLOPs at half the peak. "priced" below is that term of ``predict``
for 2 data-parallel ranks (``--peers``) of the same preset, on the catalog's ``cpu-lab`` worker (which carries this
VM's calibration), ``--cluster FILE`` (a calibrated TOML), or ``--uncalibrated`` (CODEC_COST alone, as before the
calibration existed). This measures the real thing: each compressor averages a
model's gradient-shaped tensors bucket by bucket in a 1-rank gloo group (``syncwise.compress.profile_compressor``:
the collectives are local copies, so the time is the compressor's compute), 1 thread, median of ``--steps`` steps,
and prints measured / priced per step. ``--compress auto`` picked fp8 at 1 Gbit/s where it measured 1.11× slower
than the best (benchmarks/RESULTS.md §15); this says by how much the codec is underpriced.

    python benchmarks/codec_cost.py [--presets tiny,small] [--steps 5] [--cluster FILE | --uncalibrated]
                                    [--json benchmarks/results/codec-cost.json]

Run it on a quiet machine: it is a timing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# PowerSGD from its first step (its default start_iter=10 would time 10 uncompressed steps)
SPECS = ("fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.01", "randomk:ratio=0.01", "powersgd:rank=4,start_iter=0",
         "demo")


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--specs", default=",".join(SPECS), help="compressor specs (a spec's own options after ':')")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peers", type=int, default=2, help="ranks the planner prices the decode for (default 2)")
    p.add_argument("--cluster", default=None, help="price with this cluster TOML's accelerator (default: cpu-lab)")
    p.add_argument("--uncalibrated", action="store_true", help="price with CODEC_COST alone (no codec_cost)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    from syncwise.commands.bench import split_configs
    from syncwise.compress import CompressionPolicy, model_gradients, parse_compress_spec, profile_compressor
    from syncwise.models import build_model
    from syncwise.plan import Layout, load_model, predict
    from syncwise.plan.cloud import cluster

    torch.set_num_threads(1)
    import dataclasses

    from syncwise.plan import load_cluster

    cloud = cluster("cpu-lab", args.peers, 1)
    if args.cluster:
        cloud = dataclasses.replace(cloud, accelerator=load_cluster(args.cluster).accelerator)
    if args.uncalibrated:
        cloud = dataclasses.replace(cloud, accelerator=dataclasses.replace(cloud.accelerator, codec_cost=()))
    priced_by = ("CODEC_COST" if not cloud.accelerator.codec_cost else
                 f"{cloud.accelerator.name}'s codec_cost" + (f" ({args.cluster})" if args.cluster else ""))
    rows = []
    for preset in [s for s in args.presets.split(",") if s]:
        model = build_model(preset)
        grads = model_gradients(model)
        spec_model = load_model(preset)
        elements = sum(t.numel() for _, t in grads)
        for spec in split_configs(args.specs):
            prof = profile_compressor(parse_compress_spec(spec), grads, policy=CompressionPolicy(), steps=args.steps)
            priced = predict(cloud, spec_model, Layout(dp_replicate=args.peers, compress=spec, micro_batch=1),
                             args.peers, syncwise_rules=False).breakdown["compress_compute"]
            measured = prof["ms_per_step"] / 1e3
            rows.append({"preset": preset, "spec": spec, "elements": elements, "buckets": prof["buckets"],
                         "measured_ms_per_step": 1e3 * measured, "priced_ms_per_step": 1e3 * priced,
                         "measured_over_priced": measured / priced if priced else None,
                         "measured_ns_per_element": 1e9 * measured / elements})
            r = rows[-1]
            print(f"{preset:6s} {spec:22s} measured {r['measured_ms_per_step']:8.2f} ms  priced "
                  f"{r['priced_ms_per_step']:7.2f} ms  x{(r['measured_over_priced'] or 0):6.1f}  "
                  f"({r['measured_ns_per_element']:.1f} ns/element)", flush=True)
    ratios = [r["measured_over_priced"] for r in rows if r["measured_over_priced"]]
    mae = sum(abs(1 / x - 1) for x in ratios) / max(len(ratios), 1)
    print(f"priced by {priced_by}: mean |priced / measured - 1| = {100 * mae:.1f} % over {len(ratios)} rows")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": "python benchmarks/codec_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": "2-core VM, 1 thread, nothing else running", "priced_by": priced_by,
            "mean_abs_error_of_price": mae,
            "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
