"""Horovod-style codecs (``compress(t) -> (t, ctx)`` / ``decompress(t, ctx)``) as one-round bitscom compressors:
compress, divide by N, all-reduce (sum), decompress; the wire must be floating point (docs/horovod.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch

from .base import Compressor

__all__ = ["HorovodAdapter", "HorovodCodec", "is_codec"]


def is_codec(obj: Any) -> bool:
    """True for a Horovod-style codec (class or instance) that is not a bitscom compressor."""
    if isinstance(obj, Compressor) or (isinstance(obj, type) and issubclass(obj, Compressor)):
        return False
    return (callable(getattr(obj, "compress", None))
            and callable(getattr(obj, "decompress", None)))


def _codec_name(codec: Any) -> str:
    cls = codec if isinstance(codec, type) else type(codec)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class HorovodAdapter(Compressor):
    """A Horovod-style codec as a one-round bitscom compressor (what ``get(codec)`` returns)."""

    codec: Any
    name = "horovod_codec"

    def __post_init__(self):
        if not is_codec(self.codec):
            raise TypeError(f"HorovodAdapter needs a class or object with compress(tensor) -> "
                            f"(tensor, ctx) and decompress(tensor, ctx); got {self.codec!r}")

    def reduce(self, flat, layout, state, comm):
        wire, ctx = self.codec.compress(flat)
        if not isinstance(wire, torch.Tensor) or not (wire.is_floating_point() or wire.is_complex()):
            got = wire.dtype if isinstance(wire, torch.Tensor) else type(wire).__name__
            raise TypeError(f"{_codec_name(self.codec)}.compress returned {got}; bitscom sums the "
                            "compressed tensors of the ranks, which needs a floating-point tensor")
        wire = wire.contiguous().div_(comm.size)
        yield comm.all_reduce(wire)
        out = self.codec.decompress(wire, ctx)
        if not isinstance(out, torch.Tensor) or out.numel() != flat.numel():
            raise ValueError(f"{_codec_name(self.codec)}.decompress must return a tensor of "
                             f"{flat.numel()} elements, got {getattr(out, 'shape', out)!r}")
        if out is not flat:
            flat.copy_(out.reshape(flat.shape))

    def fingerprint(self) -> str:
        return f"HorovodAdapter({_codec_name(self.codec)})"     # not repr(): it holds an address


class HorovodCodec:
    """Base class of a Horovod-style codec, published as ``bitscom.compression.Compressor``. Example::

        class HalfCodec(bitscom.compression.Compressor):
            @staticmethod
            def compress(tensor):
                return tensor.to(torch.float16), tensor.dtype
            @staticmethod
            def decompress(tensor, ctx):
                return tensor.to(ctx)
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return ``(wire_tensor, ctx)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor rebuilt from the reduced ``wire_tensor`` and this rank's ``ctx``."""
        raise NotImplementedError


def __getattr__(name: str) -> Any:
    if name == "HorovodCompressor":     # the codec base class's deprecated first name
        import warnings
        warnings.warn("bitscom.compressors.hvd_adapter.HorovodCompressor moved: use "
                      "bitscom.compression.Compressor (bitscom.horovod.codec.HorovodCodec)",
                      DeprecationWarning, stacklevel=2)
        return HorovodCodec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
