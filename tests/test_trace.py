"""Seeing inside the step: profiler traces (--profile.*) and flight-recorder dumps, read by `syncwise doctor`.

Real gloo processes (no mocks of torch.distributed): a 2-rank `syncwise train` of a tiny model whose profiled steps
doctor splits, and two ranks whose flight recorders disagree on a collective. The interval arithmetic is also
checked on a synthetic trace with known overlapping intervals.
"""
from __future__ import annotations

import datetime
import re
import json

import pytest
import torch
from rich.console import Console
from torch import nn

from syncwise.cli import main
from syncwise.config import build_config
from syncwise.doctor import flight as doctor_flight
from syncwise.doctor.trace import cite, load_traces, print_traces, sentences, split_trace, summarize, timeline
from syncwise.errors import ConfigError
from syncwise.rundir import RunDir
from syncwise.train import OptimizedTrainer


def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_a_synthetic_trace_splits_by_interval_unions_never_summed_durations():
    # step [0, 100) µs on the main thread: compute [0, 40) and [60, 80) (nested operators count once), two
    # collectives in flight at once on two other threads: [30, 70) and [35, 50) -> communication is [30, 70)
    events = [_x("ProfilerStep#0", 0, 100, cat="user_annotation"),
              _x("aten::linear", 0, 40), _x("aten::addmm", 5, 30), _x("aten::mul", 60, 20),
              _x("c10d::allreduce_", 30, 2),                                     # the issue, on the main thread
              _x("gloo:all_reduce", 30, 40, tid=2, cat="user_annotation", **{"Input Dims": [[1000]],
                                                                             "Input type": ["float"]}),
              _x("gloo:all_reduce", 35, 15, tid=3, cat="user_annotation", **{"Input Dims": [[10]],
                                                                             "Input type": ["c10::BFloat16"]})]
    t = split_trace({"traceEvents": events, "syncwise": {"rank": 0, "first_step": 7}})
    [s] = t.steps
    assert s.step == 7 and s.step_ms == pytest.approx(0.1)
    assert s.comm_ms == pytest.approx(0.040)          # the union, not 40 + 15 + 2
    # compute: the main thread's operators, whole spans (linear's own time around addmm included), less the
    # communication it ran inline (the issue [30, 32)): [0, 30) ∪ [32, 40) ∪ [60, 80) = 58 µs
    assert s.compute_ms == pytest.approx(0.058)
    assert s.overlap_ms == pytest.approx(0.018)       # [32, 40) ∪ [60, 70)
    assert s.exposed_ms == pytest.approx(0.022)       # [30, 32) ∪ [40, 60)
    assert s.idle_ms == pytest.approx(0.1 - 0.080)    # [80, 100)
    assert s.compute_ms + s.exposed_ms + s.idle_ms == pytest.approx(s.step_ms)
    # a CPU trace launches nothing: launch overhead is not defined, all of idle is host-bound
    assert s.launch_ms is None and s.host_ms == s.idle_ms
    # per kind: its execution (the gloo events) where recorded, not the issue as well
    assert s.kinds["allreduce"]["count"] == 2 and s.kinds["allreduce"]["bytes"] == 4000 + 20
    # an NCCL kernel under either name it has had, and a device trace's compute is its other kernels
    gpu = [_x("ProfilerStep#0", 0, 100, cat="user_annotation"),
           _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 30, tid=7, cat="kernel"),
           _x("ncclKernel_AllGather_RING_LL_Sum_int8_t", 90, 20, tid=8, cat="kernel"),
           _x("ampere_sgemm_128x64_nn", 0, 60, tid=7, cat="kernel")]
    [g] = split_trace({"traceEvents": gpu}).steps
    assert set(g.kinds) == {"allreduce", "allgather"}
    assert g.compute_ms == pytest.approx(0.060) and g.comm_ms == pytest.approx(0.040)
    assert g.exposed_ms == pytest.approx(0.030) and g.idle_ms == pytest.approx(0.010)


