"""Tensor and sequence parallelism (Megatron-style) on a 1-D ``tp`` DeviceMesh, with DTensor plans.

``apply_tensor_parallel(model, tp_mesh)`` shards syncwise's ``DeepSeekLM`` in place; any other
``nn.Module`` takes a ``plan`` (module FQN → ParallelStyle, exactly what
``torch.distributed.tensor.parallel.parallelize_module`` takes). See docs/tensor-parallel.md.

The DeepSeek plan (torchtitan's llama3 / deepseek_v3 plans, adapted to this model):

- attention: q/k/v projections (MHA ``wq/wk/wv``; MLA ``wq`` or ``wq_b`` and ``wkv_b``) column-wise,
  i.e. split by heads (the model reshapes with ``view(B, T, -1, head_dim)``, so local heads work
  unchanged); ``wo`` row-wise. MLA's down-projections ``wq_a``/``wkv_a`` and latent norms
  ``q_norm``/``kv_norm`` are replicated: every head needs the whole latent and the shared RoPE key
  (whose gradient, coming from the local heads only, is summed over the tp ranks: ``MLAKVDownParallel``).
- SwiGLU: ``w1``/``w3`` column-wise, ``w2`` row-wise.
- MoE: the shared experts like the SwiGLU; the router and the routed experts replicated (expert
  parallel is a separate dimension). The MoE input is gathered to the full (B, T, d) hidden state, so
  every tp rank routes every token identically: ``tokens_per_expert`` and the aux-loss-free bias update
  stay identical on all tp ranks.
- embedding row-wise (vocab-sharded), output head column-wise (vocab-sharded; logits gathered, or left
  ``Shard(-1)`` for ``loss_parallel``).
- ``sequence_parallel=True``: between the blocks the residual stream is a local (B, T/tp, d) shard;
  the RMSNorms run on sequence shards (``SequenceParallel``); attention and MLP/MoE inputs are
  all-gathered on the sequence dim, and their row-wise outputs reduce-scattered back to it.
  ``False``: activations stay replicated between blocks and row-wise outputs are all-reduced.

Every parameter ends up a DTensor on ``tp_mesh`` (replicated ones as ``Replicate()``), so
``torch.optim`` (foreach included), ``clip_grad_norm_``, DCP checkpoints and FSDP2 see one kind of
parameter. Replicated modules compute on DTensors (``ReplicateParallel``), except the MoE router and
routed experts, whose routing code reads their weights through ``to_local()`` (see ``models/moe.py``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from ..comm import ops
from ..comm.stats import CommStats
from ..errors import ConfigError

__all__ = ["apply_tensor_parallel", "deepseek_tp_plan", "ReplicateParallel", "MLAKVDownParallel", "clip_grad_norm",
           "loss_parallel"]


def _tp_imports():
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)
    return (DTensor, Replicate, Shard, distribute_tensor, ColwiseParallel, RowwiseParallel, SequenceParallel,
            PrepareModuleInput, PrepareModuleInputOutput)


def _parallel_style_base():
    from torch.distributed.tensor.parallel.style import ParallelStyle
    return ParallelStyle


class ReplicateParallel(_parallel_style_base()):
    """Replicate a module's own parameters as ``Replicate()`` DTensors on the tp mesh (torchtitan's
    ``NoParallel``). Parameters are broadcast from the mesh's first rank, so they agree even if ranks
    initialised differently.

    ``compute="dtensor"`` (default): tensor inputs are wrapped as Replicate DTensors (a DTensor input
    is redistributed to Replicate), the module runs on DTensors, and the output is handed back as a
    local tensor (``use_local_output=True``). ``compute="local"``: no input/output hooks; the module's
    code must read its weights through ``.to_local()`` (the MoE router and experts do).

    Gradients of a replicated parameter are identical on every tp rank only if its inputs and the
    gradient flowing into its output are: true when its output feeds column-wise layers (whose input
    gradient DTensor all-reduces) or a replicated output, as in the DeepSeek plan.
    """

    def __init__(self, *, compute: str = "dtensor", use_local_output: bool = True) -> None:
        super().__init__()
        if compute not in ("dtensor", "local"):
            raise ValueError(f"compute must be 'dtensor' or 'local', got {compute!r}")
        self.compute = compute
        self.use_local_output = use_local_output

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: Any) -> None:
        _, Replicate, _, distribute_tensor, *_ = _tp_imports()
        for p_name, param in list(module.named_parameters(recurse=False)):
            if param.__class__.__name__ == "DTensor":
                continue
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))

    @staticmethod
    def _input_fn(mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        DTensor, Replicate, *_ = _tp_imports()
        out = []
        for t in inputs:
            if isinstance(t, DTensor):
                t = t.redistribute(mesh, [Replicate()]) if tuple(t.placements) != (Replicate(),) else t
            elif isinstance(t, torch.Tensor):
                t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            out.append(t)
        return tuple(out)

    def _output_fn(self, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        DTensor, *_ = _tp_imports()
        if not self.use_local_output:
            return outputs
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module
        if self.compute == "local":
            return distribute_module(module, device_mesh, self._replicate_params)
        return distribute_module(module, device_mesh, self._replicate_params, self._input_fn, self._output_fn)


class _AllReduceTailGrad(torch.autograd.Function):
    """Identity whose backward sums the last ``n`` channels of the gradient over the tp group."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, n: int, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.n, ctx.group = n, group
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.clone()
        tail = grad[..., grad.shape[-1] - ctx.n:].contiguous()
        ops.all_reduce(tail, "sum", group=ctx.group, stats=None)  # counted by the step's dispatch counter
        grad[..., grad.shape[-1] - ctx.n:] = tail
        return grad, None, None


