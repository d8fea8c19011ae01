"""The low-bit wire format: blockwise quantization, bit packing, stochastic rounding, Hadamard,
the row layout the collectives send (:class:`Codec`) and their stochastic-rounding seeds
(:func:`stage_seed`). The specification is ``docs/format.md``; this docstring summarizes it.

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
import math
import zlib
from typing import Optional

import torch

from . import kernels
from .kernels import format as fmt
from .kernels import torch_ref
from .kernels.format import SUPPORTED_BITS, HADAMARD_BLOCK, wire_bytes, bits_per_element

__all__ = ["SUPPORTED_BITS", "FULL_PRECISION", "Quantized", "quantize", "dequantize", "quantize_tensor",
           "mix_seed",
           "dequantize_tensor", "pack", "unpack", "pack_signs", "unpack_signs", "hadamard",
           "inverse_hadamard", "wire_bytes", "bits_per_element", "HADAMARD_BLOCK", "Codec",
           "stage_seed", "key_id"]

FULL_PRECISION = 32
"""A width of 32 means "send raw float32" (allowed for every stage of the collectives)."""
_M64 = (1 << 64) - 1


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
        flat = _fwht(torch.nn.functional.pad(flat, (0, padded - n)), HADAMARD_BLOCK)
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
        v = inverse_hadamard(v, HADAMARD_BLOCK)[:n]
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


def hadamard(x, block=HADAMARD_BLOCK) -> torch.Tensor:
    """Orthonormal fast Walsh–Hadamard transform of each consecutive run of ``block`` elements.

    ``x.numel()`` must be a multiple of ``block`` (a power of two); shape and dtype are kept
    (computed in float32 for 16-bit inputs). The transform is symmetric and its own inverse. It is
    written as butterflies of elementwise adds, so it gives the same bits on CPU and GPU.

    Example::

        >>> x = torch.randn(64)
        >>> torch.allclose(inverse_hadamard(hadamard(x)), x, atol=1e-6)
        True
    """
    _check_float_tensor(x, "x")
    return _fwht(x, block)


def _fwht(x, block):
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block={block!r} must be a power of two (e.g. 32)")
    if x.numel() % block:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block={block}")
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    v = x.reshape(-1, block).to(dt)
    h = 1
    while h < block:
        v = v.view(-1, block // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2)
        h *= 2
    v = v.reshape(x.shape) * (1.0 / math.sqrt(block))
    return v.to(x.dtype)


def inverse_hadamard(x, block=HADAMARD_BLOCK) -> torch.Tensor:
    """Inverse of :func:`hadamard` (the same transform: H is symmetric and orthonormal).

    Example::

        >>> x = torch.randn(32)
        >>> torch.allclose(hadamard(inverse_hadamard(x)), x, atol=1e-6)
        True
    """
    return hadamard(x, block)


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one stage of a collective puts a shard of ``m`` float32 values into a byte row and back.

    ``bits=32`` sends raw float32; otherwise the row is the low-bit payload followed by the
    bfloat16 scales (``wire_bytes(m, bits, block_size)`` bytes). Rows are views into one uint8
    send/receive buffer, so each stage is a single collective. ``index_offset`` (the shard's
    global position) keys stochastic rounding, so the bytes do not depend on the sharding.

    ``simulate=True`` (``simulate_quantization``): the row carries the *dequantized* values as
    float32 (``4 * m`` bytes). Every rank then computes exactly what the low-bit wire would
    have given it, with every setting honoured, while the network carries full precision.

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

    def decode(self, row: torch.Tensor, m: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``m`` float32 values of one row (into ``out`` when given); returns them."""
        if self.raw:
            vals = row.view(torch.float32)
            return vals.clone() if out is None else out.copy_(vals)
        payload, scales = self._split(row, m)
        return kernels.unpack_dequantize(payload, scales, m, self.bits, self.block_size, out=out)

    def decode_sum(self, rows: torch.Tensor, m: int, out: torch.Tensor) -> torch.Tensor:
        """``out = row_0 + row_1 + ...`` decoded, summed left to right (same bits everywhere);
        returns ``out``."""
        if self.raw:
            vals = rows.view(torch.float32)
            out.copy_(vals[0])
            for j in range(1, vals.shape[0]):
                out.add_(vals[j])
            return out
        payloads, scales = self._split(rows, m)
        return kernels.unpack_dequantize_accumulate(payloads, scales, m, self.bits, self.block_size,
                                                    out=out)


    def decode_sum_encode(self, rows: torch.Tensor, m: int, alpha: float, out: "Codec",
                          row: torch.Tensor, seed: int, offset: int) -> None:
        """The reduce step of the two-stage all-reduce: decode and sum ``rows`` (this codec),
        scale by ``alpha``, encode into ``row`` with codec ``out``. One fused kernel pass
        (``kernels.dequantize_sum_requantize``) when both are low-bit; the same bytes as
        :meth:`decode_sum`, ``*= alpha``, ``out.encode`` (tested)."""
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


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*parts: int, start: int = 0) -> int:
    """A 64-bit seed from integer parts (a splitmix64 chain from ``start``): different parts
    give unrelated seeds, the same parts the same seed in every process.

    Example::

        seed = mix_seed(base_seed, step, rank, bucket, chunk, stage)
    """
    h = start & _M64
    for part in parts:
        h = _splitmix64(h ^ _splitmix64(int(part) & _M64))
    return h


def stage_seed(seed: int, key: int, step: int, rank: int, stage: int) -> int:
    """The stochastic-rounding seed of one (key, step, rank, stage) of a collective: distinct for
    every rank, stage and step, and reproducible from a checkpoint (a 64-bit splitmix chain).

    Example::

        stage_seed(0, key=3, step=10, rank=1, stage=0) != stage_seed(0, 3, 10, 1, 1)   # True
    """
    return mix_seed(key, step, rank, stage, start=seed)


def key_id(key) -> int:
    """A stable integer for a user key (ints as they are, anything else via CRC32 of its repr).

    Example::

        key_id("layer1.weight") == key_id("layer1.weight")   # True, in every process
    """
    if isinstance(key, int) and not isinstance(key, bool):
        return key & _M64
    return zlib.crc32(repr(key).encode())