def _kineto_step():
    """One GPU step in Kineto's shape: the host's step and runtime calls, the device's kernels (µs), joined by
    ``correlation``; the step [0, 1000) repeated on the device as a gpu_user_annotation (not a second step)."""
    host, dev = {"tid": 1}, {"tid": 7}
    rt = lambda name, ts, dur, c, cat="cuda_runtime": _x(name, ts, dur, cat=cat, correlation=c, **host)  # noqa: E731
    k = lambda name, ts, dur, c, cat="kernel", tid=7: _x(name, ts, dur, tid=tid, cat=cat, correlation=c)  # noqa: E731
    return [_x("ProfilerStep#0", 0, 1000, cat="user_annotation", **host),
            _x("ProfilerStep#0", 100, 800, cat="gpu_user_annotation", **dev),
            rt("cudaLaunchKernel", 100, 20, 1), k("sm90_xmma_gemm", 130, 270, 1),          # waits [100, 130)
            rt("cudaLaunchKernelExC", 200, 10, 4), k("vectorized_elementwise", 300, 50, 4, tid=8),  # device busy
            # the host side of an all-reduce (record_param_comms, the nccl: annotation) around its launch: not the
            # collective running; the kernel starts 160 µs after its launch returned, the device idle meanwhile
            _x("record_param_comms", 400, 50, **{"Collective name": "allreduce"}, **host),
            _x("nccl:all_reduce", 410, 30, cat="user_annotation", **host),
            rt("cudaLaunchKernel", 420, 20, 2), k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 600, 200, 2, tid=9),
            rt("cudaMemcpyAsync", 850, 10, 3), k("Memcpy DtoH (Device -> Pinned)", 870, 10, 3, cat="gpu_memcpy"),
            rt("cudaStreamSynchronize", 880, 60, 5),                                       # a wait, not a launch
            rt("cuLaunchKernel", 950, 10, 9, cat="cuda_driver")]                           # its kernel not traced


def test_launch_overhead_is_the_device_idle_while_a_launch_is_under_way_and_the_parts_sum_to_the_step(tmp_path):
    [s] = split_trace({"traceEvents": _kineto_step()}).steps
    assert s.step_ms == pytest.approx(1.0)                  # one step: the device's copy of the window is not one
    assert s.compute_ms == pytest.approx(0.280)             # [130, 400) ∪ [870, 880): kernels and the copy
    assert s.comm_ms == pytest.approx(0.200) and s.exposed_ms == pytest.approx(0.200)  # the kernel only
    assert s.kinds["allreduce"]["count"] == 1
    # launch: [100, 130) + [420, 600) (inside the call, then the kernel not yet started) + [850, 870) + [950, 960);
    # the launch at 200 adds nothing (the device was busy), cudaStreamSynchronize is host-bound
    assert s.launch_ms == pytest.approx(0.240)
    assert s.host_ms == pytest.approx(0.280)                # [0, 100) [400, 420) [880, 950) [960, 1000)
    assert s.compute_ms + s.exposed_ms + s.launch_ms + s.host_ms == pytest.approx(s.step_ms, abs=1e-9)
    assert s.spans["launch"] == [(0.1, 0.13), (0.42, 0.6), (0.85, 0.87), (0.95, 0.96)]
    # doctor's summary, its table and sentence, and report's timeline carry it
    traces = RunDir(tmp_path).traces
    traces.mkdir(parents=True)
    for rank in (0, 1):
        (traces / f"rank{rank}.step4-4.json").write_text(json.dumps(
            {"traceEvents": _kineto_step(), "syncwise": {"rank": rank, "first_step": 4}}))
    t = summarize(tmp_path)
    assert t["ranks"][0]["launch_ms"] == pytest.approx(0.24) and t["ranks"][1]["host_ms"] == pytest.approx(0.28)
    assert t["launch_share"] == pytest.approx(0.24) and "launch overhead" in t["slowest_rank"]
    assert any("0.2 ms is launch overhead" in line for line in sentences(t))
    console = Console(record=True, width=200)
    print_traces(t, console)
    out = console.export_text()
    assert "launch" in out and "host-bound" in out and "0.2 ms is launch overhead" in out
    assert timeline(tmp_path)["ranks"][0]["launch"][1] == pytest.approx((0.42, 0.6))


