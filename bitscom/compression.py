"""Horovod's ``horovod.torch.compression`` names; ``Compressor`` is the base of a user's own
Horovod-style codec, not bitscom's compressor protocol. Example::

    from bitscom.compression import Compression, Compressor
    wire, ctx = Compression.fp16.compress(grad)
"""

from .compressors.casting import Compression
from .compressors.hvd_adapter import HorovodAdapter
from .horovod.codec import HorovodCodec as Compressor

__all__ = ["Compression", "Compressor", "HorovodAdapter"]
