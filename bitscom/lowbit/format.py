"""The low-bit wire format: blockwise quantization, bit packing, stochastic rounding.

The row layout the collectives send is :class:`~bitscom.lowbit.codec.Codec`, their
stochastic-rounding seeds :mod:`bitscom.lowbit.seeds`, the Hadamard transform
:mod:`bitscom.lowbit.hadamard`. The specification is ``docs/format.md``; this docstring
summarizes it.

Format
------
A tensor is flattened (row-major) and cut into blocks of ``block_size`` elements (a power of two,
32..65536, default 128); the last block is zero-padded. Each block stores one scale ``s`` and
``block_size`` codes of ``bits`` bits.

Codes, for ``b`` in ``SUPPORTED_BITS = (1, 2, 4, 8, 12, 16)``:

* ``b >= 2``: symmetric signed levels ``q`` in ``[-qmax, qmax]``, ``qmax = 2**(b-1) - 1``, stored as
  the unsigned code ``u = q + qmax`` in ``[0, 2**b - 2]`` (code ``2**b - 1`` is never written);
  value = ``q * s``, ``s = max|x| / qmax`` of the block. 2 bits is ternary {-s, 0, s}; 16 bits
  has 65535 levels.
* ``b == 1``: scaled sign, code 1 = negative: value = ``(1 - 2u) * s`` with ``s`` = mean ``|x|``
  of the block (the L2-optimal scale for signs), so the sign always survives (0 maps to +s).
  With stochastic rounding, 1 bit uses ``s = max|x|`` and P(negative) = ``(1 - x/s) / 2``, which
  is unbiased.

Bit order: codes form a little-endian bit stream; code ``i`` occupies stream bits
``[i*b, (i+1)*b)`` and stream bit ``k`` is bit ``k % 8`` (LSB = 0) of byte ``k // 8``. So at
4 bits element 0 is the low nibble of byte 0; at 12 bits elements 0, 1 fill bytes 0..2 as
``b0 = u0 & 0xff, b1 = (u0 >> 8) | (u1 & 0xf) << 4, b2 = u1 >> 4``; at 16 bits each code is a
little-endian uint16.

Scales are bfloat16, rounded *up* from the float32 ``max|x|/qmax``: bfloat16 has float32's
exponent range, so block magnitudes from 1e-38 to 3e38 neither underflow nor overflow (fp16
underflows below 6e-8 — a 1e-12 gradient at 4 bits needs a scale of 1.4e-13 — and overflows at
65504), in 2 bytes instead of fp32's 4. Codes are computed against the stored scale, and rounding
up guarantees ``|x| / s <= qmax``, so nothing clips. A block of zeros gets ``s = 0`` and decodes to
zeros; a block containing NaN or ±Inf gets ``s = NaN`` and decodes to NaN everywhere, so AMP's
GradScaler sees the overflow instead of finite garbage.

Rounding: round-to-nearest-even (error <= s/2) or stochastic rounding, ``q = floor(y) + [r < frac(y)]``
with ``y = x / s`` and ``r`` 24 uniform bits from a counter hash of (seed, element index)
(MurmurHash3 finalizer, see ``kernels.format.seed_keys``): unbiased to 2**-24 of a step, the same
bytes for the same seed on every run and device, and the global RNG is never touched.

Wire cost: ``wire_bytes(numel, bits, block_size) = nblocks * (block_size * bits / 8 + 2)``, i.e.
``bits + 16 / block_size`` bits per element (4-bit, 128-blocks: 4.125).

Optional Hadamard smoothing (SDP4Bit): an orthonormal Walsh–Hadamard transform over each run of
32 elements before quantization spreads outliers across the block; ``dequantize`` inverts it.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..kernels import format as fmt
from ..kernels import torch_ref
from ..kernels.format import SUPPORTED_BITS, HADAMARD_BLOCK, wire_bytes, bits_per_element
from .hadamard import hadamard as _hadamard

__all__ = ["SUPPORTED_BITS", "FULL_PRECISION", "HADAMARD_BLOCK", "Quantized", "quantize", "dequantize",
           "quantize_tensor", "dequantize_tensor", "pack", "unpack", "pack_signs", "unpack_signs",
           "wire_bytes", "bits_per_element"]

FULL_PRECISION = 32
"""A width of 32 means "send raw float32" (allowed for every stage of the collectives)."""


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized tensor: what goes on the wire plus the metadata to rebuild it.

    ``payload``: uint8 [nblocks * block_size * bits / 8]; ``scales``: bfloat16 [nblocks];
    ``nbytes``: the exact wire bytes (payload + scales), equal to ``wire_bytes(numel, bits, block_size)``.
    """
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
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def nblocks(self) -> int:
        return self.scales.numel()

    def dequantize(self, out=None) -> torch.Tensor:
        return dequantize(self, out=out)


