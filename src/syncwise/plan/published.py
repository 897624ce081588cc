"""Published large-scale training runs (layout + measured throughput, each with its source) and the planner's
prediction of each: the check of the cost model against runs nobody here can repeat.

Each ``PublishedRun`` gives the model's shape, the cluster, the layout as published, the global batch and
the reported figure in the publication's own unit (TFLOP/s per GPU by the paper's FLOP count, or seconds per
iteration). ``confident`` is False where a number is quoted from memory with less certainty or the
publication's FLOP convention is unknown; ``assumed`` lists what the publication does not say and we chose
(micro-batch size, schedule, recomputation). benchmarks/plan_published.py prints and stores the comparison.
"""
from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .cloud import CloudConfig, cluster
from .cost import Prediction, predict
from .layout import MEGATRON, SYNCWISE, Layout, Training
from .model import ModelSpec
from .search import search

#: Megatron-style mixed precision with fused attention and no dropout (2023-24 runs)
MODERN = dataclasses.replace(MEGATRON, name="megatron-flash", flash_attention=True, dropout=False)
#: Megatron-LM as Narayanan et al. ran Table 1 (examples/sc21: --fp16 without --accumulate-allreduce-grads-in-fp32,
#: so gradients are fp16 and all-reduced in fp16; scatter/gather pipeline sends, the default); --DDP-impl local:
#: the gradient all-reduce after backward
MEGATRON_SC21 = dataclasses.replace(MEGATRON, name="megatron-sc21", grad_bytes=2, grad_reduce_bytes=2,
                                    pp_scatter_gather=True)
#: ... with --DDP-impl torch (the rows without a pipeline): PyTorch DDP's buckets all-reduce during backward
MEGATRON_SC21_TORCH_DDP = dataclasses.replace(MEGATRON_SC21, name="megatron-sc21-torch-ddp", overlap_dp=True,
                                              ddp_bucket_copy=True)
#: Megatron's layers under DeepSpeed's pipeline engine (MT-NLG; Megatron-DeepSpeed): non-interleaved 1F1B
#: (DeepSpeed's TrainSchedule has no virtual stages), activations and their gradients sent partitioned over the
#: tp ranks (PartitionedTensor: deepspeed/runtime/pipe/engine.py, is_pipe_partitioned / is_grad_partitioned =
#: is_model_parallel); the rest as MEGATRON (fp32 gradient reduction: MT-NLG trained in bf16)
MEGATRON_DEEPSPEED = dataclasses.replace(MEGATRON, name="megatron-deepspeed", pp_scatter_gather=True)
#: Llama 3 405B's pipeline: "we reduce one Transformer layer each from the first and the last stages" (Dubey et al.
#: 2024 §3.3.2), the embedding and the head balancing them
LLAMA3 = dataclasses.replace(MODERN, name="llama3", pp_end_layers=1)
#: BLOOM's Megatron-DeepSpeed: --pp-partition-method 'type:transformer|embedding' counts each tied embedding (the
#: input one and the head) as one layer when DeepSpeed partitions the stages (bigscience-workshop/bigscience,
#: train/tr11-176B-ml/README.md): the end stages hold one layer fewer
BLOOM = dataclasses.replace(MEGATRON, name="bloom", pp_end_layers=1)
#: llm-foundry / Composer with FSDP FULL_SHARD and amp_bf16 under the DEFAULT mixed precision: fp32 sharded
#: weights and AdamW state, bf16 gathers, fp32 gradient reduce-scatter, flash attention, no dropout
LLM_FOUNDRY = dataclasses.replace(SYNCWISE, name="llm-foundry", gather_bytes=2, flash_attention=True, dropout=False)
LLM_FOUNDRY_URL = ("github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md (MPT Training "
                   "Benchmarks)")
MOE_ZOO_URL = "github.com/yanring/Megatron-MoE-ModelZoo/blob/main/best_practice/Qwen3/readme.md"
#: torchtitan's FSDP2 default mixed precision: bf16 parameters gathered, fp32 reduce-scatter, flash attention
TORCHTITAN = dataclasses.replace(LLM_FOUNDRY, name="torchtitan")


def megatron_flops(B: int, s: int, L: int, h: int, V: int, recompute: bool = True) -> float:
    """Narayanan et al. 2021, eq. (3): FLOPs per iteration, 96·B·s·l·h²·(1 + s/6h + V/16lh) with activation
    recomputation (72·B·s·l·h²·(1 + s/6h + V/12lh) without)."""
    if recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


