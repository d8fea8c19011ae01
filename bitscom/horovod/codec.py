"""The base class of a Horovod-style codec: ``hvd.compression.Compressor``.

Horovod scripts subclass ``hvd.compression.Compressor`` (static ``compress`` / ``decompress``)
and pass the class as ``compression=``. That class is :class:`HorovodCodec`, published as
``bitscom.compression.Compressor``. It is a different thing from bitscom's own compressor
protocol (:class:`bitscom.compressors.base.Compressor`, round generators over a ``Comm``):
:class:`bitscom.compressors.hvd_adapter.HorovodAdapter` turns any codec — a subclass of this
class or any duck-typed object with ``compress``/``decompress`` — into one of those. The
adapter lives in ``compressors`` (the registry, the DDP hook and the optimizer use it) and
needs only the duck type, so nothing below this face imports this module.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from ..compressors.casting import BF16Compressor, FP16Compressor, NoneCompressor
from ..compressors.hvd_adapter import is_codec

__all__ = ["HorovodCodec", "HorovodCompressor", "check_compression"]


class HorovodCodec:
    """Base class for a Horovod-style codec (``horovod.torch.compression.Compressor``).

    Subclass it (or write any class with static ``compress``/``decompress``) and pass the
    class itself as ``compression=``; bitscom wraps it in
    :class:`~bitscom.compressors.hvd_adapter.HorovodAdapter`.

    Example::

        class HalfCodec(bitscom.compression.Compressor):
            @staticmethod
            def compress(tensor):
                return tensor.to(torch.float16), tensor.dtype
            @staticmethod
            def decompress(tensor, ctx):
                return tensor.to(ctx)

        avg = bitscom.allreduce(t, compression=HalfCodec)
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return ``(wire_tensor, ctx)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor rebuilt from the reduced ``wire_tensor`` and this rank's ``ctx``."""
        raise NotImplementedError


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