class MLAKVDownParallel(ReplicateParallel):
    """MLA's ``wkv_a``: replicated, like ``ReplicateParallel``, plus one gradient all-reduce.

    Its output is [KV latent | shared RoPE key]. The latent feeds ``kv_norm`` → ``wkv_b`` (column-wise,
    whose input gradient is all-reduced already), but the RoPE key is broadcast to the *local* heads
    only, so its gradient on each tp rank holds just those heads' share: it is summed over the tp
    ranks here (``rope_dim`` channels), or ``wkv_a`` and everything before it would get wrong gradients."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _output_fn(self, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        return _AllReduceTailGrad.apply(super()._output_fn(mod, outputs, mesh), self.rope_dim, mesh.get_group())


# ------------------------------------------------------------------------------------------ the plan
def deepseek_tp_plan(model: nn.Module, sequence_parallel: bool = True,
                     loss_parallel: bool = False) -> dict[str, Any]:
    """The DeepSeekLM plan (module FQN → ParallelStyle) for ``parallelize_module``; see the module doc.

    Only the parts present are planned (a pipeline stage may have no embedding, norm or head)."""
    (DTensor, Replicate, Shard, _, Colwise, Rowwise, SeqPar, PrepIn, PrepInOut) = _tp_imports()
    from syncwise.models.layers import Attention, MLAttention, SwiGLU
    from syncwise.models.moe import MoE

    sp = sequence_parallel
    seq, rep = Shard(1), Replicate()
    # Between blocks the residual stream is Shard(1) (sp) or replicated; row-wise outputs go back to it.
    stream = seq if sp else rep
    norm_style = (lambda: SeqPar()) if sp else (lambda: ReplicateParallel())
    plan: dict[str, Any] = {}

    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = Rowwise(input_layouts=rep, output_layouts=stream)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = norm_style()
    if getattr(model, "output", None) is not None:
        plan["output"] = Colwise(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else rep,
                                 use_local_output=not loss_parallel)

    for name, block in model.layers.items():
        pre = f"layers.{name}"
        plan[f"{pre}.attn_norm"] = norm_style()
        plan[f"{pre}.ffn_norm"] = norm_style()
        attn = block.attn
        if sp:
            # (x, cos, sin): gather x to the full sequence before the q/k/v projections.
            plan[f"{pre}.attn"] = PrepIn(input_layouts=(seq, None, None), desired_input_layouts=(rep, None, None),
                                         use_local_output=True)
        if isinstance(attn, MLAttention):
            if attn.q_lora_rank > 0:
                plan[f"{pre}.attn.wq_a"] = ReplicateParallel()
                plan[f"{pre}.attn.q_norm"] = ReplicateParallel()
                plan[f"{pre}.attn.wq_b"] = Colwise()
            else:
                plan[f"{pre}.attn.wq"] = Colwise()
            plan[f"{pre}.attn.wkv_a"] = MLAKVDownParallel(attn.rope_dim)
            plan[f"{pre}.attn.kv_norm"] = ReplicateParallel()
            plan[f"{pre}.attn.wkv_b"] = Colwise()
        elif isinstance(attn, Attention):
            for p in ("wq", "wk", "wv"):
                plan[f"{pre}.attn.{p}"] = Colwise()
        else:
            raise ConfigError("tensor parallel", type(attn).__name__, "an Attention or MLAttention block "
                              "(pass plan= for other attention modules)")
        plan[f"{pre}.attn.wo"] = Rowwise(output_layouts=stream)

        ffn = block.ffn
        if isinstance(ffn, MoE):
            # The router and the routed experts see the whole (replicated) hidden state: every tp rank
            # routes identically. The routed output is replicated, so the shared experts' row-wise
            # output is all-reduced to Replicate before the sum, and the sum is then cut to the
            # sequence shard (no communication) for the residual stream.
            if sp:
                plan[f"{pre}.ffn"] = PrepInOut(input_layouts=(seq,), desired_input_layouts=(rep,), use_local_input=True,
                                               output_layouts=(rep,), desired_output_layouts=(seq,),
                                               use_local_output=True)
            plan[f"{pre}.ffn.router"] = ReplicateParallel(compute="local")
            plan[f"{pre}.ffn.experts"] = ReplicateParallel(compute="local")
            if ffn.shared is not None:
                plan[f"{pre}.ffn.shared.w1"] = Colwise()
                plan[f"{pre}.ffn.shared.w3"] = Colwise()
                plan[f"{pre}.ffn.shared.w2"] = Rowwise(output_layouts=rep)
        elif isinstance(ffn, SwiGLU):
            if sp:
                plan[f"{pre}.ffn"] = PrepIn(input_layouts=(seq,), desired_input_layouts=(rep,), use_local_output=True)
            plan[f"{pre}.ffn.w1"] = Colwise()
            plan[f"{pre}.ffn.w3"] = Colwise()
            plan[f"{pre}.ffn.w2"] = Rowwise(output_layouts=stream)
        else:
            raise ConfigError("tensor parallel", type(ffn).__name__, "a SwiGLU or MoE feed-forward "
                              "(pass plan= for other modules)")
    return plan


def _check_deepseek(model: nn.Module, tp: int) -> None:
    """Raise ConfigError when ``tp`` does not divide what the DeepSeek plan splits."""
    from .mesh import ParallelSpec
    ParallelSpec(dp_replicate=1, tp=tp).check_model(model.config)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: Optional[Mapping[str, Any]] = None,
                          sequence_parallel: bool = True, loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` and return it.

    ``plan=None``: the built-in plan for syncwise's ``DeepSeekLM`` (``deepseek_tp_plan``; ``tp`` must
    divide heads, widths and vocab, see ``ParallelSpec.check_model``). For any other module pass
    ``plan``: module FQN (``fnmatch`` patterns allowed) → ParallelStyle, as ``parallelize_module`` takes;
    ``sequence_parallel``/``loss_parallel`` then only mean what the user's plan makes them mean.

    With ``loss_parallel=True`` the DeepSeek model returns logits as a DTensor sharded on the vocab
    dim; compute the loss inside ``with loss_parallel():`` (``F.cross_entropy`` only).

    Call it before data parallel / FSDP2 and before building the optimizer; every rank of the mesh
    must feed the same input (with sequence parallel, a sequence length divisible by tp)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel takes a 1-D tp mesh (e.g. mesh['tp']), got {tp_mesh.ndim}-D")
    tp = tp_mesh.size()
    if plan is None:
        from syncwise.models.deepseek import DeepSeekLM
        if not isinstance(model, DeepSeekLM):
            raise ConfigError("tensor parallel", type(model).__name__,
                              "syncwise's DeepSeekLM, or a plan= (module FQN → ParallelStyle) for other modules")
        _check_deepseek(model, tp)
        tied = model.output is not None and model.tok_embeddings is not None \
            and model.output.weight is model.tok_embeddings.weight
        plan = deepseek_tp_plan(model, sequence_parallel, loss_parallel)
        parallelize_module(model, tp_mesh, plan)
        if tied:
            # Both are Shard(0) on the vocab dim: one DTensor serves both again.
            model.output.weight = model.tok_embeddings.weight
        if sequence_parallel:
            model.register_forward_pre_hook(_sequence_check(tp))
            # A pipeline stage without the embedding receives the residual stream as this rank's sequence shard.
            model.sequence_shards = tp
        model._syncwise_tp = {"size": tp, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
        return model
    parallelize_module(model, tp_mesh, dict(plan))
    model._syncwise_tp = {"size": tp, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    return model


def _sequence_check(tp: int):
    def hook(module: nn.Module, args: tuple) -> None:
        idx = args[0] if args else None
        if isinstance(idx, torch.Tensor) and not idx.is_floating_point() and idx.dim() >= 2 and idx.shape[1] % tp:
            raise ConfigError("tensor parallel", idx.shape[1], f"a sequence length divisible by tp ({tp}) under "
                              "sequence parallel (or apply_tensor_parallel(..., sequence_parallel=False))")
    return hook


def _combine_norms(local: torch.Tensor, norm_type: float, group: Any, stats: Optional[CommStats]) -> torch.Tensor:
    """The norm over ``group``'s ranks of their local norms (the max for inf; sums of powers in fp64)."""
    if math.isinf(norm_type):
        out = local.reshape(1).clone()
        ops.all_reduce(out, "max", group=group, stats=stats)
        return out[0]
    out = local.double().pow(norm_type).reshape(1)
    ops.all_reduce(out, "sum", group=group, stats=stats)
    return (out.sqrt() if norm_type == 2 else out.pow(1.0 / norm_type))[0].float()