@dataclass(frozen=True)
class PublishedRun:
    name: str
    publication: str
    source: str                     # table / section
    model: ModelSpec
    cloud: CloudConfig
    layout: Layout
    global_batch: int
    seq_len: int
    metric: str                     # "tflops_per_gpu" (by ``flops``) or "step_time_s"
    reported: float
    flops: Optional[Callable[[], float]] = None     # the publication's FLOPs per iteration (for tflops_per_gpu)
    training: Training = MEGATRON
    confident: bool = True
    assumed: str = ""
    fsdp_in_framework: bool = False  # whether the framework could have chosen FSDP (for the top-3 check)
    # "published": the 16 runs the cost model was first checked on; "held-out small": small GPT models on one
    # node, added with the GEMM-shape and per-kernel terms and never used to choose a constant; "moe": MoE runs
    group: str = "published"

    def predicted(self, pred: Prediction) -> float:
        """The prediction in the publication's unit."""
        if self.metric == "step_time_s":
            return pred.step_time_s
        flops = self.flops() if self.flops else pred.tflops_per_gpu * 1e12 * pred.step_time_s * \
            self.cloud.world_size
        return flops / pred.step_time_s / self.cloud.world_size / 1e12


def gpt(hidden: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048, name: str = "") -> ModelSpec:
    """GPT as in Megatron-LM: GeLU MLP of 4h, learned positions, tied embedding, biases."""
    return ModelSpec(name or f"gpt-h{hidden}-l{layers}", vocab, hidden, layers, heads, 4 * hidden, seq_len=seq,
                     mlp="gelu", biases=True, learned_positions=seq, tie_embeddings=True)


