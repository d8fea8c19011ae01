"""``hvd.compression.Compressor``, a Horovod-style codec's base class, as this face publishes it
(it lives beside its adapter in :mod:`bitscom.compressors.hvd_adapter`)."""

from __future__ import annotations

from typing import Any

from ..compressors.casting import BF16Compressor, FP16Compressor, NoneCompressor
from ..compressors.hvd_adapter import HorovodCodec, is_codec

__all__ = ["HorovodCodec", "HorovodCompressor", "check_compression"]


HorovodCompressor = HorovodCodec
"""The codec base class under its earlier bitscom name."""


def check_compression(compression: Any) -> None:
    """``bitscom.allreduce(compression=...)`` takes casting compressors and codecs only."""
    if not (is_codec(compression)
            or isinstance(compression, (NoneCompressor, FP16Compressor, BF16Compressor))):
        raise TypeError("compression must be bitscom.Compression.none/fp16/bf16 or a Horovod-style "
                        f"codec with compress/decompress; got {compression!r} (for low-bit "
                        "collectives use bitscom.LowBitGroup)")
