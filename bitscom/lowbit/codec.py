"""How one stage of a low-bit collective puts a shard into a byte row and back (:class:`Codec`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import kernels
from .format import FULL_PRECISION

__all__ = ["Codec"]


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one stage of a collective puts a shard of ``m`` float32 values into a byte row and back:
    the low-bit payload then the bfloat16 scales, or raw float32 for ``bits=32`` (the layout,
    and ``simulate=True``, which sends the dequantized values as float32: ``docs/format.md``).
    Rows are views into one uint8 send/receive buffer, so each stage is a single collective.

    Example::

        c = Codec(4, 128)
        row = torch.empty(c.row_bytes(256), dtype=torch.uint8)
        c.encode(x, row, seed=0, offset=0); c.decode(row, 256, out)
    """

    bits: int
    block_size: int = 128
    stochastic: bool = False
    simulate: bool = False

    @property
    def raw(self) -> bool:
        """Rows hold float32 (full precision or simulated quantization)."""
        return self.bits == FULL_PRECISION or self.simulate

    def row_bytes(self, m: int) -> int:
        if self.raw:
            return 4 * m
        return kernels.wire_bytes(m, self.bits, self.block_size)

    def _split(self, rows: torch.Tensor, m: int):
        pb = kernels.payload_bytes(m, self.bits, self.block_size)
        return rows[..., :pb], rows[..., pb:].view(torch.bfloat16)

    def encode(self, x: torch.Tensor, row: torch.Tensor, seed: int, offset: int = 0) -> None:
        """Write the contiguous float32 ``x`` into the uint8 ``row`` (``row_bytes(x.numel())``)."""
        if self.bits == FULL_PRECISION:
            row.view(torch.float32).copy_(x)
            return
        if self.simulate:
            payload, scales = kernels.quantize_pack(x, self.bits, self.block_size, stochastic=self.stochastic,
                                                    seed=seed, index_offset=offset)
            kernels.unpack_dequantize(payload, scales, x.numel(), self.bits, self.block_size,
                                      out=row.view(torch.float32))
            return
        payload, scales = self._split(row, x.numel())
        kernels.quantize_pack(x, self.bits, self.block_size, stochastic=self.stochastic,
                              seed=seed, index_offset=offset, payload=payload, scales=scales)

    def fused_feedback(self, x: torch.Tensor) -> bool:
        """Whether :meth:`encode_feedback` can run for ``x``; else the caller takes the separate steps."""
        from ..kernels import cpu_native
        return (not self.raw and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
                and kernels.implementation(x.device) == "native" and cpu_native.has_quantize_ef())

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor, row: torch.Tensor, seed: int,
                        offset: int = 0) -> None:
        """Residual error feedback and :meth:`encode` in one native pass: ``v = residual + x`` is
        encoded into ``row`` and ``residual`` becomes ``v - decode(row)``, NaN/Inf zeroed; the bits
        of the five separate steps (tested), each of which would pass over the whole bucket."""
        from ..kernels import cpu_native
        payload, scales = self._split(row, x.numel())
        cpu_native.quantize_ef(x, residual, self.bits, self.block_size, self.stochastic, seed, offset,
                               payload, scales)

    def decode(self, row: torch.Tensor, m: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``m`` float32 values of one row (into ``out`` when given); returns them."""
        if self.raw:
            vals = row.view(torch.float32)
            return vals.clone() if out is None else out.copy_(vals)
        payload, scales = self._split(row, m)
        return kernels.unpack_dequantize(payload, scales, m, self.bits, self.block_size, out=out)

    def decode_prefix(self, row: torch.Tensor, m: int, out: torch.Tensor) -> torch.Tensor:
        """The first ``out.numel()`` (<= ``m``) values of a row of ``m`` (e.g. the last shard without
        its padding) into ``out``: the bits of ``decode(row, m)[:k]``."""
        k = out.numel()
        if self.raw:
            return out.copy_(row.view(torch.float32)[:k])
        payload, scales = self._split(row, m)
        return kernels.unpack_dequantize(payload, scales, k, self.bits, self.block_size, out=out)

    def decode_sum(self, rows: torch.Tensor, m: int, out: torch.Tensor) -> torch.Tensor:
        """``out = row_0 + row_1 + ...`` decoded, summed left to right (same bits everywhere)."""
        if self.raw:
            vals = rows.view(torch.float32)
            out.copy_(vals[0])
            for j in range(1, vals.shape[0]):
                out.add_(vals[j])
            return out
        payloads, scales = self._split(rows, m)
        return kernels.unpack_dequantize_accumulate(payloads, scales, m, self.bits, self.block_size, out=out)
    def decode_sum_encode(self, rows: torch.Tensor, m: int, alpha: float, out: "Codec",
                          row: torch.Tensor, seed: int, offset: int) -> None:
        """The reduce step of the two-stage all-reduce: decode and sum ``rows``, scale by ``alpha``, encode into ``row``
        with codec ``out``; one fused kernel pass when both are low-bit (the bytes of the separate steps, tested)."""
        if self.raw or out.raw or self.block_size != out.block_size:
            acc = torch.empty(m, dtype=torch.float32, device=rows.device)
            self.decode_sum(rows, m, acc)
            if alpha != 1.0:
                acc.mul_(alpha)
            out.encode(acc, row, seed, offset)
            return
        payloads, scales = self._split(rows, m)
        payload, out_scales = out._split(row, m)
        kernels.dequantize_sum_requantize(payloads, scales, m, self.bits, self.block_size, out_bits=out.bits,
                                          alpha=alpha, stochastic=out.stochastic, seed=seed,
                                          index_offset=offset, payload=payload, out_scales=out_scales)
