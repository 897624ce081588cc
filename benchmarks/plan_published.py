"""The planner against published large-scale runs: prediction, error and where the published layout ranks in
the planner's own search, for every run in syncwise.plan.published (sources and assumptions listed there); and
against vTrain's 1,549 measured Megatron-DeepSpeed iteration times (published.vtrain_runs, the CSVs copied into
benchmarks/data/vtrain), by group and by hidden size, tp, micro-batch and pp; the uncertainty band `syncwise plan`
prints (syncwise.plan.uncertainty.BANDS: 10th-90th percentile of measured ÷ predicted, one node / multi-node);
the 7 B Llama on examples/clusters/h100-8x4-ib.toml at 1,024 × 4,096 tokens.

    python benchmarks/plan_published.py    # -> benchmarks/results/plan-published.json + benchmarks/planner_validation.md

Pure Python, seconds, no GPU: the runs are the publications' (A100 / H100 clusters of 2 to 16,384 GPUs).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from syncwise.plan.cloud import load_cluster  # noqa: E402
from syncwise.plan.model import ModelSpec  # noqa: E402
from syncwise.plan.published import evaluate, runs, vtrain_runs  # noqa: E402
from syncwise.plan.search import search  # noqa: E402
from syncwise.plan.uncertainty import accelerator_bands, bands  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VTRAIN_KEYS = ("name", "group", "gpus", "layout", "global_batch", "seq_len", "reported", "predicted", "error",
               "mfu", "dominant", "compute_share")
#: a run whose predicted step is at least this share GEMMs and element-wise compute: where the accelerator's
#: matmul efficiency alone decides the prediction
COMPUTE_BOUND = 0.9


def vtrain_summary(rows: list[dict]) -> dict:
    """Mean and mean absolute error of vTrain's one-node rows by hidden size, tp, micro-batch and pp."""
    out: dict = {}
    for key, pattern in (("hidden", r" h(\d+) "), ("tp", r" tp(\d+) "), ("micro_batch", r" mb(\d+) "),
                         ("pp", r" pp(\d+) ")):
        by: dict[int, list[float]] = {}
        for r in rows:
            by.setdefault(int(re.search(pattern, r["name"]).group(1)), []).append(r["error"])
        out[key] = {v: {"runs": len(e), "mean_error": sum(e) / len(e), "mean_abs_error": sum(map(abs, e)) / len(e)}
                    for v, e in sorted(by.items())}
    bound = [r for r in rows if r["compute_share"] >= COMPUTE_BOUND]
    out["compute_bound"] = {"share_at_least": COMPUTE_BOUND, "runs": len(bound),
                            "mean_error": sum(r["error"] for r in bound) / max(len(bound), 1),
                            "mean_abs_error": sum(abs(r["error"]) for r in bound) / max(len(bound), 1)}
    return out


