"""Horovod's ``Compression.none`` / ``.fp16`` and a bf16 variant, with Horovod's codec interface
too. The cast tensor is divided by the world size *before* the all-reduce (as torch's
``fp16_compress_hook``), so the sum on the wire is already the average and cannot overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Compressor, plain_average

__all__ = ["NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


@dataclass(frozen=True)
class NoneCompressor(Compressor):
    """Plain all-reduce in the gradient's own dtype (S-SGD). One round, no state."""

    name = "none"

    def reduce(self, flat, layout, state, comm):
        yield from plain_average(flat, comm)

    def compress(self, tensor: torch.Tensor):
        """Horovod's codec interface: the tensor itself, no context."""
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx):
        """Horovod's codec interface: the tensor itself."""
        return tensor


@dataclass(frozen=True)
class _CastCompressor(Compressor):
    """All-reduce a copy cast to ``wire_dtype``, pre-divided by the world size."""

    wire_dtype = torch.float16      # FP16Compressor's; BF16Compressor sets its own

    def reduce(self, flat, layout, state, comm):
        wire = flat.to(self.wire_dtype).div_(comm.size)     # flat itself when already that dtype
        yield comm.all_reduce(wire)
        if wire is not flat:
            flat.copy_(wire)

    def compress(self, tensor: torch.Tensor):
        """Floating tensors cast to the wire dtype (integers unchanged); the context is the dtype."""
        return (tensor.to(self.wire_dtype) if tensor.is_floating_point() else tensor), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx):
        """Cast back to the dtype ``compress`` saw."""
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


@dataclass(frozen=True)
class FP16Compressor(_CastCompressor):
    """Send gradients as IEEE fp16: 2 bytes per element, ~3 significant digits, range ±65504
    (beyond: Inf, which AMP's GradScaler sees)."""

    name = "fp16"


@dataclass(frozen=True)
class BF16Compressor(_CastCompressor):
    """Send gradients as bfloat16: 2 bytes per element, fp32's range, ~2 significant digits."""

    name = "bf16"
    wire_dtype = torch.bfloat16


class Compression:
    """Horovod-style names for the casting compressors: ``Compression.none/fp16/bf16``.

    Example::

        opt = bitscom.DistributedOptimizer(opt, compression=bitscom.Compression.fp16)
    """

    none = NoneCompressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()