def test_launch_calls_are_the_runtime_and_driver_calls_that_enqueue_device_work():
    from syncwise.doctor.trace import is_launch

    for name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                 "cudaLaunchCooperativeKernel", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cuMemcpyHtoDAsync_v2",
                 "cudaMemsetAsync", "hipLaunchKernel", "hipExtModuleLaunchKernel", "hipMemcpyWithStream"):
        assert is_launch({"cat": "cuda_runtime", "name": name}) and is_launch({"cat": "cuda_driver", "name": name})
    for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventRecord",
                 "cudaStreamWaitEvent", "cudaMalloc", "cudaFuncGetAttributes"):
        assert not is_launch({"cat": "cuda_runtime", "name": name})
    assert not is_launch({"cat": "cpu_op", "name": "cudaLaunchKernel"})   # by category as well as name


def test_a_cpu_run_says_launch_overhead_is_not_defined(tmp_path):
    traces = RunDir(tmp_path).traces
    traces.mkdir(parents=True)
    cpu = [_x("ProfilerStep#0", 0, 100, cat="user_annotation"), _x("aten::mm", 0, 40),
           _x("gloo:all_reduce", 40, 30, tid=2, cat="user_annotation")]
    (traces / "rank0.step1-1.json").write_text(json.dumps({"traceEvents": cpu, "syncwise": {"first_step": 1}}))
    t = summarize(tmp_path)
    assert t["ranks"][0]["launch_ms"] is None and t["launch_share"] is None
    assert t["ranks"][0]["host_ms"] == pytest.approx(0.03)
    assert any("not defined on a CPU trace" in line for line in sentences(t))
    console = Console(record=True, width=200)
    print_traces(t, console)
    assert "n/a" in console.export_text()


def test_a_gpu_trace_that_names_its_groups_splits_by_dimension_with_bus_bandwidth_and_a_timeline(tmp_path):
    # step [0, 1000) µs, compute kernels [0, 600); a tp all-reduce [500, 700) (100 of it beside compute) and an
    # fsdp all-gather [650, 900), groups named as torch's record_param_comms names them on NCCL
    info = {"pg_config": [{"pg_name": "3", "pg_desc": "mesh_tp", "pg_size": 4},
                          {"pg_name": "5", "pg_desc": "mesh_dp_shard", "pg_size": 2}]}
    events = [_x("ProfilerStep#0", 0, 1000, cat="user_annotation"), _x("sm90_gemm", 0, 600, tid=7, cat="kernel"),
              _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 500, 200, tid=8, cat="kernel",
                 **{"Process Group Name": "3", "In msg nelems": 250_000, "dtype": "Float"}),
              _x("ncclDevKernel_AllGather_RING_LL", 650, 250, tid=9, cat="kernel",
                 **{"Process Group Name": "5", "Group size": 2, "In msg nelems": 1_000_000, "dtype": "BFloat16"})]
    [s] = split_trace({"traceEvents": events, "distributedInfo": info}).steps
    assert set(s.dims) == {"tp", "fsdp"}
    assert s.dims["tp"] == pytest.approx({"ms": 0.2, "exposed_ms": 0.1})       # [600, 700) nothing computed beside
    assert s.dims["fsdp"] == pytest.approx({"ms": 0.25, "exposed_ms": 0.25})
    assert s.kinds["allreduce"]["group_size"] == 4 and s.kinds["allgather"]["group_size"] == 2
    # the timeline's lanes partition the step's communication: exposed + overlapped = the union [500, 900)
    assert s.spans["overlapped"] == [(0.5, 0.6)] and s.spans["exposed"] == [(0.6, 0.9)]
    assert s.spans["dim:tp"] == [(0.5, 0.7)] and s.spans["compute"] == [(0.0, 0.6)]
    traces = RunDir(tmp_path).traces
    traces.mkdir(parents=True)
    for rank in (0, 1):
        (traces / f"rank{rank}.step5-5.json").write_text(json.dumps(
            {"traceEvents": events, "distributedInfo": info, "syncwise": {"rank": rank, "first_step": 5}}))
    t = summarize(tmp_path, priced_bytes_s=2e9)
    ar = t["collectives"]["allreduce"]
    # nccl-tests' bus bandwidth: all-reduce 2(n-1)/n x 1 MB / 0.2 ms at n = 4 -> 7.5 GB/s, of a 2 GB/s priced link
    assert ar["bus_bytes_s"] == pytest.approx(2 * 3 / 4 * 1e6 / 2e-4) and ar["of_priced"] == pytest.approx(3.75)
    ag = t["collectives"]["allgather"]        # n - 1 shards of 2 MB crossed in 0.25 ms
    assert ag["bus_bytes_s"] == pytest.approx(2e6 / 2.5e-4)
    assert t["dimensions"]["fsdp"] == pytest.approx({"ms": 0.25, "exposed_ms": 0.25})
    line = timeline(tmp_path)
    assert line["step"] == 5 and set(line["ranks"]) == {0, 1} and line["ranks"][1]["dim:fsdp"] == [(0.65, 0.9)]

    class _Finding:  # the fields doctor's findings carry (syncwise.doctor.analyze.Finding)
        cause, evidence, details = "link", "exposed 0.3 ms", {}
    cite(_Finding, t)
    assert "profiled step(s) 5–5 agree" in _Finding.evidence and _Finding.details["trace"]["exposed_ms"] > 0


