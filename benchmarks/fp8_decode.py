"""fp8 decode on CPU: the 256-entry table (`FP8Compressor._decode_sum`) against the `.float()` conversion it
replaced, side by side in one process, 1 thread. The conversions are bit-identical; the sums agree to
fp32 rounding (the table path accumulates with addcmul, which may fuse the multiply-add).

    python benchmarks/fp8_decode.py --elements 1048576 --world 2 --repeats 20 --json benchmarks/results/fp8_decode.json
"""
import argparse
import json
import statistics
import time

import torch

from syncwise.compress.cast import FP8Compressor, _FP8, _fp8_table


def decode_with_float(gathered: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The previous decode: fp8 -> fp32 with .float(), then scale and sum over ranks."""
    nb = -(-n // block)
    world = gathered.shape[0]
    q = torch.nn.functional.pad(gathered[:, :n].contiguous().view(_FP8).float(), (0, nb * block - n))
    scale = gathered[:, n:].contiguous().view(torch.float32).view(world, nb, 1)
    return (q.view(world, nb, block) * scale).sum(0).view(-1)[:n]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    comp, n = FP8Compressor(), args.elements
    payloads = [comp._encode(torch.randn(n, generator=torch.Generator().manual_seed(r)), [n], ["g"], r)[0]
                for r in range(args.world)]
    gathered = torch.stack(payloads)
    x = torch.randn(n)
    table = comp._decode_sum(gathered, [n], n)
    codes = gathered[:, :n]
    assert torch.equal(torch.index_select(_fp8_table(gathered.device), 0, codes.reshape(-1).to(torch.int32)),
                       codes.contiguous().view(_FP8).float().reshape(-1)), "conversions differ"
    reference = decode_with_float(gathered, n, comp.config.block)
    # a sum of two products can cancel: compare against the products' scale, not the (small) result's
    assert (table - reference).abs().max() <= 1e-6 * reference.abs().max(), "sums differ beyond rounding"
    row = {"elements": n, "world": args.world,
           "float_ms": median_ms(lambda: decode_with_float(gathered, n, comp.config.block), args.repeats),
           "table_ms": median_ms(lambda: comp._decode_sum(gathered, [n], n), args.repeats),
           "encode_ms": median_ms(lambda: comp._encode(x, [n], ["g"], 0), args.repeats)}
    row["speedup"] = row["float_ms"] / row["table_ms"]
    print(f"fp8 decode+sum of {args.world} x {n} elements, 1 thread: .float() {row['float_ms']:.2f} ms, "
          f"table {row['table_ms']:.2f} ms -> {row['speedup']:.1f}x; encode {row['encode_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
