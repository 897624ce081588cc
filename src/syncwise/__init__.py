"""syncwise: communication-efficient distributed training of language models on PyTorch."""
__version__ = "0.1.0"