def test_collectives_take_their_size_and_group_from_the_flight_recorder_first_in_first_out_per_group():
    # a trace recorded without shapes: the sizes and groups come from the recorder's entries stored beside it. Two
    # groups: default_pg (two worker threads, 20 and 21) and preemption (thread 30); its 4-byte flag is created
    # after the first bucket and runs while the second bucket waits, then the loss scalar runs on default_pg
    base = 1_796_489_000_000_000_000
    rows = [{"pg": "0", "desc": "default_pg", "seq": 1, "op": "gloo:all_reduce", "sizes": [[1000]],
             "dtypes": ["Float"], "t_ns": base + 1_000_500},
            {"pg": "1", "desc": "preemption", "seq": 1, "op": "gloo:all_reduce", "sizes": [[1]], "dtypes": ["Int"],
             "t_ns": base + 2_000_500},
            {"pg": "0", "desc": "default_pg", "seq": 2, "op": "gloo:all_reduce", "sizes": [[2000]],
             "dtypes": ["BFloat16"], "t_ns": base + 3_000_500},
            {"pg": "0", "desc": "default_pg", "seq": 3, "op": "gloo:all_reduce", "sizes": [[1]], "dtypes": ["Float"],
             "t_ns": base + 4_000_500}]
    events = [_x("ProfilerStep#0", 0, 20_000),
              _x("c10d::allreduce_", 1_000, 10), _x("gloo:all_reduce", 1_100, 5_000, tid=20, cat="user_annotation"),
              _x("c10d::allreduce_", 2_000, 10), _x("c10d::allreduce_", 3_000, 10),
              _x("gloo:all_reduce", 3_100, 100, tid=30, cat="user_annotation"),   # the flag, not the bucket
              _x("gloo:all_reduce", 3_200, 6_000, tid=21, cat="user_annotation"),  # the second bucket
              _x("c10d::allreduce_", 4_000, 10),
              _x("gloo:all_reduce", 9_300, 50, tid=20, cat="user_annotation")]    # the loss scalar
    data = {"baseTimeNanoseconds": base, "traceEvents": events,
            "distributedInfo": {"pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2},
                                              {"pg_name": "1", "pg_desc": "preemption", "pg_size": 2}]},
            "syncwise": {"first_step": 5, "collectives": rows}}
    [s] = split_trace(data).steps
    assert s.kinds["allreduce"]["bytes"] == 4000 + 4 + 4000 + 4 and s.kinds["allreduce"]["count"] == 4
    assert s.payload_calls == 2 and s.payload_bytes == 8000          # the flag and the scalar are control
    assert set(s.dims) == {"dp", "control"}
    # dp: the first issue 1,000–1,010 and the buckets' executions 1,100–6,100 and 3,200–9,200 (the issues after
    # them inside; the scalar's execution, a control, left out)
    assert s.dims["dp"]["ms"] == pytest.approx((10 + 9_200 - 1_100) / 1e3)
    # the gradient buckets: the two payload executions on dp, in start order, nothing computed beside them
    assert [(b["bytes"], b["ms"], b["exposed_ms"]) for b in s.buckets] == [(4000, 5.0, 5.0), (4000, 6.0, 6.0)]
    # without the recorder's entries nothing is sized: every execution counts as a payload
    [bare] = split_trace({**data, "syncwise": {"first_step": 5}}).steps
    assert bare.payload_bytes is None and bare.payload_calls == 4 and bare.dims == {}