def loss_parallel():
    """``torch.distributed.tensor.parallel.loss_parallel``: cross-entropy on vocab-sharded logits."""
    from torch.distributed.tensor.parallel import loss_parallel as lp
    return lp()


# ----------------------------------------------------------------------------------------- clipping
@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                   norm_type: float = 2.0, foreach: Optional[bool] = None, across: Any = None,
                   stats: Optional[CommStats] = None) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters that mix DTensors (any placements, one or several meshes)
    and plain tensors. Returns the total norm as a plain tensor, identical on every rank.

    Each DTensor's norm is the global norm of its full tensor (a sharded gradient's shards combine
    across its mesh; a replicated one counts once); plain tensors count as they are (replicated
    parameters, or parameters the caller already reduced). ``across``: a process group whose ranks hold
    the model's other parameters (pipeline stages): their norms combine into the model's (every rank of
    it must call, with or without gradients). ``stats``: where the norms' combination is counted (a run's
    ``ledger.norm``: not a step's gradient bytes; None: nowhere)."""
    DTensor, *_ = _tp_imports()
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads and across is None:
        return torch.tensor(0.0)
    # One all-reduce per sharded mesh dimension, not one full_tensor() per DTensor gradient (issue 24: ~150
    # latency-bound all-reduces a step). The local shards of a DTensor over its non-replicated mesh dimensions
    # partition the tensor, so each local shard's sum of |g|^p (max for inf) is added up locally per set of sharded
    # dimensions, then summed over each of those dimensions' groups in turn; replicated dimensions hold copies and
    # count once. "Sharded" means any placement that is neither Replicate nor Partial: FSDP2 over a tp-sharded
    # parameter places it as _StridedShard, which in torch 2.13 is not a Shard (is_shard() is False) — asking
    # is_shard() left the dp_shard dimension out of the norm (measured 1.34 against 1.69 on dp_shard 2 x tp 2).
    inf = math.isinf(norm_type)
    local: list[torch.Tensor] = []          # plain tensors and fully replicated DTensors: already global
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            local.append(torch.linalg.vector_norm(g, norm_type).float())
            continue
        if any(pl.is_partial() for pl in g.placements):
            local.append(torch.linalg.vector_norm(g, norm_type).full_tensor().float())  # partial sums: combine first
            continue
        n = torch.linalg.vector_norm(g.to_local(), norm_type).double()
        dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
        if not dims:
            local.append(n.float())
            continue
        key = tuple(g.device_mesh.get_group(d) for d in dims)
        by_groups.setdefault(key, []).append(n if inf else n.pow(norm_type))
    parts = [torch.stack(local).double().max() if inf else torch.stack(local).double().pow(norm_type).sum()] \
        if local else []
    for groups, values in by_groups.items():
        combined = torch.stack(values).max() if inf else torch.stack(values).sum()
        combined = combined.reshape(1)
        for group in groups:
            ops.all_reduce(combined, "max" if inf else "sum", group=group, stats=stats)
        parts.append(combined[0])
    if parts:
        stacked = torch.stack(parts)
        total = (stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)).float()
    else:  # this rank holds no gradient but must join `across`: a zero on the group's device, not the CPU's
        total = torch.zeros((), device=ops.group_device(across))
    if across is not None:
        total = _combine_norms(total, norm_type, across, stats)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
