"""One byte row per peer: how a float32 slice is put on the wire and read back.

A row is the packed low-bit payload followed by its bfloat16 scales (``kernels.wire_bytes``
bytes), or raw float32 when ``bits == 32``. Rows of all peers sit in one uint8 buffer, so one
collective moves them all. Decoding and summing goes left to right in peer order, so every rank
and device gets the same bits. Callers seed stochastic rounding with
:func:`bitscom.quantization.mix_seed` (base, step, rank, bucket, chunk, stage), so it differs
per rank and step and replays from a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .config import FULL_PRECISION

__all__ = ["RowCodec"]

@dataclass(frozen=True)
class RowCodec:
    """``bits`` per element (32 = raw float32) with one scale per ``group_size`` elements.

    Example::

        codec = RowCodec(4, 128)
        row = torch.empty(codec.row_bytes(x.numel()), dtype=torch.uint8)
        codec.encode(x, row, seed=1)
        y = codec.decode(row, x.numel())
    """

    bits: int
    group_size: int
    stochastic: bool = True

    def row_bytes(self, numel: int) -> int:
        if self.bits == FULL_PRECISION:
            return 4 * numel
        return kernels.wire_bytes(numel, self.bits, self.group_size)

    def _split(self, rows: torch.Tensor, numel: int):
        cut = kernels.payload_bytes(numel, self.bits, self.group_size)
        return rows[..., :cut], rows[..., cut:].view(torch.bfloat16)

    def encode(self, x: torch.Tensor, row: torch.Tensor, seed: int) -> None:
        """Write the contiguous float32 ``x`` into the uint8 ``row``."""
        if self.bits == FULL_PRECISION:
            row.view(torch.float32).copy_(x)
            return
        payload, scales = self._split(row, x.numel())
        kernels.quantize_pack(x, self.bits, self.group_size, stochastic=self.stochastic, seed=seed,
                              payload=payload, scales=scales)

    def decode(self, row: torch.Tensor, numel: int, out=None) -> torch.Tensor:
        """The float32 values of one row."""
        if self.bits == FULL_PRECISION:
            vals = row.view(torch.float32)
            return vals.clone() if out is None else out.copy_(vals)
        payload, scales = self._split(row, numel)
        return kernels.unpack_dequantize(payload, scales, numel, self.bits, self.group_size, out=out)

    def decode_sum(self, rows: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
        """``out = row_0 + row_1 + ...`` decoded, summed left to right."""
        if self.bits == FULL_PRECISION:
            vals = rows.view(torch.float32)
            out.copy_(vals[0])
            for j in range(1, vals.shape[0]):
                out.add_(vals[j])
            return out
        payloads, scales = self._split(rows, numel)
        return kernels.unpack_dequantize_accumulate(payloads, scales, numel, self.bits, self.group_size,
                                                    out=out)