def _selene(gpus: int) -> CloudConfig:
    # DGX A100 (80 GB) nodes: 8 GPUs on NVLink 3 / NVSwitch, 8 × HDR 200 Gb/s InfiniBand per node (Narayanan
    # et al. §5: "8 NVIDIA Mellanox 200Gbps HDR Infiniband HCAs"); Selene / MT-NLG's cluster the same.
    return cluster("a100-80gb", gpus // 8, 8, intra="nvlink3", inter="ib-hdr", nics_per_node=8)


def runs() -> list[PublishedRun]:
    """The published runs, with sources (one function per source, in this order)."""
    return [run for source in (_megatron_weak_scaling, _mt_nlg, _llama3, _bloom,
                               _mpt_held_out, _mpt_h100_7b_13b, _qwen3_moe_zoo, _mixtral, _torchtitan_deepseek)
            for run in source()]


def _megatron_weak_scaling() -> list[PublishedRun]:
    """Megatron-LM's weak-scaling table (Narayanan et al. SC'21, Table 1)."""
    out: list[PublishedRun] = []
    # ---- 1. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    #      Megatron-LM", SC'21 (arXiv:2104.04473), Table 1 (weak scaling): TFLOP/s per GPU by eq. (3).
    #      The settings each row ran with are the paper's own script, github.com/NVIDIA/Megatron-LM
    #      examples/sc21/run_table_1.sh (de7dc40f88, 2021-08-10) with CONFIG.sh: micro-batch (MBS), layers per
    #      virtual pipeline stage (--num-layers-per-virtual-pipeline-stage: the interleaved schedule, v = layers per
    #      stage / that), --DDP-impl (torch: PyTorch DDP, its bucketed all-reduce overlapping backward; local:
    #      Megatron's, after backward), --checkpoint-activations, --fp16 without --accumulate-allreduce-grads-in-fp32
    #      (gradients accumulated and all-reduced in fp16, megatron/model/distributed.py at de7dc40f88) and the
    #      scatter/gather pipeline sends on (arguments.py's default).
    #      (P, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s, MBS, layers per virtual stage or 0, DDP impl)
    table1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 0, "torch"),
              (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 0, "torch"),
              (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 0, "torch"),
              (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 0, "torch"),
              (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 0, "local"),
              (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
              (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
              (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
              (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
              (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 0, "local")]
    for P, a, h, L, tp, pp, n, B, tf, mbs, per_virtual, ddp in table1:
        v = L // pp // per_virtual if per_virtual else 1
        sched = dict(pp_schedule="interleaved-1f1b", stages_per_rank=v) if v > 1 else {}
        out.append(PublishedRun(
            f"Megatron-LM GPT {P} B", "Narayanan et al. SC'21", "Table 1", gpt(h, L, a, name=f"gpt-{P}b"),
            _selene(n), Layout(dp_replicate=n // (tp * pp), tp=tp, pp=pp, micro_batch=mbs, recompute="full",
                               sequence_parallel=False, **sched), B, 2048, "tflops_per_gpu", tf,
            flops=lambda B=B, L=L, h=h: megatron_flops(B, 2048, L, h, 51200),
            training=MEGATRON_SC21_TORCH_DDP if ddp == "torch" else MEGATRON_SC21,
            assumed=f"as run_table_1.sh: micro-batch {mbs}, "
                    + (f"interleaved 1F1B with {v} stages per rank" if v > 1 else "1F1B" if pp > 1 else "no pipeline")
                    + f", DDP {ddp}, full recomputation, fp16 gradients all-reduced in fp16, scatter/gather sends; "
                      "the fabric's numbers are the catalog's"))
    return out


def _mt_nlg() -> list[PublishedRun]:
    """MT-NLG 530B's iteration times (Smith et al. 2022)."""
    out: list[PublishedRun] = []
    # ---- 2. Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
    #      §3 system performance: 280 / 350 / 420 DGX A100 nodes, tp 8 × pp 35, batch 1920, seconds per iteration.
    #      The same model and (tp, pp) as Megatron-LM's 529.6 B row, but not the same system: DeepSpeed's pipeline
    #      engine (non-interleaved; Megatron-LM's row ran the interleaved schedule with 3 stages per rank,
    #      run_table_1.sh) and bf16 with fp32 gradient reduction (Megatron's fp16 row reduced in fp16): the
    #      MEGATRON_DEEPSPEED recipe.
    for nodes, dp, sec in ((280, 8, 60.1), (350, 10, 50.2), (420, 12, 44.4)):
        out.append(PublishedRun(
            f"MT-NLG 530B on {nodes * 8} GPUs", "Smith et al. 2022 (MT-NLG)", "§2 system performance (iteration time)",
            gpt(20480, 105, 128, name="mt-nlg-530b"), _selene(nodes * 8),
            Layout(dp_replicate=dp, tp=8, pp=35, micro_batch=1, recompute="full", sequence_parallel=False),
            1920, 2048, "step_time_s", sec, training=MEGATRON_DEEPSPEED,
            assumed="iteration times 60.1 / 50.2 / 44.4 s (also quoted with 126 / 121 / 113 TFLOP/s per GPU in "
                    "llm-analysis's MT-NLG example, github.com/cli99/llm-analysis); micro-batch 1 (as Megatron-LM's "
                    "530 B script) and vocabulary 51,200 assumed; DeepSpeed's pipeline engine: non-interleaved "
                    "1F1B, partitioned sends; full recomputation (the paper's activation-memory estimate "
                    "checkpoints every block)"))
    return out


def _llama3() -> list[PublishedRun]:
    """Llama 3 405B's TFLOP/s per GPU (Dubey et al. 2024, Table 4)."""
    out: list[PublishedRun] = []
    # ---- 3. Dubey et al., "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: Llama 3 405B on H100
    #      (8 per node, RoCE 400 Gb/s per GPU), 8,192-token sequences, 16 M tokens per batch, BF16 TFLOP/s per GPU
    llama405 = ModelSpec("llama-3-405b", 128256, 16384, 126, 128, 53248, seq_len=8192, n_kv_heads=8)
    for gpus, dp, per_dp, tf in ((8192, 64, 32, 430), (16384, 128, 16, 400)):
        out.append(PublishedRun(
            f"Llama 3 405B on {gpus} GPUs", "Dubey et al. 2024 (Llama 3)", "Table 4", llama405,
            cluster("h100-sxm", gpus // 8, 8, intra="nvlink4", inter="roce-400g", nics_per_node=8),
            Layout(dp_replicate=dp, tp=8, pp=16, pp_schedule="interleaved-1f1b", stages_per_rank=2, micro_batch=1,
                   recompute="none", zero1=True), dp * per_dp, 8192, "tflops_per_gpu", tf, training=LLAMA3,
            assumed="FLOP convention taken as 6N + full attention (Meta's own count is not given: a causal "
                    "discount would lower ours by ~4 %); interleaved 1F1B with 2 stages per rank, micro-batch 1, "
                    "no recomputation; sharded optimizer state as ZeRO-1; one layer fewer on the first and the "
                    "last stage (§3.3.2)"))
    return out


def _bloom() -> list[PublishedRun]:
    """BLOOM 176B (BigScience 2022, §3.4)."""
    out: list[PublishedRun] = []
    # ---- 4. BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model" (arXiv:2211.05100),
    #      §3.4: 48 nodes × 8 A100 80 GB, tp 4 × pp 12 × dp 8, ZeRO-1, "156 TFLOPs" in the fastest configuration
    out.append(PublishedRun(
        "BLOOM 176B on 384 GPUs", "BigScience 2022 (BLOOM)", "§3.4", gpt(14336, 70, 112, vocab=250880,
                                                                          name="bloom-176b"),
        cluster("a100-80gb", 48, 8, intra="nvlink3", inter="opa-100", nics_per_node=4),
        Layout(dp_replicate=8, tp=4, pp=12, micro_batch=2, recompute="full", sequence_parallel=False, zero1=True),
        2048, 2048, "tflops_per_gpu", 156, flops=lambda: megatron_flops(2048, 2048, 70, 14336, 250880),
        training=BLOOM, confident=False,
        assumed="156 TFLOP/s quoted from memory (the BigScience project page says 'about 150'); Megatron's "
                "eq. (3) assumed as their count; 4 Omni-Path 100 Gb/s links per node (Jean Zay), micro-batch 2, full recomputation assumed; ALiBi treated as RoPE-free MHA"))
    return out


def _mpt_held_out() -> list[PublishedRun]:
    """MosaicML llm-foundry's MPT benchmarks (held out)."""
    out: list[PublishedRun] = []
    # ---- 5. Held out (never used to choose a constant): MosaicML llm-foundry's MPT training benchmarks, one node
    #      of 8 GPUs, FSDP FULL_SHARD, amp_bf16, no activation checkpointing, sequence 2048. The step time is the
    #      table's GlobalBatchSize (T) / Throughput (T/s). MPT's benchmark shapes: learned positions, tied
    #      embedding, biases and LayerNorm, GeLU MLP of 4d, vocabulary 50,368 — the parameter counts this gives
    #      equal the table's NumParams exactly (125,311,488 / 355,985,408 / 760,470,528 / 1,315,950,592).
    mpt = {"125m": (768, 12, 12), "350m": (1024, 24, 16), "760m": (1536, 24, 12), "1b": (2048, 24, 16)}
    for acc, intra, table, rows in (
            ("a100-80gb", "nvlink3", "A100 80GB table", (("125m", 32, 2, 1133901), ("350m", 32, 2, 470263),
                                                          ("760m", 24, 2, 259472), ("1b", 14, 4, 164109))),
            ("h100-sxm", "nvlink4", "H100 80GB BF16 table", (("760m", 24, 2, 505177), ("1b", 14, 1, 363645)))):
        for size, mb, ga, tok_s in rows:
            h, L, a = mpt[size]
            batch = 8 * mb * ga
            out.append(PublishedRun(
                f"MPT-{size} on 8 {acc}", "MosaicML llm-foundry", f"{table}, seq 2048 ({LLM_FOUNDRY_URL})",
                gpt(h, L, a, vocab=50368, name=f"mpt-{size}"), cluster(acc, 1, 8, intra=intra),
                Layout(dp_shard=8, micro_batch=mb, microbatches=ga, recompute="none"), batch, 2048, "step_time_s",
                batch * 2048 / tok_s, training=LLM_FOUNDRY, group="held-out small", fsdp_in_framework=True,
                assumed=f"step = {batch * 2048:,} tokens / {tok_s:,} tokens/s; heads {a} as the llm-foundry yaml "
                        "(heads do not change the FLOPs); Composer's amp_bf16 + FSDP DEFAULT mixed precision as "
                        "LLM_FOUNDRY"))
    return out


def _mpt_h100_7b_13b() -> list[PublishedRun]:
    """MosaicML llm-foundry's MPT-7b and 13b on one node of 8 H100 (held out: the check of an H100 plan at 7 B)."""
    out: list[PublishedRun] = []
    # ---- The same README's H100 80GB BF16 table (commit 061f2c7c): MPT-7b at sequence 4096 (MicroBatchSize 16,
    #      GradAccum 2, activation checkpointing, 68,893 tokens/s, MFU 40.42 %) and 2048 (6, 1, none, 85,144 tokens/s,
    #      MFU 46.44 %), MPT-13b at 2048 (2, 1, none, 38,336 tokens/s, MFU 39.79 %), all on 8 GPUs, FSDP FULL_SHARD,
    #      amp_bf16. Shapes as the small rows (gpt(): learned positions, biases; the table's NumParams 6,667,247,616 /
    #      6,658,859,008 / 12,853,954,560 are what they give). Added to check the 7 B Llama plan on H100 against
    #      measured H100 runs of that size; no constant was chosen on them.
    for size, (h, L, a), seq, mb, ga, tok_s, recompute in (
            ("7b", (4096, 32, 32), 4096, 16, 2, 68893, "full"), ("7b", (4096, 32, 32), 2048, 6, 1, 85144, "none"),
            ("13b", (5120, 40, 40), 2048, 2, 1, 38336, "none")):
        batch = 8 * mb * ga
        out.append(PublishedRun(
            f"MPT-{size} seq {seq} on 8 h100-sxm", "MosaicML llm-foundry",
            f"H100 80GB BF16 table, seq {seq} ({LLM_FOUNDRY_URL}, commit 061f2c7c)",
            gpt(h, L, a, vocab=50368, seq=seq, name=f"mpt-{size}"), cluster("h100-sxm", 1, 8, intra="nvlink4"),
            Layout(dp_shard=8, micro_batch=mb, microbatches=ga, recompute=recompute), batch, seq, "step_time_s",
            batch * seq / tok_s, training=LLM_FOUNDRY, group="held-out h100 7-13b", fsdp_in_framework=True,
            assumed=f"step = {batch * seq:,} tokens / {tok_s:,} tokens/s; activation checkpointing as full "
                    "recomputation; Composer's amp_bf16 + FSDP DEFAULT mixed precision as LLM_FOUNDRY"))
    return out


def _qwen3_moe_zoo() -> list[PublishedRun]:
    """Megatron-Core's Qwen3-235B-A22B rows (NVIDIA's MoE model zoo)."""
    out: list[PublishedRun] = []
    # ---- 6. MoE: Megatron-Core's Qwen3-235B-A22B on 256 H100 (NVIDIA's Megatron-MoE-ModelZoo, Qwen3 best
    #      practice, "Intra-node EP strategy" row): TP 2, EP 8, PP 1, FSDP on 128 data-parallel ranks, MBS 4, GBS
    #      2048, seq 4096, full recomputation, DeepEP dispatcher, BF16: 17.6 s per step, 276 TFLOP/s per GPU.
    #      Megatron folds EP over TP × DP (MoE parallel folding, arXiv 2504.14960; expert tensor parallel 1): the
    #      8 expert-parallel ranks are the node's 8 GPUs, tp pairs included (``ep_fold``). Without the fold the
    #      planner put the group across 2 nodes (stride tp) and priced the all-to-alls on InfiniBand: +57 %.
    qwen3 = ModelSpec("qwen3-235b-a22b", 151936, 4096, 94, 64, 12288, seq_len=4096, n_kv_heads=4, head_dim=128,
                      n_routed_experts=128, top_k=8, moe_hidden=1536,
                      source="Qwen3-235B-A22B config.json: 94 layers, d 4096, 64 q / 4 kv heads of 128, 128 experts "
                             "top-8 of width 1536, vocabulary 151,936, every layer MoE")
    out.append(PublishedRun(
        "Qwen3-235B-A22B on 256 H100", "Megatron-Core MoE model zoo (NVIDIA)", f"Qwen3 performance table, intra-node "
        f"EP row ({MOE_ZOO_URL})", qwen3,
        cluster("h100-sxm", 32, 8, intra="nvlink4", inter="ib-ndr", nics_per_node=8),
        Layout(dp_shard=128, tp=2, ep=8, micro_batch=4, recompute="full", ep_dispatch="bf16", ep_fold=True), 2048, 4096,
        "step_time_s", 17.6, training=MODERN, group="moe", fsdp_in_framework=True,
        assumed="InfiniBand 8 × 50 GB/s per node (the table's setup); balanced routing; Megatron's FSDP as this "
                "planner's FSDP2 over dp 128 with tp 2; DeepEP's dispatch as the planner's bf16 all-to-all; EP folded "
                "over TP × DP (ep_fold: the 8 EP ranks on one node)"))
    # The same table's pipelined rows (same model, cluster and global batch; distributed optimizer; DeepEP):
    # TP 2 × PP 8 (VPP 4) × EP 32 (folded over TP × DP 16), selective recompute of norms and the MoE activation,
    # 19.7 s; TP 4 × PP 8 (VPP 4) × EP 8, no recompute, 29.0 s. Not rows: "+1f1b overlap" (17.6 s: the all-to-alls
    # hidden behind another micro-batch's compute, which this planner does not model) and the A2A-dispatcher row
    # (PP 32 × VPP 3 = 96 stages for 94 layers: uneven stages, which the planner cannot express).
    zoo_note = ("InfiniBand 8 × 50 GB/s per node (the table's setup); balanced routing; Megatron's distributed "
                "optimizer as zero1; DeepEP's dispatch as the planner's bf16 all-to-all; EP folded over TP × DP "
                "(ep_fold); ")
    for name, lay, step, recompute in (
            ("Qwen3-235B-A22B on 256 H100, TP2 PP8 VPP4 EP32", dict(tp=2, ep=32), 19.7,
             "the row's selective recompute of norms and the MoE activation as none (a few % of the FLOPs)"),
            ("Qwen3-235B-A22B on 256 H100, TP4 PP8 VPP4 EP8", dict(tp=4, ep=8), 29.0, "no recompute (the row's)")):
        dp = 256 // (lay["tp"] * 8)
        out.append(PublishedRun(
            name, "Megatron-Core MoE model zoo (NVIDIA)", f"Qwen3 performance table, TP {lay['tp']} PP 8 VPP 4 EP "
            f"{lay['ep']} row ({MOE_ZOO_URL}, commit e8650517)", qwen3,
            cluster("h100-sxm", 32, 8, intra="nvlink4", inter="ib-ndr", nics_per_node=8),
            Layout(dp_replicate=dp, pp=8, pp_schedule="interleaved-1f1b", stages_per_rank=4, micro_batch=1,
                   ep_dispatch="bf16", ep_fold=True, zero1=True, **lay), 2048, 4096,
            "step_time_s", step, training=MODERN, group="moe", assumed=zoo_note + recompute))
    return out


def _mixtral() -> list[PublishedRun]:
    """Mixtral 8x7B on 64 H100 (Megatron-Core v0.8's MoE README)."""
    out: list[PublishedRun] = []
    # ---- Mixtral 8x7B on 64 H100, Megatron-Core v0.8 (NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md
    #      at 0b981f9c53, 2024-08): "This boosts Mixtral 8X7B bf16 training to achieve 438 TFLOPS as of MCore v0.8",
    #      beside the README's "reference parallel mappings of MCore v0.8": TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256,
    #      seq 4096, all-to-all dispatcher, "8xH100 80GB HBM3, NVLink 4th Generation, InfiniBand 8x400 Gbit/s".
    #      Megatron's FLOP count then did not halve causal attention (training.py: + seq_length / hidden_size):
    #      8.29e10 FLOP/token, so 438 TFLOP/s = 5,284 tokens/s per GPU; the step = 256 × 4096 tokens / (64 × that).
    mixtral = ModelSpec("mixtral-8x7b", 32000, 4096, 32, 32, 14336, seq_len=4096, n_kv_heads=8, n_routed_experts=8,
                        top_k=2, moe_hidden=14336,
                        source="Mixtral 8x7B (the README's example script): 32 layers, d 4096, 32 q / 8 kv heads, 8 "
                               "experts top-2 of width 14,336, vocabulary 32,000")
    out.append(PublishedRun(
        "Mixtral-8x7B on 64 H100", "Megatron-Core MoE README (NVIDIA)", "MCore v0.8 reference mapping and its 438 "
        "TFLOPS (github.com/NVIDIA/Megatron-LM/blob/0b981f9c53/megatron/core/transformer/moe/README.md)", mixtral,
        cluster("h100-sxm", 8, 8, intra="nvlink4", inter="ib-ndr", nics_per_node=8),
        Layout(dp_replicate=16, pp=4, pp_schedule="interleaved-1f1b", stages_per_rank=8, ep=8, micro_batch=1,
               ep_dispatch="bf16", zero1=True), 256, 4096, "step_time_s", 256 * 4096 / (64 * 438e12 / 8.29e10),
        training=MODERN, group="moe", confident=False,
        assumed="the README does not print 438 TFLOPS next to the mapping (pairing them is our reading); no "
                "recomputation (not stated); Megatron's distributed optimizer as zero1; balanced routing; the "
                "all-to-all dispatcher as the planner's bf16 all-to-all"))
    return out


def _torchtitan_deepseek() -> list[PublishedRun]:
    """DeepSeek-V3-16B on 8 H100 (torchtitan, a user's log)."""
    out: list[PublishedRun] = []
    # ---- torchtitan's DeepSeek-V3-16B on 8 H100 (pytorch/torchtitan issue #1789, 2025-10-02: "tps: 11,636 ...
    #      11,758 ... 11,533" tokens/s per GPU at steps 10-30), the default train config of that date
    #      (deepseek_v3_16b.toml at 8ec37d2b): FSDP 8, EP 8, seq 4096, selective activation checkpointing ('op'),
    #      bf16; the issue lowered local_batch_size from 8 to fit, value not given (4 assumed).
    dsv3_16b = ModelSpec("deepseek-v3-16b", 102400, 2048, 27, 16, 10944, seq_len=4096, attention="mla",
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         n_routed_experts=64, n_shared_experts=2, top_k=6, moe_hidden=1408, n_dense_layers=1,
                         source="torchtitan deepseek_v3 '16B' flavor: 27 layers (first dense, FFN 10,944), d 2048, "
                                "16 heads, MLA without q-LoRA (kv 512, nope 128, rope 64, v 128), 64 routed + 2 shared "
                                "experts of 1,408, top-6, vocabulary 102,400")
    out.append(PublishedRun(
        "DeepSeek-V3-16B on 8 H100 (torchtitan)", "torchtitan (a user's log, pytorch/torchtitan#1789)",
        "issue #1789 log, steps 10-30: ~11,640 tokens/s per GPU (github.com/pytorch/torchtitan/issues/1789)",
        dsv3_16b, cluster("h100-sxm", 1, 8, intra="nvlink4"),
        Layout(dp_shard=8, ep=8, micro_batch=4, recompute="selective", ep_dispatch="bf16"), 32, 4096,
        "step_time_s", 32 * 4096 / (8 * 11640), training=TORCHTITAN, group="moe", confident=False,
        fsdp_in_framework=True,
        assumed="local batch 4 (the log lowered it from 8, value not given); early steps of a user's run, not a "
                "benchmark; torchtitan's FSDP2 mixed precision (bf16 gathers, fp32 reduce-scatter) as TORCHTITAN; "
                "selective 'op' checkpointing as the planner's selective recompute; balanced routing"))
    return out


VTRAIN_URL = "github.com/VIA-Research/vTrain (data/ground_truth_{single,multi}.csv, MIT licence)"


def vtrain_runs(folder: str | Path) -> list[PublishedRun]:
    """The measured Megatron-DeepSpeed iteration times that vTrain (Bang et al., "vTrain: A Simulation Framework
    for Evaluating Cost-effective and Compute-optimal Large Language Model Training", MICRO 2024) validates
    against: ``ground_truth_single.csv`` (1,440 runs on 2-8 A100 of one node: GPT of hidden 1,024 / 2,048, 12-24
    layers, sequence 1,024) and ``ground_truth_multi.csv`` (109 runs, 3.6-175 B on 64-512 A100), read from
    ``folder`` (benchmarks/data/vtrain: copies of the repository's files). As vTrain's configs state: full
    activation recomputation, 1F1B, GPT-2's vocabulary (50,257, padded to 50,304 as Megatron pads to 128),
    8 GPUs per node with 4 × 200 Gb/s HDR InfiniBand (its 800 Gb/s per node); fp16 Megatron mixed precision.
    The A100's memory (40 / 80 GB) is not stated: 80 GB's HBM bandwidth assumed. Micro-batch as measured
    (the CSV's column: gradient accumulation of global / dp / micro-batch when pp = 1)."""
    out: list[PublishedRun] = []
    for name, group in (("ground_truth_single.csv", "vtrain one node"),
                        ("ground_truth_multi.csv", "vtrain multi-node")):
        with open(Path(folder) / name, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.DictReader(f))
        for i, row in enumerate(rows):
            g, B, mb, h, a, L, s, tp, dp, pp = (int(row[k]) for k in (
                "# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
                "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism"))
            cloud = cluster("a100-80gb", max(1, g // 8), min(8, g), intra="nvlink3",
                            inter="ib-hdr" if g > 8 else None, nics_per_node=4 if g > 8 else None)
            out.append(PublishedRun(
                f"vTrain {group} #{i}: h{h} L{L} tp{tp} pp{pp} dp{dp} mb{mb} B{B}", "Bang et al. 2024 (vTrain)",
                f"{name} row {i + 2} ({VTRAIN_URL})", gpt(h, L, a, vocab=50304, seq=s, name=f"gpt-h{h}-l{L}"),
                cloud, Layout(dp_replicate=dp, tp=tp, pp=pp, micro_batch=mb, recompute="full",
                              sequence_parallel=False), B, s, "step_time_s", float(row["iteration time (ms)"]) / 1e3,
                group=group, training=MEGATRON_DEEPSPEED,
                assumed="A100 80 GB; vocabulary 50,304; fp16 Megatron recipe with dropout and "
                        "unfused attention; DeepSpeed's pipeline engine (Megatron-DeepSpeed): partitioned "
                        "sends; 4 HDR NICs per node"))
    return out


def without_overheads(cloud: CloudConfig) -> CloudConfig:
    """``cloud`` with the GEMM-shape, per-kernel and per-call collective terms off (no SM count, no launch or gap,
    no fabric's call latency): with a recipe of ``loss_bytes_per_logit`` 0, the cost model as it was before them,
    for the before / after comparison."""
    acc = dataclasses.replace(cloud.accelerator, sm_count=0, kernel_launch_s=0.0, kernel_gap_s=0.0)
    return dataclasses.replace(cloud, accelerator=acc,
                               intra_node=dataclasses.replace(cloud.intra_node, call_latency=0.0),
                               inter_node=dataclasses.replace(cloud.inter_node, call_latency=0.0))


def evaluate(run: PublishedRun, top_check: bool = True) -> dict[str, Any]:
    """Predict ``run``; its error in the publication's unit (also without the GEMM-shape, per-kernel and loss
    traffic terms: ``error_without_overheads``); where its layout ranks in the planner's search over the
    framework's space (no FSDP unless the framework had it; the run's micro-batch, recomputation and schedule
    kept), by (tp, pp)."""
    pred = predict(run.cloud, run.model, run.layout, run.global_batch, run.seq_len, training=run.training,
                   syncwise_rules=False)
    value = run.predicted(pred)
    error = value / run.reported - 1
    before = predict(without_overheads(run.cloud), run.model, run.layout, run.global_batch, run.seq_len,
                     training=dataclasses.replace(run.training, loss_bytes_per_logit=0.0), syncwise_rules=False)
    row: dict[str, Any] = {
        "name": run.name, "group": run.group, "publication": run.publication, "source": run.source, "confident": run.confident,
        "nodes": run.cloud.nodes, "accelerator": run.cloud.accelerator.name,
        "assumed": run.assumed, "layout": run.layout.text(), "gpus": run.cloud.world_size,
        "global_batch": run.global_batch, "seq_len": run.seq_len, "metric": run.metric, "reported": run.reported,
        "predicted": value, "error": error, "predicted_without_overheads": run.predicted(before),
        "error_without_overheads": run.predicted(before) / run.reported - 1, "fits": pred.fits, "memory_gb_per_gpu": pred.memory_gb_per_gpu,
        "mfu": pred.mfu, "breakdown": pred.breakdown, "dominant": pred.dominant,
        "compute_share": (pred.breakdown["compute"] + pred.breakdown["recompute"]) / pred.step_time_s}
    if top_check:
        lay = run.layout
        found = search(run.cloud, run.model, run.global_batch, run.seq_len, top=10, training=run.training,
                       syncwise_rules=False, compress=("none",), recompute=(lay.recompute,),
                       micro_batches=(lay.micro_batch,), schedules=((lay.pp_schedule, lay.stages_per_rank),),
                       fsdp=run.fsdp_in_framework, zero1=lay.zero1, sequence_parallel=lay.sequence_parallel)
        ranks = [(p.layout.tp, p.layout.pp) for p in found]
        row["planner_top3"] = [f"tp{t} pp{p}" for t, p in ranks[:3]]
        row["paper_layout_rank"] = ranks.index((lay.tp, lay.pp)) + 1 if (lay.tp, lay.pp) in ranks else None
        # how far the paper's layout is predicted from the planner's best (same settings, same search)
        row["paper_vs_best"] = pred.step_time_s / found[0].step_time_s - 1 if found else None
        row["planner_best"] = found[0].layout.text() if found else None
        row["planner_best_dominant"] = found[0].dominant if found else None
    return row
