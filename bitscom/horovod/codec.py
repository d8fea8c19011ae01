"""The base class of a Horovod-style codec, ``hvd.compression.Compressor``, as the Horovod face
publishes it (defined in :mod:`bitscom.compressors.hvd_adapter`, beside its adapter).

Horovod scripts subclass ``hvd.compression.Compressor`` (static ``compress`` / ``decompress``)
and pass the class as ``compression=``. That class is :class:`HorovodCodec`, published as
``bitscom.compression.Compressor``. It is a different thing from bitscom's own compressor
protocol (:class:`bitscom.compressors.base.Compressor`, round generators over a ``Comm``):
:class:`bitscom.compressors.hvd_adapter.HorovodAdapter` turns any codec — a subclass of this
class or any duck-typed object with ``compress``/``decompress`` — into one of those. The
adapter lives in ``compressors`` (the registry, the DDP hook and the optimizer use it) and
needs only the duck type, so nothing below this face imports this module.

Example::

    from bitscom.horovod.codec import HorovodCodec    # = bitscom.compression.Compressor
"""

from __future__ import annotations

from typing import Any

from ..compressors.casting import BF16Compressor, FP16Compressor, NoneCompressor
from ..compressors.hvd_adapter import HorovodCodec, is_codec

__all__ = ["HorovodCodec", "HorovodCompressor", "check_compression"]


HorovodCompressor = HorovodCodec
"""The codec base class under its earlier bitscom name."""


def check_compression(compression: Any) -> None:
    """``bitscom.allreduce(compression=...)`` takes casting compressors and codecs only.

    Example::

        check_compression(bitscom.Compression.fp16)     # fine
    """
    if not (is_codec(compression)
            or isinstance(compression, (NoneCompressor, FP16Compressor, BF16Compressor))):
        raise TypeError("compression must be bitscom.Compression.none/fp16/bf16 or a Horovod-style "
                        f"codec with compress/decompress; got {compression!r} (for low-bit "
                        "collectives use bitscom.LowBitGroup)")