def test_a_blocking_wait_on_a_control_collective_is_exposed_communication_not_idle():
    # a pipeline's last stage waits 60 ms in the 4-byte loss broadcast for the first stage to finish its backward:
    # the execution alone is a control (skew, left out), syncwise's label around the blocking call is the wait
    base = 1_796_489_000_000_000_000
    rows = [{"pg": "0", "desc": "default_pg", "seq": 1, "op": "gloo:broadcast", "sizes": [[1]], "dtypes": ["Float"],
             "t_ns": base + 30_000_500}]
    events = [_x("ProfilerStep#0", 0, 100_000), _x("aten::mm", 0, 30_000),
              _x("c10d::broadcast_", 30_000, 20), _x("gloo:broadcast", 30_050, 59_950, tid=20, cat="user_annotation")]
    data = {"baseTimeNanoseconds": base, "traceEvents": events, "syncwise": {"first_step": 1, "collectives": rows}}
    [s] = split_trace(data).steps
    assert s.exposed_ms == pytest.approx(0.02) and s.idle_ms == pytest.approx(69.98)
    data["traceEvents"] = events + [_x("syncwise:wait broadcast", 29_990, 60_020, cat="user_annotation")]
    [s] = split_trace(data).steps
    assert s.exposed_ms == pytest.approx(60.02) and s.idle_ms == pytest.approx(9.99)  # the mm less the 10 µs inside
    assert s.kinds["broadcast"]["count"] == 1 and s.kinds["broadcast"]["bytes"] == 4


def test_profile_steps_traces_every_rank_and_doctor_splits_the_real_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "4", "--run-dir", str(run_dir),
                 "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1", "--ckpt.interval=0",
                 "--profile.steps=2:3"]) == 0
    assert sorted(p.name for p in RunDir(run_dir).traces.iterdir()) == ["rank0.step2-3.json", "rank1.step2-3.json"]
    traces = load_traces(run_dir)
    for rank in (0, 1):
        [t] = traces[rank]
        assert t.device == "cpu" and [s.step for s in t.steps] == [2, 3]
        for s in t.steps:
            assert 0 < s.comm_ms and 0 <= s.exposed_ms <= s.comm_ms + 1e-9 and s.compute_ms > 0
            # parts sum to the step within the trace's resolution (1 ns)
            assert abs(s.compute_ms + s.exposed_ms + s.idle_ms - s.step_ms) < 1e-6
            assert s.launch_ms is None and s.host_ms == s.idle_ms     # a CPU trace: nothing launched
            assert s.kinds["allreduce"]["count"] >= 1 and s.kinds["allreduce"]["bytes"] > 0
            assert "dp" in s.dims  # recorded without shapes: sizes and groups from the flight recorder
    capsys.readouterr()
    assert main(["doctor", str(run_dir), "--json", "-", "--no-predict"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["trace"]["ranks"]) == {"0", "1"} and "allreduce" in out["trace"]["collectives"]
    assert out["flight"] is None
    assert summarize(run_dir)["slowest_rank"]
    assert summarize(run_dir)["ranks"][0]["buckets"][0]["bytes"] > 8  # the gradient bucket, its overlap
    # report draws the last step every rank profiled, per rank, from the same intervals
    assert main(["report", str(run_dir)]) == 0
    assert "step 3 of its profiler traces drawn per rank" in capsys.readouterr().out
    assert timeline(run_dir)["ranks"][1]["compute"]


def test_bad_profile_values_are_refused_by_both_doors_and_off_is_the_default():
    for key, value in (("profile.steps", "3:2"), ("profile.steps", "two"), ("profile.every", "1")):
        with pytest.raises(ConfigError) as e:
            build_config(None, {key: value})
        assert e.value.field == key and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="one schedule at a time") as e:
        build_config(None, {"profile.steps": "2:3", "profile.every": "5"})
    assert e.value.field == "profile.every"
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, field in (({"profile_steps": "0:3"}, "profile_steps"), ({"profile_every": -2}, "profile_every"),
                      ({"profile_steps": "1:2", "profile_every": 4}, "profile_every")):
        with pytest.raises(ConfigError) as e:
            OptimizedTrainer(model, opt, nn.functional.mse_loss, mixed_precision=False, **kw)
        assert e.value.field == field
    assert build_config(None, {}).profile.steps == "" and build_config(None, {}).profile.every == 0


