"""Issue 24 on a GPU: NCCL and CUDA-stream correctness that the CPU suite can only guard (tests/test_gpu_correctness.py).

Skipped without CUDA. One GPU is enough: every NCCL run here has world size 1 (NCCL refuses two ranks on one GPU),
which still builds the real NCCL communicators, CUDA-aware futures, side streams and events. Each check runs in a
subprocess of its own, so NCCL state and caching-allocator settings never leak between them or into pytest.

At world size 1 syncwise builds no DDP (parallel/data_parallel.py: one rank has nothing to average), so a compressor
given to the trainer or the command line compresses nothing there: the command-line and trainer runs below check the
NCCL job itself; every compressor goes through DDP in ``test_every_compressor_hook_under_ddp_on_nccl``, which builds
DDP itself (DDP runs its comm hook at world size 1 too) and checks that each one averaged the buckets it was given.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMPRESSORS = ["none", "fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.1", "randomk:ratio=0.1",
               "powersgd:rank=2,start_iter=1"]


def _python(code: str, env: "dict | None" = None, timeout: float = 600) -> dict:
    """Run ``code`` as a 1-rank torchrun-like NCCL job; its last stdout line is JSON."""
    from syncwise.launch import free_port

    full = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_command_line_nccl_world_size_1_trains(tmp_path):
    # --dist.max_restarts=1 goes through torchrun's agent: the worker joins the group (nproc 1 alone runs in-process).
    # (No compressor: at world size 1 the run builds no DDP, so it would compress nothing; see the module docstring.)
    from syncwise.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--dist.backend=nccl", "--dist.max_restarts=1", "--preset", "tiny",
                 "--steps", "3", "--run-dir", str(run_dir), "--data.seq_len=32", "--train.val_batches=1"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["loss"] == r["loss"] for r in rows)


def test_command_line_nccl_compiled(tmp_path):
    from syncwise.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--dist.backend=nccl", "--dist.max_restarts=1", "--preset", "tiny-moe",
                 "--steps", "3", "--run-dir", str(run_dir), "--data.seq_len=32", "--train.val_batches=1",
                 "--train.compile=true", "--compress.method=powersgd:rank=2,start_iter=1"]) == 0


def test_python_api_joins_nccl_with_a_cpu_communicator_on_its_own_gpu_and_trains():
    got = _python("""
        import json, torch, torch.distributed as dist
        from syncwise.comm import ops
        from syncwise.models import build_model
        from syncwise.train import OptimizedTrainer, adamw
        from syncwise.data import TokenBatchLoader
        from syncwise.commands.worker import resume_target
        from syncwise.config import build_config
        torch.manual_seed(0)
        model = build_model("tiny", seq_len=32).cuda()
        trainer = OptimizedTrainer(model, adamw(model, 1e-3, 0.0), device=torch.device("cuda", 0))
        out = {"backend": str(dist.get_backend()), "current": torch.cuda.current_device(),
               "resume": resume_target(build_config(), 0)}
        ctl = torch.tensor([3], dtype=torch.int64)  # a CPU control tensor on the default group (issue 24)
        ops.all_reduce(ctl, "max")
        out["cpu_all_reduce"] = int(ctl)
        tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(1))
        s = trainer.train(TokenBatchLoader(tokens, 4, 32, 0, 1, seed=0), steps=3)
        out["loss"] = s["final_loss"] if "final_loss" in s else s.get("loss")
        print(json.dumps(out, default=str))
    """, env={"SYNCWISE_STRICT_DEVICES": "1"})
    assert got["backend"] == "cuda:nccl,cpu:gloo" and got["current"] == 0 and got["resume"] == "none"
    assert got["cpu_all_reduce"] == 3
    assert got["loss"] is not None and got["loss"] == got["loss"]


def test_every_compressor_hook_under_ddp_on_nccl():
    # world size 1 still runs DDP's reducer, the hook, the worker thread's side stream and NCCL's collectives
    got = _python(f"""
        import json, torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from syncwise.train.arguments import join_torchrun
        from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec
        join_torchrun(torch.device("cuda", 0))
        out = {{}}
        for spec in {COMPRESSORS!r}:
            torch.manual_seed(0)
            net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]).cuda()
            plain = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]).cuda()
            plain.load_state_dict(net.state_dict())
            model = DDP(net, bucket_cap_mb=0.1)
            state = CompressionHookState(parse_compress_spec(spec), None, net, CompressionPolicy(min_numel=1024))
            model.register_comm_hook(state, compression_hook)
            for step in range(3):
                model.zero_grad()
                plain.zero_grad()
                x = torch.randn(32, 128, device="cuda")
                model(x).pow(2).mean().backward()
                plain(x).pow(2).mean().backward()
            torch.cuda.synchronize()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in net.parameters())
            err = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max()) for p, q in
                      zip(net.parameters(), plain.parameters()))
            c = state.compressor.counters
            out[spec] = [finite, state.steps, err, c["elements"], c["bytes_sent"], c["collectives"]]
            state.close()
        out["params"] = sum(p.numel() for p in net.parameters())
        print(json.dumps(out))
    """, env={"SYNCWISE_STRICT_DEVICES": "1"})
    params = got["params"]
    for spec in COMPRESSORS:
        finite, steps, err, elements, sent, collectives = got[spec]
        assert finite and steps == 3, spec  # DDP ran the hook on each of the 3 backwards
        if spec == "none":
            continue
        # the compressor itself averaged every gradient element of the 3 backwards through NCCL
        assert elements == 3 * params and collectives >= 3, (spec, got[spec])
        if spec not in ("fp16", "bf16"):
            assert sent < 3 * params * 2, (spec, got[spec])  # less than even a 16-bit cast would send
    assert got["none"][2] < 1e-6 and got["fp16"][2] < 1e-2  # lossless / nearly: the hook returned the bucket
    assert got["topk:ratio=0.1"][2] > 1e-3  # a lossy compressor changed the gradient: it was applied


def test_fsdp2_and_compile_on_nccl():
    got = _python("""
        import json, torch
        from syncwise.train.arguments import join_torchrun
        from syncwise.models import build_model
        from syncwise.parallel.fsdp import apply_fsdp
        join_torchrun(torch.device("cuda", 0))
        torch.manual_seed(0)
        model = apply_fsdp(build_model("tiny", seq_len=32).cuda(), None, param_dtype=torch.bfloat16)
        run = torch.compile(model)
        x = torch.randint(0, 256, (2, 32), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(x).float().pow(2).mean()
        loss.backward()
        print(json.dumps({"loss": float(loss), "grad_dtype": str(next(model.parameters()).grad.dtype)}))
    """)
    assert got["loss"] == got["loss"] and got["grad_dtype"] == "torch.float32"


_FP8_RUN = """
    import hashlib, json, torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from syncwise.train.arguments import join_torchrun
    from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec
    join_torchrun(torch.device("cuda", 0))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).cuda()
    model = DDP(net, bucket_cap_mb=0.3)
    state = CompressionHookState(parse_compress_spec("fp8:error_feedback=true"), None, net,
                                 CompressionPolicy(min_numel=1024))
    inner = state.compressor.unpack_sum
    def slow_decode(*a, **k):  # the callback's pool stream stays busy ~50 ms before it reads a bucket's buffers
        torch.cuda._sleep(100_000_000)
        return inner(*a, **k)
    state.compressor.unpack_sum = slow_decode  # (fp8 decodes in the all-gather future's callback: hook._direct_gather)
    model.register_comm_hook(state, compression_hook)
    def allocate_in_backward(module, grad_output):
        # Inside backward, after the later layers' buckets went to the compressor's stream and while it still works
        # on them: blocks the host released too early are handed out here and overwritten on this stream.
        junk = [torch.randn(n, device="cuda") for n in (1 << 14, 1 << 16, 1 << 18) for _ in range(4)]
        del junk
    net[0].register_full_backward_pre_hook(allocate_in_backward)
    for step in range(8):
        model.zero_grad()
        x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step),
                        requires_grad=True)  # (so the first layer's backward hook fires)
        model(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    h = hashlib.sha256()
    residuals = [state.compressor._state[k].get("residual") for k in sorted(state.compressor._state)]
    assert any(r is not None for r in residuals)  # fp8 keeps error feedback
    for r in residuals:
        if r is not None:
            h.update(r.cpu().numpy().tobytes())
    for p in net.parameters():
        h.update(p.grad.cpu().numpy().tobytes())
    print(json.dumps({"hash": h.hexdigest()}))
"""

#: The positive control of the comparison below: a side stream reads a tensor whose last host reference is dropped
#: while that stream is still busy, without ``record_stream`` — the bug class the fp8 test looks for. With the caching
#: allocator the next allocation on the default stream gets the block and overwrites it first; without caching the
#: free waits for the device, so the read sees the original values.
_RACE_CONTROL = """
    import json, torch
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # still busy ...
        y = x * 2                       # ... when it reads x
    del x                               # (no x.record_stream(side): the block is free at once)
    junk = torch.full((1 << 20,), 7.0, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"sum": float(y.sum())}))
