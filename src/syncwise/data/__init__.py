"""Data: corpora (stdlib sources, text, nanoGPT .bin), byte tokenizer, sharded resumable sampler, prefetcher."""
from .corpus import (DEFAULT_MAX_BYTES, TEXT_EXTENSIONS, Corpus, corpus_sizes, default_cache_dir, load_corpus,
                     stdlib_files)
from .loader import TokenBatchLoader, check_fits, evaluation_batches
from .prefetch import SmartPrefetcher
from .sharding import ShardedLoader, position_is_global, shard_loader
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "load_corpus", "corpus_sizes", "stdlib_files", "default_cache_dir",
           "DEFAULT_MAX_BYTES", "TEXT_EXTENSIONS", "TokenBatchLoader", "check_fits", "evaluation_batches",
           "SmartPrefetcher", "ShardedLoader", "shard_loader", "position_is_global"]