def _skip_one_collective(rank, world, where):
    """Rank 1 skips the third all-reduce on a group with a short timeout; both dump their flight recorders."""
    import torch.distributed as dist

    from syncwise.comm import flight

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    x = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(x, group=group)
    report = ""
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(8), group=group)
        except RuntimeError as e:
            report = f"rank 0 timed out: {type(e).__name__}"
    path = flight.dump(RunDir(where).flight_dump(rank), rank, world, report)
    dist.barrier()
    return str(path)


def test_flight_dumps_name_the_first_collective_a_rank_did_not_enter(tmp_path):
    from distributed import run_workers

    paths = run_workers(_skip_one_collective, 2, str(tmp_path))
    if paths[0] == "None":
        pytest.skip("this torch has no flight recorder")
    hang = doctor_flight.summarize(tmp_path)
    m = hang["first_mismatch"]
    assert m["op"].endswith("all_reduce") and m["entered"] == [0] and m["missing"] == [1]
    assert m["sizes"] == [[8]] and m["frame"] and "test_trace.py" in m["frame"]
    assert hang["reports"] == ["rank 0 timed out: RuntimeError"] or hang["reports"][0].startswith("rank 0")
    # rank 1 stopped or killed: no dump of its own; the last collective rank 0 entered, rank 1 named as silent
    RunDir(tmp_path).flight_dump(1).unlink()
    m = doctor_flight.summarize(tmp_path)["first_mismatch"]
    assert m["op"].endswith("all_reduce") and m["sizes"] == [[8]] and m["no_dump"] == [1]
    assert "no dump from rank(s) [1]" in doctor_flight.sentence(doctor_flight.summarize(tmp_path))


def test_a_rank_that_stops_inside_a_tensor_parallel_step_is_named_by_doctor(tmp_path, capsys):
    # `hang:rank=1,step=2`: rank 1 stops as step 2 begins; rank 0 times out inside DTensor's first collective of
    # the step, dumps its flight recorder with its report; doctor names that collective and rank 1 as absent.
    # A 1 s preemption grace: torchrun's SIGTERM then ends the stopped rank 1 s later instead of its SIGKILL 30 s
    # later (the stopped rank's handler only raises the flag; the grace timer is what exits)
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "4", "--run-dir", str(run_dir),
                 "--data.seq_len=32", "--train.val_interval=0", "--ckpt.interval=0", "--ckpt.preempt_grace_s=1",
                 "--parallel.tp=2",
                 "--dist.timeout_s=3", "--inject-fault", "hang:rank=1,step=2"]) != 0
    capsys.readouterr()
    main(["doctor", str(run_dir), "--json", "-", "--no-predict"])
    hang = json.loads(capsys.readouterr().out)["flight"]
    m = hang["first_mismatch"]
    assert m["op"] and m["seq"] is not None and m["frame"]
    assert set(m["missing"]) | set(m["no_dump"]) == {1} and 0 in hang["ranks_dumped"]
    assert hang["reports"] and "did not complete" in hang["reports"][0]


