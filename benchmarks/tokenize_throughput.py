"""Tokenize throughput of `--data.tokenizer` (issue 29): a parquet corpus built from this machine's Python standard
library sources (real text, no download), a byte-level BPE tokenizer trained on part of it and saved as
tokenizer.json, then ``syncwise.data.tokenized.prepare`` with 1 and N tokenizing processes (a fresh cache each) and a
second run on the same cache (reuse: nothing tokenized again).

    python3 benchmarks/tokenize_throughput.py --mb 64 --workers 1 2 --out benchmarks/results/tokenize-throughput.json

Reported per worker count (each run in a fresh process): tokens, seconds, tokens/s, speed-up over 1 process, CPU
seconds of the main process and of the tokenizing processes, the 1-minute load average, and how far the main
process's RSS grew above its level after importing pyarrow and loading the tokenizer, against the shard size; for the reuse run, its seconds and whether
the shards were left untouched.
The cores are the machine's (``os.sched_getaffinity``); on a shared machine the N-process figure is bounded by the
cores actually free.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def stdlib_documents(limit_bytes: int) -> list[str]:
    """The stdlib's .py files (tests excluded), repeated in order until ``limit_bytes`` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "site-packages"} & set(p.parts))
    docs, size = [], 0
    while size < limit_bytes:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            docs.append(text)
            size += len(text.encode())
            if size >= limit_bytes:
                break
    return docs


def write_parquet(docs: list[str], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("text", pa.string()), ("id", pa.int64())])) as w:
        for at in range(0, len(docs), 128):  # row groups of 128 documents (~2 MB)
            part = docs[at:at + 128]
            w.write_table(pa.table({"text": part, "id": list(range(at, at + len(part)))}))


def train_tokenizer(docs: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=64, help="corpus size in MB of text")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="benchmarks/results/tokenize-throughput.json")
    args = ap.parse_args(argv)
    from syncwise.data.tokenized import prepare

    with tempfile.TemporaryDirectory(prefix="tokbench-") as tmp:
        tmp = Path(tmp)
        docs = stdlib_documents(int(args.mb * 1e6))
        source = tmp / "corpus.parquet"
        write_parquet(docs, source)
        train_tokenizer(docs[: max(1, len(docs) // 20)], args.vocab, tmp / "tokenizer.json")
        text_bytes = sum(len(d.encode()) for d in docs)
        del docs
        runs = []
        for n in args.workers:
            # each run in a fresh process, so its peak RSS is its own (not this one's, which built the corpus)
            code = ("import json, resource, sys, time, os\n"
                    "import pyarrow.parquet, tokenizers\n"
                    "from syncwise.data.tokenized import prepare, load_tokenizer\n"
                    "load_tokenizer(sys.argv[2])\n"
                    "def hwm():  # VmHWM: this process's own peak (ru_maxrss carries the parent's across fork+exec)\n"
                    "    line = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
                    "    return int(line.split()[1]) * 1024\n"
                    "rss0 = hwm()\n"
                    "cpu0, t0 = time.process_time(), time.perf_counter()\n"
                    "out = prepare(sys.argv[1], sys.argv[2], 0.05, cache_dir=sys.argv[3], workers=int(sys.argv[4]))\n"
                    "t, cpu = time.perf_counter() - t0, time.process_time() - cpu0\n"
                    "kids = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
                    "print(json.dumps({'out': str(out), 'seconds': t, 'cpu': cpu, 'kids': kids.ru_utime + kids.ru_stime,"
                    " 'rss0': rss0, 'rss_peak': hwm()}))\n")
            proc = subprocess.run([sys.executable, "-c", code, str(source), str(tmp / "tokenizer.json"),
                                   str(tmp / f"cache-{n}"), str(n)], capture_output=True, text=True, check=True)
            m = json.loads(proc.stdout.strip().splitlines()[-1])
            out, seconds = Path(m["out"]), m["seconds"]
            meta = json.loads((out / "meta.json").read_text())
            shard_bytes = sum(p.stat().st_size for p in out.glob("*.bin"))
            runs.append({"workers": n, "documents": meta["documents"], "tokens": meta["tokens"],
                         "seconds": round(seconds, 3), "tokens_per_s": round(meta["tokens"] / seconds),
                         "cpu_seconds_main": round(m["cpu"], 3), "cpu_seconds_workers": round(m["kids"], 3),
                         "load_average_1min": round(os.getloadavg()[0], 2), "shard_mb": round(shard_bytes / 1e6, 1),
                         "main_rss_growth_mb": round((m["rss_peak"] - m["rss0"]) / 1e6, 1)})
            print(f"{n} worker(s): {meta['tokens']:,} tokens in {seconds:.2f} s = {meta['tokens'] / seconds:,.0f} "
                  f"tokens/s (CPU: main {m['cpu']:.2f} s, workers {m['kids']:.2f} s; load {os.getloadavg()[0]:.1f}; "
                  f"main RSS +{runs[-1]['main_rss_growth_mb']} MB for {runs[-1]['shard_mb']} MB of shards)", flush=True)
        base = runs[0]["tokens_per_s"]
        for r in runs:
            r["speedup"] = round(r["tokens_per_s"] / base, 2)
        shards = [(tmp / f"cache-{n}" / "tokenized").iterdir().__next__() for n in args.workers]
        same = len({(s / "train.bin").read_bytes() for s in shards}) == 1
        stamp = (shards[0] / "train.bin").stat().st_mtime_ns
        start = time.perf_counter()
        prepare(str(source), str(tmp / "tokenizer.json"), 0.05, cache_dir=tmp / f"cache-{args.workers[0]}",
                workers=args.workers[0])
        reuse = time.perf_counter() - start
        untouched = (shards[0] / "train.bin").stat().st_mtime_ns == stamp
        print(f"second run on the same cache: {reuse * 1e3:.1f} ms (shards untouched: {untouched}); shards identical "
              f"across worker counts: {same}")
        result = {
            "benchmark": "tokenize_throughput", "command": "python3 " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "corpus": {"source": "Python stdlib .py files as parquet rows (row groups of 128)",
                       "text_bytes": text_bytes, "parquet_bytes": source.stat().st_size,
                       "documents": runs[0]["documents"]},
            "tokenizer": {"kind": "byte-level BPE trained on 5 % of the documents", "vocab_size": args.vocab},
            "machine": {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                        "platform": platform.platform()},
            "runs": runs, "shards_identical_across_worker_counts": same,
            "reuse": {"seconds": round(reuse, 4), "shards_untouched": untouched},
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
