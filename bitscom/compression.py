"""Horovod's ``horovod.torch.compression`` names, for ``from bitscom.compression import ...``.

``Compressor`` is the base class of a user's own Horovod-style codec (static ``compress`` /
``decompress``): :class:`bitscom.horovod.codec.HorovodCodec`, under Horovod's spelling. Pass
the class as ``compression=`` and bitscom wraps it in
:class:`~bitscom.compressors.hvd_adapter.HorovodAdapter`. It is not bitscom's compressor
protocol (:class:`bitscom.compressors.base.Compressor`). ``Compression.none/fp16/bf16`` are
bitscom's casting compressors, which also speak the codec interface.

Example::

    from bitscom.compression import Compression, Compressor
    wire, ctx = Compression.fp16.compress(grad)
"""

from .compressors.casting import Compression
from .compressors.hvd_adapter import HorovodAdapter
from .horovod.codec import HorovodCodec as Compressor

__all__ = ["Compression", "Compressor", "HorovodAdapter"]