def _side_by_side():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hta_side_by_side.py"
    spec = importlib.util.spec_from_file_location("hta_side_by_side", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_side_by_side_synthetic_trace_splits_as_it_was_built_and_hta_stays_optional(tmp_path):
    # benchmarks/hta_side_by_side.py's Kineto-format trace, rank 0 (µs per step, by construction): forward 24
    # GEMMs of 60, backward 24 of 150, optimizer 6 of 50 -> 5,340 of kernels; three 700 µs all-reduces, the last
    # after the backward (exposed); each forward launch leaves the device idle 13 µs (8 in the call, 5 until the
    # kernel starts), as does the input copy's -> 25 x 13 = 325 µs of launch overhead
    bench = _side_by_side()
    data = bench.synthetic_gpu_trace(0)
    t = split_trace(data)
    assert t.device == "gpu" and [s.step for s in t.steps] == [10, 11, 12]
    for s in t.steps:
        assert s.comm_ms == pytest.approx(2.1) and s.exposed_ms == pytest.approx(0.7)
        assert s.launch_ms == pytest.approx(0.325)
        assert s.compute_ms + s.exposed_ms + s.launch_ms + s.host_ms == pytest.approx(s.step_ms, abs=1e-9)
        assert s.kinds["allreduce"]["count"] == 3
    path = tmp_path / "rank0.step10-12.json"
    path.write_text(json.dumps(data))
    assert bench.syncwise_side(path)["compute_kernels_only_ms"] == pytest.approx(3 * 5.34)
    # HTA is optional: syncwise's package never imports it
    from pathlib import Path

    import syncwise
    src = Path(syncwise.__file__).parent
    assert not [p for p in src.rglob("*.py") if re.search(r"^\s*(import|from)\s+hta\b", p.read_text(), re.M)]


def test_the_compressors_labelled_work_is_its_own_part_of_the_step():
    # step [0, 100) µs: on the main thread an encode inside the label [0, 10) (its operator is the compressor's, not
    # compute), then compute [10, 40); on the compressor's thread its label [40, 90) around its all-reduce [60, 70)
    events = [_x("ProfilerStep#0", 0, 100, cat="user_annotation"),
              _x("syncwise:compress", 0, 10, cat="user_annotation"), _x("aten::mul", 2, 6), _x("aten::mm", 10, 30),
              _x("syncwise:compress", 40, 50, tid=3, cat="user_annotation"), _x("aten::topk", 42, 10, tid=3),
              _x("gloo:all_reduce", 60, 10, tid=2, cat="user_annotation", **{"Input Dims": [[1000]],
                                                                             "Input type": ["float"]}),
              # a control collective (a flag, issued a step before and read later) in flight the whole step: the
              # ranks' skew, not communication the step waits on
              _x("gloo:all_reduce", 0, 100, tid=4, cat="user_annotation", **{"Input Dims": [[1]],
                                                                             "Input type": ["int"]})]
    [s] = split_trace({"traceEvents": events}).steps
    assert s.kinds["allreduce"]["count"] == 2 and s.comm_ms == pytest.approx(0.010)
    assert s.compute_ms == pytest.approx(0.030)                 # [10, 40): not the encode, not the worker's ops
    assert s.compress_ms == pytest.approx(0.050)   # [0, 10) ∪ [40, 60) ∪ [70, 90): its collective is communication
    assert s.exposed_ms == pytest.approx(0.010) and s.idle_ms == pytest.approx(0.010)
    assert s.compute_ms + s.exposed_ms + s.compress_ms + s.idle_ms == pytest.approx(s.step_ms)
    assert s.spans["compress"] == [(0.0, 0.01), (0.04, 0.06), (0.07, 0.09)]
    assert s.payload_calls == 1 and s.payload_bytes == 4000


def _summary(*ranks, **extra):
    """A trace summary (``summarize``'s shape) of ranks given as (step, compute, exposed[, compress]) ms."""
    out = {}
    for r, (step, compute, exposed, *rest) in enumerate(ranks):
        compress = rest[0] if rest else 0.0
        out[r] = {"step_ms": step, "compute_ms": compute, "exposed_ms": exposed, "compress_ms": compress,
                  "idle_ms": step - compute - exposed - compress, "payload_calls": extra.get("calls", 2),
                  "payload_bytes": extra.get("sent")}
    return {"ranks": out}


def test_the_trace_names_each_planted_cause_with_the_time_it_adds():
    from syncwise.doctor.trace import added_ms, name_causes

    # a straggler: rank 0 waits 25 ms longer in the collectives than rank 1
    slow = _summary((100, 50, 29), (100, 45, 4))
    [c] = name_causes(slow)
    assert c["cause"] == "straggler" and c["rank"] == 1 and c["ms"] == pytest.approx(25)
    # what it adds: its lateness beyond what rank 1 already had without it; an early rank had slack, which is free
    assert added_ms(slow, _summary((80, 50, 5), (80, 45, 9)), "straggler") == pytest.approx(25)
    assert added_ms(slow, _summary((80, 50, 9), (80, 45, 5)), "straggler") == pytest.approx(21)
    # gradients sent as they are: the exposed communication (the least exposed rank's), named by the collectives
    grads = 20 * 2**20
    small = _summary((100, 60, 20), (100, 60, 22), calls=40)
    assert [x["cause"] for x in name_causes(small, grad_bytes=grads)] == ["buckets_too_small"]
    assert name_causes(small, grad_bytes=grads)[0]["ms"] == pytest.approx(20)
    assert added_ms(small, _summary((90, 60, 8), (90, 60, 9)), "buckets_too_small") == pytest.approx(12)
    # what the backward does for the buckets counts too: 10 ms more compute a step with a collective per tensor
    assert added_ms(small, _summary((80, 50, 8), (80, 50, 9)), "buckets_too_small") == pytest.approx(12 + 10)
    one = _summary((100, 60, 30), (100, 60, 30), calls=1)
    assert [x["cause"] for x in name_causes(one, grad_bytes=grads)] == ["buckets_too_large"]
    assert [x["cause"] for x in name_causes(_summary((100, 60, 30), (100, 60, 30), calls=4),
                                            grad_bytes=grads)] == ["link"]
    # a compressor on the critical path: its labelled work; what it adds is that and the exposed change
    comp = _summary((100, 50, 4, 30), (100, 50, 5, 30))
    assert [x["cause"] for x in name_causes(comp, compressor="topk:ratio=0.01")] == ["compression"]
    assert added_ms(comp, _summary((70, 50, 6), (70, 50, 6)), "compression") == pytest.approx(30 - 2)
    # a pipeline: the stages' exposed sends and receives (the mean stage's)
    pipe = _summary((100, 40, 50), (100, 60, 30))
    [b] = name_causes(pipe, pp=2)
    assert b["cause"] == "pipeline_bubble" and b["ms"] == pytest.approx(40)
    assert added_ms(pipe, _summary((80, 40, 30), (80, 60, 10)), "pipeline_bubble") == pytest.approx(20)
    # under min_share of the step: not named
    assert name_causes(_summary((100, 80, 2), (100, 80, 2), calls=40), grad_bytes=grads) == []


def test_a_compressed_run_traces_the_compressors_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "3", "--run-dir", str(run_dir),
                 "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1", "--ckpt.interval=0",
                 "--compress", "topk:ratio=0.1", "--profile.steps=2:3"]) == 0
    t = summarize(run_dir)
    for rank in (0, 1):
        v = t["ranks"][rank]
        assert v["compress_ms"] > 0     # the label reached the trace from the compressor's worker thread
        assert v["compute_ms"] + v["exposed_ms"] + v["compress_ms"] + v["idle_ms"] == pytest.approx(v["step_ms"])
    capsys.readouterr()
    assert main(["doctor", str(run_dir), "--json", "-", "--no-predict"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["trace"]["causes"], list)
