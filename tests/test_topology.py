import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers
from syncwise.comm import CommContext, Topology, TopoAwareCollective, all_reduce, topo_allreduce_hook
from syncwise.errors import ConfigError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32]
SIZES = [1, 7, 1001, (6, 5)]


def _data(rank, dtype, size, salt):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    shape = size if isinstance(size, tuple) else (size,)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


def _hier_vs_flat(rank, world):
    """2 nodes x 2 procs: hierarchical result vs flat all-reduce, plus byte accounting and the DDP hook."""
    ctx = CommContext()
    hier = TopoAwareCollective(ctx, algorithm="hierarchical", intra_reduce="reduce_scatter")
    hier_ar = TopoAwareCollective(ctx, algorithm="hierarchical", intra_reduce="all_reduce")
    out = {"topology": ctx.topology, "groups": (ctx.intra_group is not None, ctx.inter_group is not None),
           "auto_intra": TopoAwareCollective(ctx).intra_reduce}
    cmp = {}
    for i, dtype in enumerate(DTYPES):
        for j, size in enumerate(SIZES):
            for op in ("sum", "avg") if dtype.is_floating_point else ("sum", "max"):
                # alternate the two intra-node variants over the cases
                coll = hier if (i + j) % 2 == 0 else hier_ar
                x = _data(rank, dtype, size, 10 * i + j)
                ref = x.clone()
                all_reduce(ref, op)
                if isinstance(size, tuple):
                    x = x.t()  # non-contiguous input: result must land in the caller's view
                    coll.all_reduce(x, op)
                    x = x.t()
                else:
                    coll.all_reduce(x, op)
                # plain lists: tensors sent through the result queue would need the worker alive (shared memory)
                cmp[(str(dtype), str(size), op)] = (x.double().tolist(), ref.double().tolist())
    out["cmp"] = cmp
    out["last"] = hier.last_algorithm
    # Pipelined chunks (tiny here, so a 1001-element message is 10+ chunks with padded tails).
    piped = {}
    for intra in ("reduce_scatter", "all_reduce"):
        coll = TopoAwareCollective(ctx, algorithm="hierarchical", intra_reduce=intra, pipeline_chunk_bytes=400)
        for size in (7, 1001):
            x = _data(rank, torch.float32, size, 99)
            ref = x.clone()
            all_reduce(ref, "avg")
            coll.all_reduce(x, "avg")
            piped[(intra, size)] = (x - ref).abs().max().item()
    out["piped"] = piped

    # Bytes: 1001 float32 -> padded to 1002 for 2 shards of 501 (reduce-scatter input, then shard sizes).
    ctx.stats.reset()
    hier.all_reduce(torch.ones(1001))
    out["bytes"] = {k: (v["calls"], v["bytes"]) for k, v in ctx.stats.snapshot().items()}
    ctx.stats.reset()
    hier_ar.all_reduce(torch.ones(1001))
    out["bytes_ar"] = {k: (v["calls"], v["bytes"]) for k, v in ctx.stats.snapshot().items()}

    # Automatic choice: small -> flat; large -> hierarchical without a model; identical on all ranks.
    auto = TopoAwareCollective(ctx, threshold_bytes=4096)
    auto.all_reduce(torch.ones(16))
    small = auto.last_algorithm
    y = torch.ones(4096)
    auto.all_reduce(y)
    out["auto"] = (small, auto.last_algorithm, y[0].item())
    speeds = auto.calibrate(probe_bytes=64 * 1024, iters=2)
    out["calibrated"] = speeds
    out["choices"] = [auto.choose(1 << k) for k in range(10, 27, 4)]
    # Given link speeds: fast intra / slow inter -> hierarchical for big messages, flat for small ones;
    # equal speeds -> flat (the ring moves 1.5x the payload over the slow link, hierarchy 1x + 1x).
    auto.set_link_speeds({"intra": 100.0, "inter": 10.0, "latency_us": 50})
    model_choice = [auto.choose(8 << 10), auto.choose(64 << 20)]
    auto.set_link_speeds({"intra": 10.0, "inter": 10.0})
    out["model"] = model_choice + [auto.choose(64 << 20)]
    errors = []
    for bad in ({"intra": 1.0}, {"intra": 1.0, "inter": -1.0}, {"intra": 1, "inter": 1, "bogus": 1}):
        try:
            auto.set_link_speeds(bad)
        except ConfigError as e:
            errors.append(e.field)
    for kwargs in ({"algorithm": "ring"}, {"threshold_bytes": -1}, {"topology": Topology(1, 4)},
                   {"intra_reduce": "tree"}):
        try:
            TopoAwareCollective(ctx, **kwargs)
        except ConfigError as e:
            errors.append(e.field)
    try:
        hier.all_reduce(torch.ones(3, dtype=torch.int32), "avg")
    except ConfigError as e:
        errors.append(e.field)
    out["errors"] = errors

    # DDP comm hook on several buckets: gradients equal the default DDP all-reduce.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(13, 17), nn.ReLU(), nn.Linear(17, 5))
    grads = []
    for use_hook in (False, True):
        model = nn.Sequential(nn.Linear(13, 17), nn.ReLU(), nn.Linear(17, 5))
        model.load_state_dict(base.state_dict())
        ddp = DDP(model, bucket_cap_mb=0.0005)  # ~500 bytes: several buckets
        if use_hook:
            ddp.register_comm_hook(TopoAwareCollective(ctx, algorithm="hierarchical"), topo_allreduce_hook)
        g = torch.Generator().manual_seed(rank)
        ddp(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    out["ddp_max_diff"] = max((a - b).abs().max().item() for a, b in zip(*grads))

    # Trivial topologies fall back to flat even above the threshold.
    fallback = []
    for topo in (Topology(1, 4), Topology(4, 1)):
        with TopoAwareCollective(CommContext(topology=topo), threshold_bytes=0) as t:
            z = torch.full((100,), float(rank))
            t.all_reduce(z)
            fallback.append((t.last_algorithm, z[0].item()))
    out["fallback"] = fallback
    ctx.close()
    return out


def test_hierarchical_all_reduce_matches_flat_on_2_nodes_x_2():
    res = run_workers(_hier_vs_flat, 4, local_world_size=2)
    tol = {"torch.float32": 1e-5, "torch.float64": 1e-12, "torch.bfloat16": 5e-2, "torch.float16": 5e-3,
           "torch.int32": 0.0}
    for rank, out in enumerate(res):
        assert out["topology"] == Topology(2, 2) and out["groups"] == (True, True)
        assert len(out["cmp"]) == 4 * 4 * 2 + 4 * 2
        for (dtype, size, op), (got, ref) in out["cmp"].items():
            got, ref = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
            assert got.shape == ref.shape
            assert torch.allclose(got, ref, rtol=tol[dtype], atol=tol[dtype]), (dtype, size, op, got, ref)
        assert out["last"] == "hierarchical"
        assert max(out["piped"].values()) < 1e-5, out["piped"]
        # instrumented bytes equal the tensors each step moves
        assert out["bytes"] == {"reduce_scatter": (1, 1002 * 4), "all_reduce": (1, 501 * 4),
                                "all_gather": (1, 501 * 4)}
        assert out["bytes_ar"] == {"all_reduce": (2, 1002 * 4 + 501 * 4), "all_gather": (1, 501 * 4)}
        assert out["auto_intra"] == "all_reduce"  # gloo
        assert out["auto"] == ("flat", "hierarchical", 4.0)
        assert all(v > 0 for v in out["calibrated"].values())
        assert set(out["choices"]) <= {"flat", "hierarchical"}
        assert out["model"] == ["flat", "hierarchical", "flat"]
        assert out["errors"] == ["link_speeds", "link_speeds.inter", "link_speeds", "algorithm", "threshold_bytes",
                                 "topology", "intra_reduce", "op"]
        assert out["ddp_max_diff"] < 1e-6
        assert out["fallback"] == [("flat", 6.0), ("flat", 6.0)]
    # the calibrated model and hence every choice are the same on all ranks (else collectives would mismatch)
    assert all(out["calibrated"] == res[0]["calibrated"] for out in res)
    assert all(out["choices"] == res[0]["choices"] for out in res)
    # same inputs everywhere -> the hierarchical results are bit-identical across ranks
    for key in res[0]["cmp"]:
        assert all(out["cmp"][key][0] == res[0]["cmp"][key][0] for out in res)


def _list_all_reduce(rank, world):
    """1 node x 2 procs: a list of tensors, bucketed, equals a per-tensor all-reduce; bad arguments are refused."""
    ctx = CommContext()
    out = {}
    for algorithm in ("flat", "hierarchical"):
        coll = TopoAwareCollective(ctx, algorithm=algorithm)
        for op in ("sum", "avg"):
            g = torch.Generator().manual_seed(rank * 7 + 1)
            # 48 + 24 float32 bytes share a bucket of 80; the 200-byte vector is bigger than the cap and goes
            # alone; the float64 one is a bucket of its own dtype. The first is a non-contiguous view.
            grads = [torch.randn(4, 3, generator=g).t(), torch.randn(2, 3, generator=g),
                     torch.randn(50, generator=g), torch.randn(5, generator=g, dtype=torch.float64)]
            refs = [t.clone() for t in grads]
            for r in refs:
                all_reduce(r, op)
            ctx.stats.reset()
            returned = coll.all_reduce(grads, op=op, bucket_bytes=80)
            snap = ctx.stats.snapshot()
            out[(algorithm, op)] = {
                "same_object": returned is grads, "shapes": [tuple(t.shape) for t in grads],
                "max_diff": max((t - r).abs().max().item() for t, r in zip(grads, refs)),
                "all_reduce_calls": snap.get("all_reduce", {}).get("calls"), "last": coll.last_algorithm}
    # A tuple works as well and is returned as it is; a parameter that requires grad is updated in place.
    coll = TopoAwareCollective(ctx)
    w = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    pair = (w, torch.tensor([rank], dtype=torch.int32))
    out["tuple"] = (coll.all_reduce(pair) is pair, w.tolist(), pair[1].tolist())
    out["empty"] = coll.all_reduce([], op="avg")
    errors = []
    for bad, kwargs in (({"w": torch.ones(2)}, {}), ([torch.ones(2), 3.0], {}), (torch.ones(2), {"op": "mean"}),
                        ([torch.ones(2), torch.ones(2, device="meta")], {}),
                        ([torch.ones(2), torch.ones(2, dtype=torch.int64)], {"op": "avg"}),
                        ([torch.ones(2)], {"bucket_bytes": 0}), (None, {})):
        try:
            coll.all_reduce(bad, **kwargs)
        except ConfigError as e:
            errors.append((e.field, str(e)))
    out["errors"] = errors
    ctx.close()
    return out


def test_all_reduce_of_a_tensor_list_is_bucketed_and_equals_per_tensor_all_reduce():
    res = run_workers(_list_all_reduce, 2, local_world_size=2)
    for out in res:
        for (algorithm, op), case in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            assert case["same_object"] and case["shapes"] == [(3, 4), (2, 3), (50,), (5,)]
            assert case["max_diff"] < 1e-6, (algorithm, op, case)
            assert case["last"] == algorithm
            if algorithm == "flat":  # one collective per bucket: [48 B + 24 B], [200 B], [float64]
                assert case["all_reduce_calls"] == 3, case
        assert out["tuple"] == (True, [3.0, 3.0, 3.0], [1])
        assert out["empty"] == []
        fields = [f for f, _ in out["errors"]]
        assert fields == ["tensor", "tensor[1]", "op", "tensor[1]", "op", "bucket_bytes", "tensor"], out["errors"]
        assert "a dict" in out["errors"][0][1] and "list or tuple" in out["errors"][0][1]
        assert "one device" in out["errors"][3][1]
    assert res[0]["errors"] == res[1]["errors"]