def _check_float_tensor(tensor, name="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be dense (strided), got layout {tensor.layout}")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {tensor.dtype}; allowed: floating dtypes (float32, float16, "
                        f"bfloat16, float64)")


def quantize(tensor, bits, block_size=128, stochastic_rounding=False, seed=0, hadamard=False) -> Quantized:
    """Quantize a floating tensor of any shape to ``bits`` per element with one scale per block.

    Args:
        bits: code width, one of ``SUPPORTED_BITS``; fewer bits = fewer bytes, more error.
        block_size: elements per scale (power of two, 32..65536); smaller blocks track local
            magnitude better but pay 16 bits per block.
        stochastic_rounding: unbiased rounding (what error-free averaging over ranks needs)
            at about twice the RTN variance.
        seed: keys the counter hash; same seed -> same bytes. Vary it per step and bucket.
        hadamard: rotate each 32-element run first (smooths outliers; SDP4Bit).

    Example::

        >>> q = quantize(torch.randn(3, 100), 4)
        >>> q.nbytes, dequantize(q).shape
        (198, torch.Size([3, 100]))
    """
    _check_float_tensor(tensor)
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

    Unlike the seed's per-tensor ``(codes, scale)`` pair it returns a :class:`Quantized`
    (blockwise scales, packed payload); :func:`dequantize_tensor` inverts it.

    Example::

        >>> q = quantize_tensor(torch.randn(1000), 4, stochastic_rounding=True)
        >>> dequantize_tensor(q).shape
        torch.Size([1000])
    """
    return quantize(tensor, bitwidth, block_size, stochastic_rounding=stochastic_rounding, seed=seed,
                    hadamard=hadamard)


def dequantize_tensor(q: Quantized, out=None) -> torch.Tensor:
    """The seed's name for :func:`dequantize`.

    Example::

        >>> dequantize_tensor(quantize_tensor(torch.ones(8), 8)).tolist() == [1.0] * 8
        True
    """
    return dequantize(q, out=out)


def dequantize(q: Quantized, out=None) -> torch.Tensor:
    """Rebuild the tensor (original shape and dtype, on the payload's device); fills ``out`` if given.

    Example::

        >>> x = torch.randn(10, dtype=torch.bfloat16)
        >>> dequantize(quantize(x, 16)).dtype
        torch.bfloat16
    """
    if not isinstance(q, Quantized):
        raise TypeError(f"q must be a Quantized, got {type(q).__name__}")
    n = q.numel
    if q.hadamard:
        padded = fmt.num_blocks(n, q.block_size) * q.block_size
        v = kernels.unpack_dequantize(q.payload, q.scales, padded, q.bits, q.block_size)
        v = _hadamard(v, HADAMARD_BLOCK)[:n]   # its own inverse
    else:
        v = kernels.unpack_dequantize(q.payload, q.scales, n, q.bits, q.block_size)
    if out is None:
        return v.view(q.shape).to(q.dtype)
    if not isinstance(out, torch.Tensor) or out.numel() != n:
        raise ValueError(f"out must be a tensor with {n} elements (shape {tuple(q.shape)})")
    out.copy_(v.view(out.shape))
    return out


def pack(codes, bits) -> torch.Tensor:
    """Pack unsigned codes in ``[0, 2**bits)`` into ``ceil(n * bits / 8)`` bytes (bit order above).

    Example::

        >>> pack(torch.tensor([1, 2, 3]), 4)
        tensor([33,  3], dtype=torch.uint8)
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
    """Inverse of :func:`pack`: the first ``count`` codes as int32.

    Example::

        >>> unpack(torch.tensor([33, 3], dtype=torch.uint8), 4, 3)
        tensor([1, 2, 3], dtype=torch.int32)
    """
    fmt.check_bits(bits)
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        got = payload.dtype if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise TypeError(f"payload must be a uint8 tensor, got {got}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be an int >= 0")
    need = (count * bits + 7) // 8
    if payload.numel() < need:
        raise ValueError(f"payload has {payload.numel()} bytes; {count} codes of {bits} bits need {need}")
    return torch_ref.unpack_codes(payload, bits, count)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The 1-bit codes of the format for ``x``'s signs (code 1 = negative, ``x < 0``), packed:
    ``ceil(n / 8)`` bytes, element ``i`` in bit ``i % 8`` of byte ``i // 8``. NaN reads as +.

    Example::

        >>> pack_signs(torch.tensor([-1., 2., 3., 4., 5., 6., 7., -8.]))
        tensor([129], dtype=torch.uint8)
    """
    return torch_ref.pack_codes(x.reshape(-1).lt(0), 1)


def unpack_signs(packed: torch.Tensor, numel: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``numel`` values of ±1 in ``dtype``.

    Example::

        >>> unpack_signs(torch.tensor([129], dtype=torch.uint8), 8).tolist()
        [-1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0]
    """
    codes = torch_ref.unpack_codes(packed, 1, numel)
    return 1 - 2 * codes.to(dtype)
