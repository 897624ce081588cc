"""syncwise.compress: gradient compressors (pure tensor code + explicit state) and their DDP hook.

``parse_compress_spec("powersgd:rank=4")`` builds a compressor; ``CompressionHookState`` +
``compression_hook`` attach it to DDP; ``GradientCompressor`` is the seed API around both.
"""
from .api import GradientCompressor
from .base import Compressor, CompressorConfig, GatherCompressor
from .cast import BF16Compressor, FP8Compressor, FP16Compressor, NoneCompressor
from .demo import DeMoCompressor
from .hook import CompressionHookState, CompressionPolicy, compression_hook, torch_reference_hook
from .powersgd import PowerSGDCompressor
from .profile import model_gradients, profile_compressor
from .quant import Int8Compressor, SignCompressor
from .registry import COMPRESSORS, CompressorInfo, describe_compressors, parse_compress_spec
from .sparse import RandomKCompressor, TopKCompressor

__all__ = [
    "Compressor", "CompressorConfig", "GatherCompressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
    "FP8Compressor", "Int8Compressor", "SignCompressor", "TopKCompressor", "RandomKCompressor",
    "PowerSGDCompressor", "DeMoCompressor", "COMPRESSORS", "CompressorInfo", "describe_compressors", "parse_compress_spec",
    "CompressionHookState", "CompressionPolicy", "compression_hook", "torch_reference_hook", "GradientCompressor",
    "profile_compressor", "model_gradients",
]