def llama_7b_on_h100() -> dict:
    """The issue's check: a 7 B Llama on examples/clusters/h100-8x4-ib.toml, 1,024 × 4,096 tokens, the planner's
    best layout (syncwise's recipe, every compressor as `syncwise plan` searches)."""
    from syncwise.plan.search import DEFAULT_COMPRESS

    cloud = load_cluster(ROOT / "examples" / "clusters" / "h100-8x4-ib.toml")
    model = ModelSpec("llama-2-7b", 32000, 4096, 32, 32, 11008, seq_len=4096)
    best = search(cloud, model, 1024, 4096, top=1, compress=DEFAULT_COMPRESS)[0]
    return {"cluster": cloud.describe(), "model": model.describe(), "layout": best.layout.text(),
            "step_time_s": best.step_time_s, "mfu": best.mfu, "breakdown": best.breakdown}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "plan-published.json"))
    p.add_argument("--markdown", default=str(Path(__file__).parent / "planner_validation.md"))
    a = p.parse_args()
    rows = [evaluate(r) for r in runs()]
    vt = [evaluate(r, top_check=False) for r in vtrain_runs(ROOT / "benchmarks" / "data" / "vtrain")]
    confident = [r for r in rows if r["confident"]]
    mae = lambda rs: sum(abs(r["error"]) for r in rs) / len(rs) if rs else None  # noqa: E731
    base = [r for r in rows if r["group"] == "published"]
    mae0 = lambda rs: sum(abs(r["error_without_overheads"]) for r in rs) / len(rs) if rs else None  # noqa: E731
    groups = {}
    for g in dict.fromkeys(r["group"] for r in rows + vt):
        rs = [r for r in rows + vt if r["group"] == g]
        groups[g] = {"runs": len(rs), "mean_abs_error": mae(rs), "mean_abs_error_without_overheads": mae0(rs),
                     "mean_error": sum(r["error"] for r in rs) / len(rs),
                     "mean_error_without_overheads": sum(r["error_without_overheads"] for r in rs) / len(rs)}
    summary = {"runs": len(base), "publications": len({r["publication"] for r in base}),
               "mean_abs_error_all": mae(base), "mean_abs_error_confident": mae([r for r in confident if r in base]),
               "mean_error_all": sum(r["error"] for r in base) / len(base), "groups": groups,
               "paper_layout_in_top3": sum(1 for r in base if r.get("paper_layout_rank") and
                                           r["paper_layout_rank"] <= 3),
               "vtrain_one_node": vtrain_summary([r for r in vt if r["group"] == "vtrain one node"]),
               "bands": bands(rows + vt), "accelerator_bands": accelerator_bands(rows + vt),
               "llama_7b_h100_8x4": llama_7b_on_h100()}
    print(f"{'run':32s} {'layout':44s} {'metric':15s} {'reported':>9s} {'predicted':>9s} {'error':>7s} "
          f"{'before':>7s}  rank  top-3 (tp, pp)")
    for r in rows:
        flag = "" if r["confident"] else " (?)"
        print(f"{r['name'] + flag:32s} {r['layout'][:44]:44s} {r['metric']:15s} {r['reported']:9.2f} "
              f"{r['predicted']:9.2f} {r['error']:+7.1%} {r['error_without_overheads']:+7.1%}  "
              f"{str(r.get('paper_layout_rank')):>4s}  "
              f"{', '.join(r.get('planner_top3', []))}")
    print(json.dumps({k: v for k, v in summary.items() if k != "vtrain_one_node"}, indent=2))
    Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows,
                                        "vtrain_rows": [{k: r[k] for k in VTRAIN_KEYS} for r in vt]}, indent=1) + "\n")
    Path(a.markdown).write_text(markdown(rows, summary))
    print(f"wrote {a.json} and {a.markdown}")
    return 0


def _value(r: dict, x: float) -> str:
    return f"{x:.1f} s/iteration" if r["metric"] == "step_time_s" else f"{x:.1f} TFLOP/s/GPU"


