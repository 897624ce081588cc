"""Compressors: spec parsing, correctness against plain all-reduce, error feedback, bytes, state."""
import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_workers
from syncwise.compress import (COMPRESSORS, GradientCompressor, Int8Compressor, PowerSGDCompressor,
                               TopKCompressor, describe_compressors, parse_compress_spec)
from syncwise.errors import ConfigError

WORLD = 2
SHAPES = {"w1": (64, 96), "w2": (128, 64), "w3": (64, 96), "b": (96,)}  # w1/w3 share a shape (batched)


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _run(comp, rank, step, flags=None):
    """One averaging step over SHAPES; returns (inputs, outputs, bytes this rank sent)."""
    inp = _grads(rank, step)
    ts = [v.clone() for v in inp.values()]
    before = comp.stats.total_bytes  # each compressor counts its own collectives
    comp.average(ts, list(inp), None, flags)
    return inp, dict(zip(inp, ts)), comp.stats.total_bytes - before


def _exact_avg(inp):
    out = {}
    for k, v in inp.items():
        t = v.clone()
        dist.all_reduce(t)  # reference: torch's own all-reduce (tests may call it directly)
        out[k] = t / dist.get_world_size()
    return out


def _residuals(comp, keys):
    return {k: comp._state.get(k, {}).get("residual", torch.zeros(SHAPES[k])).clone() for k in keys}


def _checks(rank, world):
    torch.manual_seed(0)
    res = {}
    keys = list(SHAPES)
    n_all = sum(math.prod(s) for s in SHAPES.values())

    # lossless / cast paths against plain all-reduce, and their byte counts
    for spec in ["none", "fp16", "bf16", "fp8", "int8"]:
        comp = parse_compress_spec(spec)
        inp, out, nbytes = _run(comp, rank, 0)
        ref = _exact_avg(inp)
        res[spec] = {"err": max(float((out[k] - ref[k]).abs().max()) for k in keys),
                     "amax": max(float(ref[k].abs().max()) for k in keys),
                     "bytes": nbytes, "equal": all(torch.equal(out[k], ref[k]) for k in keys), "out": out}

    # error feedback: what each rank sent (g + old residual - new residual) sums to world * output
    for spec in ["sign", "topk:ratio=0.05", "randomk:ratio=0.05", "topk:ratio=0.05,momentum=0.0",
                 "fp8:error_feedback=true"]:
        comp = parse_compress_spec(spec)
        _run(comp, rank, 0)
        old = _residuals(comp, keys)
        inp, out, nbytes = _run(comp, rank, 1)
        new = _residuals(comp, keys)
        res[spec] = {"sent": {k: inp[k] + old[k] - new[k] for k in keys}, "out": out, "bytes": nbytes,
                     "old_nonzero": any(bool(old[k].abs().sum() > 0) for k in keys)}

    # PowerSGD: per rank, output + new residual == gradient + old residual; batched shapes; 2 all-reduces
    comp = PowerSGDCompressor(rank=2, start_iter=1, min_compression_rate=1.0)
    c0 = comp.stats.snapshot().get("all_reduce", {}).get("calls", 0)
    _run(comp, rank, 0)  # warm-up step: uncompressed
    c1 = comp.stats.snapshot()["all_reduce"]["calls"]
    _run(comp, rank, 1)  # first compressed step: leaves a residual
    c2 = comp.stats.snapshot()["all_reduce"]["calls"]
    old = _residuals(comp, keys)
    inp, out, nbytes = _run(comp, rank, 2)
    new = _residuals(comp, keys)
    mats = ["w1", "w2", "w3"]  # the 1-D bias is never compressed (plain average, no residual)
    res["powersgd"] = {"conserved": max(float((out[k] + new[k] - inp[k] - old[k]).abs().max()) for k in mats),
                       "old_nonzero": all(bool(old[k].abs().sum() > 0) for k in mats),
                       "calls": (c1 - c0, c2 - c1), "bytes": nbytes, "out": out}

    # PowerSGD reproduces a rank-r average exactly: each rank holds a different rank-1 matrix
    g = torch.Generator().manual_seed(7 + rank)
    mat = torch.outer(torch.randn(200, generator=g), torch.randn(150, generator=g))
    ref = _exact_avg({"m": mat})["m"]
    comp = PowerSGDCompressor(rank=2, start_iter=0)
    t = mat.clone()
    comp.average([t], ["m"], None)
    res["powersgd_exact"] = float((t - ref).abs().max() / ref.abs().max())

    # state_dict round trip: identical next step (residuals, Q, counters, RNG replay)
    for spec in ["int8", "sign", "topk:ratio=0.05,momentum=0.9", "randomk:ratio=0.05",
                 "powersgd:rank=2,start_iter=1", "fp8:error_feedback=true"]:
        a = parse_compress_spec(spec)
        for step in range(2):
            _run(a, rank, step)
        b = parse_compress_spec(spec)
        b.load_state_dict(a.state_dict())
        _, out_a, _ = _run(a, rank, 2)
        _, out_b, _ = _run(b, rank, 2)
        res["sd:" + spec] = all(torch.equal(out_a[k], out_b[k]) for k in keys)

    # policy flags: an uncompressed tensor is averaged exactly, as fp32 bytes in the same all-gather
    comp = TopKCompressor(ratio=0.05)
    inp, out, nbytes = _run(comp, rank, 0, flags=[True, True, True, False])
    res["flags"] = {"bias_exact": torch.equal(out["b"], _exact_avg({"b": inp["b"]})["b"]), "bytes": nbytes}

    # the seed API builds working compressors
    gc = GradientCompressor(compression_ratio=0.05, sparsity_method="powersgd")
    res["seed_rank"] = gc.compressor.rank_for(128, 64)
    res["n_all"] = n_all
    return res


