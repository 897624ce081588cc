"""fp8 decode on CPU: the chunked decode into a buffer made while packing (`FP8Compressor._decode_sum(..., out=)`,
issue 26) against the whole-bucket decode it replaced (two fresh 4-bytes-per-element temporaries per payload),
paired and interleaved in one process, 1 thread. The two are bit-identical (checked here too).

    python benchmarks/fp8_decode_chunked.py --json benchmarks/results/fp8_decode_chunked.json
"""
import argparse
import json
import statistics
import time

import torch

from syncwise.compress.cast import FP8Compressor, _fp8_table


def decode_whole(comp: FP8Compressor, gathered: torch.Tensor, n: int) -> torch.Tensor:
    """The previous decode: each rank's codes through the table at once, into fresh buffers."""
    b = comp.config.block
    nb = -(-n // b)
    world = gathered.shape[0]
    scales = gathered[:, n:].contiguous().view(torch.float32).view(world, nb, 1)
    table = _fp8_table(gathered.device)
    total = None
    for w in range(world):
        q = torch.index_select(table, 0, gathered[w, :n].to(torch.int32))
        q = (q if n == nb * b else torch.nn.functional.pad(q, (0, nb * b - n))).view(nb, b)
        total = q.mul_(scales[w]) if total is None else total.addcmul_(q, scales[w])
    return total.view(-1)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="1048576,6500000", help="comma list of bucket sizes (elements)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    comp = FP8Compressor()
    rows = []
    for n in (int(x) for x in args.elements.split(",")):
        gathered = torch.stack([comp._encode(torch.randn(n), [n], ["a"], r)[0] for r in range(args.world)])
        out = comp._decode_buffer(n, gathered.device)
        assert torch.equal(decode_whole(comp, gathered, n), comp._decode_sum(gathered, [n], n, out=out))
        whole, chunked = [], []
        for _ in range(args.repeats):  # interleaved: a drift of the machine's speed hits both alike
            t = time.perf_counter()
            decode_whole(comp, gathered, n)
            whole.append(time.perf_counter() - t)
            t = time.perf_counter()
            comp._decode_sum(gathered, [n], n, out=out)
            chunked.append(time.perf_counter() - t)
        row = {"elements": n, "world": args.world, "whole_ms": 1e3 * statistics.median(whole),
               "chunked_ms": 1e3 * statistics.median(chunked)}
        row["speedup"] = row["whole_ms"] / row["chunked_ms"]
        rows.append(row)
        print(f"{n:>10} elements: whole {row['whole_ms']:.2f} ms, chunked {row['chunked_ms']:.2f} ms, "
              f"{row['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/fp8_decode_chunked.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "json" and v is not None),
                "where": "1 thread on a shared 2-core machine (other jobs running): ratios of paired, interleaved "
                         "timings only", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