"""


def test_fp8_error_feedback_is_identical_with_and_without_the_caching_allocator():
    # issue 24: the fp8 callback runs on a pool stream; without record_stream the caching allocator could hand the
    # staged residual's block to an allocation on the backward's stream while the pool stream still read it. The
    # allocation happens inside backward while the compressor's stream is kept busy (a race after backward's end
    # cannot happen: DDP waits for the hook's futures first).
    control = _python(_RACE_CONTROL), _python(_RACE_CONTROL, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert control[1]["sum"] == 2.0 * (1 << 20)
    assert control[0] != control[1], "the positive control did not race: the comparison could not see a race"
    cached = _python(_FP8_RUN)
    uncached = _python(_FP8_RUN, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert cached == uncached


def test_compressor_collectives_run_on_the_side_stream():
    got = _python("""
        import json, torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from syncwise.comm import streams
        from syncwise.train.arguments import join_torchrun
        from syncwise.compress import CompressionHookState, CompressionPolicy, compression_hook, parse_compress_spec
        join_torchrun(torch.device("cuda", 0))
        out = {}
        for inline in (False, True):
            net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).cuda()
            model = DDP(net, bucket_cap_mb=0.01)
            state = CompressionHookState(parse_compress_spec("int8"), None, net, CompressionPolicy(min_numel=256))
            state.inline = inline
            seen, inner = [], state.compressor.average
            def spy(*a, **k):
                seen.append(torch.cuda.current_stream())
                return inner(*a, **k)
            state.compressor.average = spy
            model.register_comm_hook(state, compression_hook)
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            torch.cuda.synchronize()
            side = streams.side_stream(torch.device("cuda", 0), "compress")
            out[str(inline)] = [s == side and s != torch.cuda.default_stream() for s in seen]
            state.close()
        print(json.dumps(out))
    """)
    assert got["False"] and all(got["False"]) and got["True"] and all(got["True"])


def test_ops_durations_are_cuda_event_times_and_the_watchdog_sees_queued_collectives():
    got = _python("""
        import json, torch
        from syncwise.comm import ops
        from syncwise.comm.stats import CommStats
        from syncwise.train.arguments import join_torchrun
        join_torchrun(torch.device("cuda", 0))
        stats = CommStats()
        t = torch.ones(1 << 22, device="cuda")
        ops.all_reduce(t, stats=stats)  # warm-up: the communicator
        torch.cuda.synchronize()
        stats.reset()
        torch.cuda._sleep(200_000_000)  # the collective waits behind ~0.1 s of GPU work
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ops.all_reduce(t, stats=stats)
        end.record()
        queued = ops.oldest_in_flight() is not None
        torch.cuda.synchronize()
        stats.settle(wait=True)
        print(json.dumps({"ops_s": stats.total_time_s, "events_s": start.elapsed_time(end) / 1e3,
                          "queued": queued, "after": ops.oldest_in_flight() is None}))
    """)
    assert got["queued"] and got["after"]
    assert got["ops_s"] == pytest.approx(got["events_s"], rel=0.2, abs=2e-4)


def test_random_k_and_powersgd_draws_on_the_gpu_equal_the_cpus():
    from syncwise.compress import parse_compress_spec

    a, b = parse_compress_spec("randomk:ratio=0.3"), parse_compress_spec("randomk:ratio=0.3")
    assert torch.equal(a.indices("w", 10_000, "cuda").cpu(), b.indices("w", 10_000, "cpu"))
    p, q = parse_compress_spec("powersgd:rank=2"), parse_compress_spec("powersgd:rank=2")
    assert torch.equal(p._initial_q("w", 1, 64, 2, torch.device("cuda")).cpu(),
                       q._initial_q("w", 1, 64, 2, torch.device("cpu")))