def _to_numpy(obj):
    """Tensors cannot cross the result queue after the worker exits (shared-memory handles): send numpy."""
    if torch.is_tensor(obj):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    return obj


def _to_torch(obj):
    if hasattr(obj, "__array__") and not isinstance(obj, (bool, int, float)):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    return obj


def _checks_plain(rank, world):
    return _to_numpy(_checks(rank, world))


@pytest.fixture(scope="module")
def results():
    return [_to_torch(r) for r in run_workers(_checks_plain, WORLD)]


def _n(k):
    return math.prod(SHAPES[k])


def test_none_equals_plain_all_reduce(results):
    for r in results:
        assert r["none"]["equal"]
        assert r["none"]["bytes"] == 4 * r["n_all"]


# Every compressor with state carries a 4-byte "this rank's bucket was non-finite" flag in its own collective
# (the last 4 bytes of an all-gather payload, one fp32 element of PowerSGD's / random-k's all-reduce).
FLAG = 4


def test_casts_within_precision_and_bytes(results):
    for r in results:
        amax = r["fp16"]["amax"]
        assert r["fp16"]["err"] <= amax * 2 ** -10
        assert r["bf16"]["err"] <= amax * 2 ** -7
        assert r["fp8"]["err"] <= amax * 2 ** -3   # e4m3: 3 mantissa bits, per-block scale
        assert r["fp8"]["err"] > 0                 # and it really is lossy
        assert r["fp16"]["bytes"] == r["bf16"]["bytes"] == 2 * r["n_all"]
        n = r["n_all"]
        assert r["fp8"]["bytes"] == n + 4 * math.ceil(n / 128) + FLAG
        assert r["int8"]["bytes"] == n + 4 * math.ceil(n / 1024) + FLAG
        assert r["int8"]["err"] <= 2 * amax / 127 + 1e-6
    # every rank applies the same average
    for spec in ["fp16", "bf16", "fp8", "int8"]:
        assert all(torch.equal(results[0][spec]["out"][k], results[1][spec]["out"][k]) for k in SHAPES)


@pytest.mark.parametrize("spec", ["sign", "topk:ratio=0.05", "randomk:ratio=0.05", "fp8:error_feedback=true"])
def test_error_feedback_conserves_mass(results, spec):
    for k in SHAPES:
        total_sent = sum(r[spec]["sent"][k] for r in results)
        assert torch.allclose(total_sent, WORLD * results[0][spec]["out"][k], atol=1e-5)
        assert torch.equal(results[0][spec]["out"][k], results[1][spec]["out"][k])
    assert results[0][spec]["old_nonzero"]


