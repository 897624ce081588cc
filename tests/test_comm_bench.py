import argparse
import json

import pytest

from distributed import run_workers
from syncwise.comm import CommContext, CommStats
from syncwise.comm.bench import (OPS, busbw_factor, format_bytes, iterations_for, parse_ops, parse_size, parse_sizes,
                                 run_sweep)
from syncwise.commands import comm_bench
from syncwise.errors import ConfigError

FIELDS = {"op", "bytes", "count", "dtype", "time_s", "time_min_s", "time_mean_s", "algbw_gbps", "busbw_gbps",
          "algbw_GBps", "busbw_GBps", "iters", "world_size", "nodes", "procs_per_node", "backend", "check"}


def test_size_parsing():
    assert parse_size("1KB") == 1024 and parse_size("64MB") == 64 << 20 and parse_size("1gb") == 1 << 30
    assert parse_size("512") == 512 and parse_size("2KiB") == 2048 and parse_size("1.5KB") == 1536
    assert parse_sizes("1KB-8KB") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1KB-256MB")[-1] == 256 << 20 and len(parse_sizes("1KB-256MB")) == 19
    assert parse_sizes("3KB-16KB") == [3072, 6144, 12288]  # lo * 2^k <= hi, as nccl-tests -f 2
    assert parse_sizes("64MB,1MB,1MB") == [1 << 20, 64 << 20]
    assert parse_sizes("1KB-2KB,1MB") == [1024, 2048, 1 << 20]
    for bad in ("", "64XB", "MB", "8MB-1MB", "0B", "1.3B", "-1KB"):
        with pytest.raises(ConfigError) as e:
            parse_sizes(bad)
        assert e.value.field == "sizes"


def test_op_parsing_and_busbw_factors():
    assert parse_ops("all") == list(OPS)
    assert parse_ops("broadcast, all_reduce") == ["broadcast", "all_reduce"]
    with pytest.raises(ConfigError, match="allreduce"):
        parse_ops("allreduce,broadcast")
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("hier_all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw_factor(op, 4) == pytest.approx(0.75)
    assert busbw_factor("broadcast", 16) == 1.0
    assert busbw_factor("all_reduce", 1) == 0.0
    assert iterations_for(1024, 20) == 20 and iterations_for(256 << 20, 20) == 4 and iterations_for(2 << 30, 20) == 3
    assert format_bytes(1024) == "1KB" and format_bytes(256 << 20) == "256MB" and format_bytes(100) == "100B"


def _sweep(rank, world, sizes):
    stats = CommStats()
    ctx = CommContext()
    rows = run_sweep(OPS, sizes, iters=2, warmup=1, ctx=ctx, stats=stats)
    ctx.close()
    return rows, stats.snapshot()


def test_tiny_real_sweep_on_2_nodes_x_2_has_documented_fields():
    sizes = [1024, 4100]  # 4100 B is not a multiple of 4 ranks x 4 bytes: rounded down to 4096
    res = run_workers(_sweep, 4, sizes, local_world_size=2)
    rows, snap = res[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for op in OPS for b in (1024, 4096)]
    for r in rows:
        assert set(r) == FIELDS
        assert r["check"] == "ok" and r["world_size"] == 4 and (r["nodes"], r["procs_per_node"]) == (2, 2)
        assert r["time_s"] > 0 and r["time_min_s"] <= r["time_s"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] * 8 / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(r["op"], 4))
        assert r["busbw_GBps"] == pytest.approx(r["busbw_gbps"] / 8)
    # every rank reports the same rows (times are the max over ranks)
    assert all(other[0] == rows for other in res)
    # bytes counted per call: 1 check + 1 warm-up + 2 timed calls per (op, size)
    calls = 4
    # all_reduce op + hier_all_reduce's steps (on gloo: intra-node all-reduce of the whole buffer, then the
    # cross-node all-reduce of a half-size shard)
    assert snap["all_reduce"]["bytes"] == 2 * calls * (1024 + 4096) + calls * (512 + 2048)
    assert snap["all_gather"]["bytes"] == calls * (256 + 1024) + calls * (512 + 2048)  # + hier's all-gather
    assert snap["broadcast"]["bytes"] == calls * (1024 + 4096)
    assert snap["all_to_all"]["bytes"] == calls * (1024 + 4096)


def _args(**kw):
    parser = argparse.ArgumentParser()
    comm_bench.add_arguments(parser)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return parser.parse_args(argv)


def test_cli_rejects_bad_input_before_launching():
    for kw, field in (({"ops": "all_reduce,gossip"}, "ops"), ({"sizes": "1KB-"}, "sizes"),
                      ({"nproc": 0}, "nproc"), ({"dtype": "int4"}, "dtype"),
                      ({"nproc": 3, "procs_per_node": 2}, "procs-per-node")):
        with pytest.raises(ConfigError) as e:
            comm_bench.run(_args(**kw))
        assert e.value.field == field


def test_cli_local_sweep_writes_json_and_plot(tmp_path):
    out = tmp_path / "res" / "bench.json"
    code = comm_bench.run(_args(nproc=2, ops="all_reduce,hier_all_reduce", sizes="4KB,64KB", iters=2, warmup=1,
                                json=out))
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_reduce", 4096), ("all_reduce", 65536),
                                                     ("hier_all_reduce", 4096), ("hier_all_reduce", 65536)]
    assert all(set(r) == FIELDS and r["world_size"] == 2 and r["check"] == "ok" for r in rows)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
