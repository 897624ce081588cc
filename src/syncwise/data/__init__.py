"""Data: corpora (stdlib sources, text, nanoGPT .bin), byte tokenizer, sharded resumable sampler, prefetcher."""
from .corpus import DEFAULT_MAX_BYTES, TEXT_EXTENSIONS, Corpus, default_cache_dir, load_corpus, stdlib_files
from .loader import TokenBatchLoader, evaluation_batches
from .prefetch import SmartPrefetcher
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "load_corpus", "stdlib_files", "default_cache_dir", "DEFAULT_MAX_BYTES",
           "TEXT_EXTENSIONS", "TokenBatchLoader", "evaluation_batches", "SmartPrefetcher"]
