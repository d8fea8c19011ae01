"""The low-bit wire format: blockwise quantization, bit packing, stochastic rounding.

The specification (codes, bit order, bfloat16 scales rounded up, NaN blocks, the counter-hash
rounding, wire cost) is ``docs/format.md``; rows of the collectives are
:class:`~bitscom.lowbit.codec.Codec`, their seeds :mod:`bitscom.lowbit.seeds`.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..kernels import format as fmt
from ..kernels import torch_ref
from ..kernels.format import SUPPORTED_BITS, HADAMARD_BLOCK, wire_bytes, bits_per_element
from ..validate import instance, number
from .hadamard import check_float_tensor, hadamard as _hadamard

__all__ = ["SUPPORTED_BITS", "FULL_PRECISION", "HADAMARD_BLOCK", "Quantized", "quantize", "dequantize",
           "quantize_tensor", "dequantize_tensor", "pack", "unpack", "pack_signs", "unpack_signs",
           "wire_bytes", "bits_per_element"]

#: A width of 32 means "send raw float32" (allowed for every stage of the collectives).
FULL_PRECISION = 32


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized tensor: the wire bytes (uint8 ``payload``, bfloat16 ``scales``; ``nbytes`` =
    :func:`wire_bytes`) plus the metadata to rebuild it."""
    payload: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int
    shape: torch.Size
    dtype: torch.dtype
    hadamard: bool = False

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes + self.scales.nbytes

    @property
    def nblocks(self) -> int:
        return self.scales.numel()

    def dequantize(self, out=None) -> torch.Tensor:
        return dequantize(self, out=out)


def quantize(tensor, bits, block_size=128, stochastic_rounding=False, seed=0, hadamard=False) -> Quantized:
    """Quantize a floating tensor of any shape to ``bits`` per element with one scale per block.

    ``bits``, ``block_size`` (a power of two, 32..65536), ``stochastic_rounding`` and ``hadamard`` (32-element runs)
    trade as :class:`LowBitConfig`'s; the same ``seed`` gives the same bytes (vary it per step and bucket).

    Example::

        quantize(torch.randn(3, 100), 4).nbytes   # 198: 3 blocks of 64 bytes + 3 bf16 scales
    """
    check_float_tensor(tensor, "tensor")
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    fmt.check_seed(seed)
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
    n = flat.numel()
    if hadamard:
        padded = fmt.num_blocks(n, block_size) * block_size
        flat = _hadamard(torch.nn.functional.pad(flat, (0, padded - n)), HADAMARD_BLOCK)
    payload, scales = kernels.quantize_pack(flat, bits, block_size, stochastic=bool(stochastic_rounding),
                                            seed=seed, index_offset=0)
    return Quantized(payload, scales, n, bits, block_size, tensor.shape, tensor.dtype, bool(hadamard))


def quantize_tensor(tensor, bitwidth, *, block_size=128, stochastic_rounding=False, seed=0,
                    hadamard=False) -> Quantized:
    """The seed's name for :func:`quantize` (``bitwidth`` = ``bits``): the same bytes.

    Example::

        dequantize_tensor(quantize_tensor(torch.randn(1000), 4, stochastic_rounding=True))
    """
    return quantize(tensor, bitwidth, block_size, stochastic_rounding=stochastic_rounding, seed=seed,
                    hadamard=hadamard)


def dequantize_tensor(q: Quantized, out=None) -> torch.Tensor:
    """The seed's name for :func:`dequantize`."""
    return dequantize(q, out=out)


def dequantize(q: Quantized, out=None) -> torch.Tensor:
    """Rebuild the tensor (original shape and dtype, on the payload's device); fills ``out`` if given.

    Example::

        dequantize(quantize(torch.randn(10, dtype=torch.bfloat16), 16)).dtype   # torch.bfloat16
    """
    instance("q", q, Quantized, "a Quantized")
    n = q.numel
    padded = fmt.num_blocks(n, q.block_size) * q.block_size if q.hadamard else n
    v = kernels.unpack_dequantize(q.payload, q.scales, padded, q.bits, q.block_size)
    if q.hadamard:
        v = _hadamard(v, HADAMARD_BLOCK)[:n]   # its own inverse
    if out is None:
        return v.view(q.shape).to(q.dtype)
    if not isinstance(out, torch.Tensor) or out.numel() != n:
        raise ValueError(f"out must be a tensor with {n} elements (shape {tuple(q.shape)})")
    out.copy_(v.view(out.shape))
    return out


def pack(codes, bits) -> torch.Tensor:
    """Pack unsigned codes in ``[0, 2**bits)`` into ``ceil(n * bits / 8)`` bytes (bit order above).

    Example::

        pack(torch.tensor([1, 2, 3]), 4)   # tensor([33, 3], dtype=torch.uint8): 0x21, 0x03
    """
    fmt.check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point or codes.dtype.is_complex \
            or codes.dtype == torch.bool:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"codes must be an integer tensor, got {got}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for bits={bits}, got range "
                         f"[{int(codes.min())}, {int(codes.max())}]")
    return torch_ref.pack_codes(codes, bits)


def unpack(payload, bits, count) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``count`` codes as int32."""
    fmt.check_bits(bits)
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        got = payload.dtype if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise TypeError(f"payload must be a uint8 tensor, got {got}")
    number("count", count, minimum=0, integer=True)
    need = (count * bits + 7) // 8
    if payload.numel() < need:
        raise ValueError(f"payload has {payload.numel()} bytes; {count} codes of {bits} bits need {need}")
    return torch_ref.unpack_codes(payload, bits, count)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The 1-bit codes of the format for ``x``'s signs (code 1 = negative, ``x < 0``), packed:
    ``ceil(n / 8)`` bytes, element ``i`` in bit ``i % 8`` of byte ``i // 8``. NaN reads as +.

    Example::

        pack_signs(torch.tensor([-1., 2., 3., 4., 5., 6., 7., -8.]))   # tensor([129], dtype=torch.uint8)
    """
    return torch_ref.pack_codes(x.reshape(-1).lt(0), 1)


def unpack_signs(packed: torch.Tensor, numel: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``numel`` values of ±1 in ``dtype``."""
    codes = torch_ref.unpack_codes(packed, 1, numel)
    return 1 - 2 * codes.to(dtype)
