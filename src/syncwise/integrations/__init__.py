"""syncwise where users already train: its gradient compressors as drop-in DDP communication.

Each integration is a few lines around the same two pieces, :class:`syncwise.compress.GradientCompressor`
(the compressor plus its checkpointable state, keyed by parameter name) and its DDP comm hook:

- plain torchrun + DDP: :func:`syncwise.integrations.ddp.register`
- PyTorch Lightning: :class:`syncwise.integrations.lightning.SyncwiseCallback`
- Hugging Face Accelerate: :func:`syncwise.integrations.accelerate.register`
- ``transformers.Trainer``: :class:`syncwise.integrations.transformers.SyncwiseTrainerCallback`

The framework modules import their framework lazily; ``import syncwise.integrations`` needs only torch.
"""
from ._common import bytes_on_wire, compressor_from, require

__all__ = ["compressor_from", "bytes_on_wire", "require"]