def markdown(rows: list[dict], summary: dict) -> str:
    """benchmarks/planner_validation.md: every run with its source, prediction and error; the top-3 check."""
    pubs: dict[str, list[dict]] = {}
    for r in rows:
        pubs.setdefault(r["publication"], []).append(r)
    mae = lambda rs: sum(abs(r["error"]) for r in rs) / len(rs)  # noqa: E731
    out = ["# The planner against published large-scale runs", "",
           "Generated by `python benchmarks/plan_published.py` (pure Python, seconds; also writes "
           "`benchmarks/results/plan-published.json`). Each run's model, cluster, layout, batch and reported "
           "figure, with its source and what the publication does not say and we assumed, is in "
           "`src/syncwise/plan/published.py`. \"(?)\" marks figures quoted with less certainty (from memory, or an "
           "unknown FLOP convention): check them against the papers before citing this table. Predictions use "
           "the catalog's efficiencies as they are (A100 0.70, H100 0.65, NVLink 0.8, InfiniBand 0.9, RoCE "
           "0.85 — assumptions chosen before these comparisons, not fitted to them), and no per-run factor.", "",
           "The GEMM-shape (wave quantization over the SMs, roofline), per-kernel (host launch, device gap) and "
           "loss-traffic (HBM bytes per logit) terms use only cited or counted constants (the catalog in "
           "src/syncwise/plan/cloud.py, `Training.loss_bytes_per_logit`; docs/plan.md, Step time 1-1b); "
           "\"before\" is the same model with them off (`published.evaluate`'s `error_without_overheads`). Rows of the group *held-out small* and *moe* "
           "were added after those constants were set and never used to choose one.", "",
           "| group | runs | mean abs. error before | after | mean signed error before | after |",
           "|---|---|---|---|---|---|"]
    for g, v in summary["groups"].items():
        out.append(f"| {g} | {v['runs']} | {v['mean_abs_error_without_overheads']:.1%} | {v['mean_abs_error']:.1%} | "
                   f"{v['mean_error_without_overheads']:+.1%} | {v['mean_error']:+.1%} |")
    out += ["", "| run | group | source | layout | GPUs | reported | predicted | error | before | fits | "
            "paper's (tp, pp) rank | planner's top 3 (tp, pp) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = " (?)" if not r["confident"] else ""
        rank = r.get("paper_layout_rank")
        out.append(f"| {r['name']}{flag} | {r['group']} | {r['publication']}, {r['source']} | `{r['layout']}` | "
                   f"{r['gpus']} | {_value(r, r['reported'])} | {r['predicted']:.2f} | {r['error']:+.1%} | "
                   f"{r['error_without_overheads']:+.1%} | "
                   f"{'yes' if r['fits'] else 'no'} | {rank if rank else '–'} | {', '.join(r.get('planner_top3', [])) or '–'} |")
    out += ["", "## Summary", "",
            f"- The {summary['runs']} published runs from {summary['publications']} publications: mean absolute error "
            f"**{summary['mean_abs_error_all']:.1%}** over all, {summary['mean_abs_error_confident']:.1%} over the "
            f"{sum(r['confident'] for r in rows)} confident rows; mean signed error {summary['mean_error_all']:+.1%}.",
            "- Per publication: " + "; ".join(f"{k} {mae(v):.1%} ({len(v)} runs)" for k, v in pubs.items()) + ".",
            f"- Goal (issue 17): ≤ 5 % mean absolute error — **{'met' if summary['mean_abs_error_all'] <= 0.05 else 'not met'}** "
            f"over all runs ({summary['mean_abs_error_all']:.1%})"
            + (f"; met over the confident rows ({summary['mean_abs_error_confident']:.1%})"
               if summary["mean_abs_error_confident"] <= 0.05 else "") + ".",
            f"- The paper's layout in the planner's top 3 for its cluster: **{summary['paper_layout_in_top3']} of "
            f"{summary['runs']}**. The search is the framework's space (no FSDP; the run's micro-batch, "
            "recomputation and schedule kept), ranked by (tp, pp).", "",
            "### Runs whose layout is not in the planner's top 3, and why", ""]
    for r in rows:
        rank = r.get("paper_layout_rank")
        if rank and rank <= 3:
            continue
        gap = r.get("paper_vs_best")
        if not r["fits"]:
            why = ("the published layout does not fit this memory model (the publication's memory settings "
                   "differ from our assumptions), so it is not searched")
        elif gap is not None and gap < 0.05:
            why = (f"predicted {gap:+.1%} slower than the planner's best `{r['planner_best']}` — a near-tie inside "
                   "the model's accuracy (the model lacks per-micro-batch overheads and GEMM-size effects that make "
                   "smaller tp / deeper pipelines lose on the real cluster)")
        elif gap is not None:
            why = (f"predicted {gap:+.1%} slower than the planner's best `{r['planner_best']}` (its dominant cost: "
                   f"{r['planner_best_dominant']}); the model's preference for less tensor parallel and deeper "
                   "pipelines is not what the paper measured")
        else:
            why = "nothing in the search fits"
        out.append(f"- {r['name']} (rank {rank or '> 10'}): {why}.")
    out += ["", "## vTrain's measured Megatron-DeepSpeed set", "",
            "1,440 runs on one node of 2-8 A100 and 109 on 64-512 A100 (Bang et al., MICRO 2024, "
            "github.com/VIA-Research/vTrain `data/`; copied into `benchmarks/data/vtrain/`; mapping and assumptions "
            "in `published.vtrain_runs`). Error = predicted / measured step − 1. Full rows: "
            "`benchmarks/results/plan-published.json` (`vtrain_rows`).", "",
            "| one-node rows by | value | runs | mean error | mean abs. error |", "|---|---|---|---|---|"]
    for key, by in summary["vtrain_one_node"].items():
        if key == "compute_bound":
            continue
        for v, s in by.items():
            out.append(f"| {key} | {v} | {s['runs']} | {s['mean_error']:+.1%} | {s['mean_abs_error']:.1%} |")
    cb = summary["vtrain_one_node"]["compute_bound"]
    out += ["", f"The {cb['runs']} one-node rows whose predicted step is at least {cb['share_at_least']:.0%} compute "
            f"(GEMMs and element-wise work, where the A100's matmul efficiency alone decides the prediction): mean "
            f"error {cb['mean_error']:+.1%}, mean absolute error {cb['mean_abs_error']:.1%}."]
    b = summary["bands"]
    out += ["", "## The band `syncwise plan` prints", "",
            "10th-90th percentile of measured ÷ predicted step time over every row above (published runs and "
            "vTrain's), by regime (`syncwise.plan.uncertainty.BANDS`):", "",
            "| regime | runs | measured ÷ predicted, 10th percentile | 90th percentile |", "|---|---|---|---|"]
    out += [f"| {k} | {v['runs']} | {v['lo']:.3f} | {v['hi']:.3f} |" for k, v in b.items()]
    ll = summary["llama_7b_h100_8x4"]
    hb = summary["accelerator_bands"]["h100-sxm"]
    out += ["", "Per accelerator (`syncwise.plan.uncertainty.ACCELERATOR_BANDS`; a plan on an accelerator with at least "
            "8 checked runs other than the A100 prints its accelerator's band instead of the regime's):", "",
            "| accelerator | runs | measured ÷ predicted, 10th percentile | 90th percentile |", "|---|---|---|---|"]
    out += [f"| {k} | {v['runs']} | {v['lo']:.3f} | {v['hi']:.3f} |" for k, v in summary["accelerator_bands"].items()]
    out += ["", f"7 B Llama on `examples/clusters/h100-8x4-ib.toml` (1,024 × 4,096 tokens): best layout "
            f"`{ll['layout']}`, {ll['step_time_s']:.2f} s per step, MFU {ll['mfu']:.1%} (with the h100-sxm band "
            f"that `syncwise plan` prints: {ll['mfu'] / hb['hi']:.1%} to {ll['mfu'] / hb['lo']:.1%}; the measured "
            "MPT-7b rows on 8 H100 above reached 40.4 % (sequence 4096, recomputation) and 46.4 % (2048) MFU by "
            "llm-foundry's count).",
            "", "## What the misses say", "", NOTES, ""]
    return "\n".join(out)


NOTES = """\
- **MT-NLG (−15 to −19 %; −22 to −25 % before the busiest stage and gradient accumulation were priced)**: not
  the same run as Megatron-LM's 529.6 B row. That row ran Megatron-LM's interleaved schedule with 3 stages per
  rank and fp16 gradients (examples/sc21/run_table_1.sh); MT-NLG ran Megatron's layers in DeepSpeed's pipeline
  engine — non-interleaved TrainSchedule, sends partitioned over the tp ranks — in bf16 with fp32 gradients. Two
  terms now price what both rows pay: the last stage's head (3 layers of 20,480 a stage, the head worth 0.14 of
  one: +3.5 % of MT-NLG's step) and each micro-batch's gradient accumulation (1.9 B parameters a rank, 10 B each
  into fp32 main gradients, 240 times: +4.7 %). DeepSpeed's "synchronous" 1F1B is not the rest:
  `benchmarks/deepspeed_schedule.py` runs its TrainSchedule (its step-to-micro-batch map, line for line) with
  every step's neighbour exchange blocking, and gets a 1F1B's time exactly, at MT-NLG's 240 / 192 / 160
  micro-batches and with a heavier last stage too (the cost model's pipeline formula, to 4 digits): the
  exchanges pair the stages like a brick wall and never hold the busiest one. Measured per micro-batch,
  MT-NLG's stage took 219 ms (60.1 s / (240 + 34)) against Megatron-LM's 186 ms at the same (tp, pp)
  (54.1 s / (280 + 34/3)): 18 % longer, of which the modelled differences give 5 points. What the other
  13 are is not found: not DeepSpeed's schedule, not the A100 (below).
- **Llama 3 405B at 16,384 GPUs (−18 %; 8,192 GPUs −8 %)**: one layer fewer on the first and last stage, as
  the paper balanced them (§3.3.2); with 16 micro-batches per pipeline and interleaving at 2 stages
  per rank (assumed: the paper does not give v), the modelled bubble is 29 % of the step; Meta's tuned
  schedule evidently loses less. The two rows hang on that v: at 3 / 4 / 6 stages per rank they would be
  −2.6 / +0.1 / +2.5 % (8,192 GPUs) and −10.1 / −5.5 / −0.7 % (16,384). If the paper's remark (§3.3.2, as we read it) that the
  first model chunk of the first stage then holds only the embedding means one layer per chunk, v is 8: 128 virtual
  stages for 126 layers, which the planner cannot express. v stays at the 2 assumed before these rows were
  seen. The layout also does not fit our memory model without recomputation, so the publication's memory
  settings differ from ours.
- **Megatron-LM Table 1, as its script ran it (issue 41)**: the rows assumed micro-batch 1 and a non-interleaved
  1F1B ("the table gives neither"); the paper's own script, examples/sc21/run_table_1.sh, gives both: micro-batch
  16 / 16 / 16 / 8 / 4 / 2 / 2 / 1 / 1 / 1, the interleaved schedule at 3 / 2 / 2 / 3 stages per rank for the
  76-530 B rows, PyTorch DDP (overlapped) below 39 B, and --fp16 without fp32 all-reduce; Megatron-LM's
  pipeline sends are scatter/gathered (its default, SC'21 §4.1; now `Training.pp_scatter_gather`). As run, the
  planner's best layout is the paper's for the 1.7-39.1 B rows (8 of 16 in the top 3 → 11), and the 7.5 B /
  18.4 B rows go from −18.5 / −16.9 % to +10.2 / +9.4 % (micro-batch 16 / 8 is not host-bound). The pipelined rows, with their busiest stage
  and gradient accumulation priced, are −4.1 to +8.1 % (mean +2.0 %); the four rows without a pipeline stay +9
  to +13 % too fast. Not the A100's efficiency: vTrain's one-node rows whose predicted step is ≥ 90 % compute
  (51 runs, where that constant alone decides) are −1.8 % on average, and llm-foundry's A100 rows −4 to −9 %
  (too fast, the other way). What the four DDP rows lack is not found: PyTorch DDP's all-reduce of their 1.7-2.3
  B fp16 gradients is 0.06-0.43 s a step: even unhidden it would explain 2-6 points, not the 9-13.
- **Held-out small models (MosaicML llm-foundry's MPT-125m to 1b on one node of 8 GPUs, FSDP)**: predicted
  too fast before (mean −20.7 %); −12.7 % after, most of the change from the loss's HBM traffic over a
  50,368-entry vocabulary (44 B per logit), which is 10-15 % of a 125m model's step. That term was added after
  these rows' breakdowns had been seen (its constant is an op count, not a fit); with the GEMM-shape and kernel
  terms alone the mean was −18.5 %. On A100 the rows are now
  −4 % to −10 %; on H100 still −22 % and −30 %: an H100 step of a 0.8-1.3 B model reaches 35-42 % MFU in the
  table, and nothing in this model (GEMM waves over 132 SMs, HBM traffic at 3.35 TB/s, 4 µs launches at
  micro-batches of 14-24 sequences) costs that much; the catalog's H100 `matmul_efficiency` 0.65 is the
  large-model value, and a measured GEMM curve on an H100 (`syncwise plan --calibrate` there) is what
  would tell whether small GEMMs or something else (attention at head dim 64-128, kernels below PyTorch's
  dispatcher) is missing.
- **H100 (the 7 B Llama plan at 56.4 % MFU; 58.4 % before gradient accumulation was priced)**: llm-foundry's tables ran the same software on A100 and H100:
  MPT-7b at sequence 2048 reached 64.2 % MFU on 8 A100 and 46.4 % on 8 H100, at 4096 54.8 % and 40.4 % — the
  H100 at about 0.7 of the A100's share of peak (also at 3b, 13b, 30b), where the catalog's efficiencies (0.65
  vs 0.70) say 0.93. The new held-out rows (MPT-7b / 13b on 8 H100) are −9 to −30 % here. The tuned H100 stacks
  (Llama 3, Megatron-Core's MoE rows) sit near the catalog's 0.65, so the gap is eager PyTorch / FSDP on Hopper,
  not the chip, and lowering the H100's catalog value would break those rows. What changed instead: an H100
  plan prints the band of the 12 checked H100 runs (0.85-1.43 × the predicted step), so the 7 B plan reads
  "MFU 41 % to 69 %", whose low end is where the measured 7 B runs are.
- **Qwen3-235B-A22B, the MoE table (3 rows of Megatron-Core's model zoo, one model on the same 256 H100 at the
  same global batch).** The FSDP row (TP 2, EP 8) was +57 % while this planner put its ep 8 at stride tp — 16
  GPUs, two nodes, the all-to-alls (13.5 s of 27.6 s) on InfiniBand. Megatron folds EP over TP × DP (MoE
  parallel folding, expert-TP 1): the 8 EP ranks are one node's GPUs. With that layout expressed (`ep_fold`)
  the row is -3.0 % (+0.4 % now). The two pipelined rows, now with the busiest stage (94 layers over 8 ranks,
  split as evenly as Megatron-Core's default would, the 152 k-entry head worth 2.6 layers on the last rank: the
  model zoo's actual split is not given) and gradient accumulation (the TP 4 row: 256 micro-batches, 11 % of
  its step) priced: **TP 2 PP 8 VPP 4 EP 32, +46.6 %** (+30.5 % before) — its ep 32 spans 4 nodes and
  the planner sends every (token, expert) copy over InfiniBand (14.4 s of all-to-all), where DeepEP's internode
  dispatch sends a token once per destination node and fans it out over NVLink (top-8 over 4 nodes: about 2.7
  remote copies per token instead of 6), not modelled; **TP 4 PP 8 VPP 4 EP 8, −3.4 %** (−19.9 % before; −43.9 % when first
  entered) — the table's slowest row (167 TFLOP/s against 245-276). Both pipelined rows moved by terms fitted to
  none of them, but how Megatron-Core split these 94 layers, and whether its fused weight-gradient accumulation
  halves the accumulation's traffic, are not known. Not rows:
  the "+1f1b overlap" variant (all-to-alls hidden behind another micro-batch's compute) and the A2A-dispatcher
  row (PP 32 × VPP 3 = 96 stages for 94 layers).
- **BLOOM (+0.5 %, quoted from memory)**: 4 NICs per node and micro-batch 2 are assumptions; its 250 k
  vocabulary makes the head worth about one layer, and its run counted each tied embedding as a layer when
  DeepSpeed split the stages (`--pp-partition-method 'type:transformer|embedding'`: the end stages hold one layer
  fewer), as the model now does (`published.BLOOM`).
"""


if __name__ == "__main__":
    sys.exit(main())