def test_powersgd_conserves_mass_and_uses_two_all_reduces(results):
    for r in results:
        assert r["powersgd"]["conserved"] < 1e-5 and r["powersgd"]["old_nonzero"]
        assert r["powersgd"]["calls"] == (1, 2)
        # P (n x 2) and Q (m x 2) of the three matrices, plus the uncompressed bias, in fp32
        p = 64 * 2 + 128 * 2 + 64 * 2
        q = 96 * 2 + 64 * 2 + 96 * 2
        assert r["powersgd"]["bytes"] == 4 * (p + q + 96) + FLAG
    for k in SHAPES:
        assert torch.equal(results[0]["powersgd"]["out"][k], results[1]["powersgd"]["out"][k])


def test_powersgd_reproduces_low_rank_average(results):
    for r in results:
        assert r["powersgd_exact"] < 1e-5


def test_topk_sends_exactly_k_values_and_indices(results):
    k = sum(math.ceil(0.05 * _n(s)) for s in SHAPES)
    for r in results:
        assert r["topk:ratio=0.05"]["bytes"] == 8 * k + FLAG  # fp32 value + int32 index each
        assert r["randomk:ratio=0.05"]["bytes"] == 4 * k + FLAG  # shared indices: values only
        assert r["sign"]["bytes"] == math.ceil(r["n_all"] / 8) + 4 * len(SHAPES) + FLAG
        k_big = sum(math.ceil(0.05 * _n(s)) for s in ["w1", "w2", "w3"])
        assert r["flags"]["bytes"] == 8 * k_big + 4 * _n("b") + FLAG
        assert r["flags"]["bias_exact"]


def test_state_dict_round_trip_gives_identical_next_step(results):
    for r in results:
        for key, ok in r.items():
            if key.startswith("sd:"):
                assert ok, key


def test_seed_api_derives_powersgd_rank_from_ratio(results):
    assert results[0]["seed_rank"] == int(0.05 * 128 * 64 / (128 + 64))


def test_int8_is_unbiased():
    comp = Int8Compressor(chunk=64)
    x = torch.randn(256)
    draws = 400
    acc = torch.zeros_like(x)
    for i in range(draws):
        comp._state["x"] = {"count": i}  # a new replayable seed per draw
        payload, _ = comp._encode(x, [256], ["x"], rank=0)
        acc += comp._decode_sum(payload.view(1, -1), [256], 256)
    mean = acc / draws
    step = x.view(-1, 64).abs().amax(1).repeat_interleave(64) / 127
    # one draw is off by < 1 step (variance <= step^2/4); the mean of 400 is within ~5 sigma
    assert ((mean - x).abs() <= 5 * step * 0.5 / math.sqrt(draws)).all()
    one = comp._decode_sum(comp._encode(x, [256], ["x"], 0)[0].view(1, -1), [256], 256)
    assert (one - x).abs().max() > 1e-4  # a single draw is not exact


def test_spec_parsing_and_errors():
    c = parse_compress_spec("powersgd:rank=8,warm_start=false,min_compression_rate=1.5")
    assert (c.config.rank, c.config.warm_start, c.config.min_compression_rate) == (8, False, 1.5)
    assert parse_compress_spec("topk:ratio=0.01").config.ratio == 0.01
    assert parse_compress_spec(" FP16 ").name == "fp16"
    for bad in ["zip", "topk:ratio", "topk:rank=3", "int8:chunk=abc", "powersgd:warm_start=maybe", "",
                "topk:ratio=0", "int8:levels=300"]:
        with pytest.raises(ConfigError) as e:
            parse_compress_spec(bad)
        assert e.value.field == "compress"
    with pytest.raises(ConfigError) as e:
        parse_compress_spec("nope:x=1")
    assert "powersgd" in e.value.accepted and "topk" in e.value.accepted
    with pytest.raises(ConfigError) as e:
        parse_compress_spec("topk:bogus=1")
    assert "ratio" in e.value.accepted
    text = describe_compressors()
    assert all(name in text for name in COMPRESSORS)
    with pytest.raises(ConfigError):
        GradientCompressor(sparsity_method="magic")
    with pytest.raises(ConfigError):
        GradientCompressor(communication_backend="mpi")
    with pytest.raises(ConfigError):
        GradientCompressor(compression_ratio=2.0)
    assert GradientCompressor(0.1, "topk").compressor.config.ratio == 0.1
    assert GradientCompressor(0.1, "sign", error_feedback=False).compressor.config.error_feedback is False
    with pytest.raises(Exception) as e:
        parse_compress_spec("topk").load_state_dict(parse_compress_spec("sign").state_dict())
    assert "sign" in str(e.value)
