"""Hot loops of the low-bit format on flat float32 buffers, dispatched by device.

Three implementations share one signature and produce identical bytes:

* ``"torch"``  – eager torch ops (``torch_ref``): any device, the reference;
* ``"native"`` – a fused C++ loop compiled with the system compiler on first use and loaded with
  ctypes (``cpu_native``): the fast CPU path, falling back to ``"torch"`` if no compiler works;
* ``"cuda"``   – CuPy RawKernels from ``*.cu`` (``cuda``), zero-copy via DLPack on the current
  torch stream: the CUDA path, falling back to ``"torch"`` if CuPy is missing.

``impl=None`` picks the fastest available for the tensor's device. The functions are shaped for
the two-stage all-reduce: quantize each world-size shard of a flat buffer into rows of one send
buffer (``index_offset`` keeps stochastic rounding keyed by the *global* element index, so the
bytes do not depend on how the buffer is sharded), dequantize-and-sum the P received rows,
requantize the reduced shard, and dequantize the gathered rows. Outputs can be preallocated
(``payload=``, ``scales=``, ``out=``): views into a larger buffer are fine.

Layout of one quantized shard of ``numel`` elements (sizes from :func:`payload_bytes`,
:func:`num_blocks`; both depend only on (numel, bits, block_size)):

* payload: uint8 ``[payload_bytes(numel, bits, block_size)]`` = ``nblocks * block_size * bits / 8``,
  block k's codes at bytes ``[k * block_size * bits / 8, (k+1) * ...)``, bit order as in
  ``bitscom.quantization``;
* scales: bfloat16 ``[nblocks]``.

The format's specification is ``docs/format.md``.
"""
from __future__ import annotations

import torch

from . import format as fmt
from . import torch_ref
from .format import (SUPPORTED_BITS, num_blocks, payload_bytes, scale_bytes, wire_bytes,
                     bits_per_element)

__all__ = ["SUPPORTED_BITS", "num_blocks", "payload_bytes", "scale_bytes", "wire_bytes",
           "bits_per_element", "quantize_pack", "unpack_dequantize", "unpack_dequantize_accumulate",
           "dequantize_sum_requantize", "implementation", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("torch", "native", "cuda")


def _native():
    from . import cpu_native
    return cpu_native if cpu_native.available() else None


def _cuda():
    from . import cuda
    return cuda if cuda.available() else None


def implementation(device) -> str:
    """Name of the implementation ``impl=None`` uses for tensors on ``device``.

    Example::

        >>> implementation("cpu") in ("native", "torch")
        True
    """
    device = torch.device(device)
    if device.type == "cpu":
        return "native" if _native() is not None else "torch"
    if device.type == "cuda":
        return "cuda" if _cuda() is not None else "torch"
    return "torch"


def _backend(impl, device):
    name = implementation(device) if impl is None else impl
    if name == "torch":
        return torch_ref
    if name == "native":
        if device.type != "cpu":
            raise ValueError(f"impl='native' needs CPU tensors, got device {device}")
        mod = _native()
        if mod is None:
            raise RuntimeError("impl='native' is unavailable (no working C++ compiler); use impl='torch'")
        return mod
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"impl='cuda' needs CUDA tensors, got device {device}")
        mod = _cuda()
        if mod is None:
            raise RuntimeError("impl='cuda' is unavailable (pip install cupy-cuda13x); use impl='torch'")
        return mod
    raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS} or None")


def _flat_f32(x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise TypeError(f"{name} must be a contiguous 1-D float32 tensor, got {x.dtype} shape "
                        f"{tuple(x.shape)} (contiguous={x.is_contiguous()})")
    return x


def _out_buf(t, shape, dtype, device, name):
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} on {device} with unit last "
                         f"stride, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def _rows(t, width, dtype, name):
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2 or t.shape[1] < width \
            or t.stride(1) != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a 2-D {dtype} tensor [P, >={width}] with unit last stride, got {got}")
    return t


def quantize_pack(x, bits, block_size=128, *, stochastic=False, seed=0, index_offset=0,
                  payload=None, scales=None, impl=None):
    """Fused blockwise quantize + bit-pack of a flat float32 tensor.

    Returns ``(payload, scales)``: uint8 ``[payload_bytes(x.numel(), bits, block_size)]`` and
    bfloat16 ``[num_blocks(x.numel(), block_size)]``, written into ``payload``/``scales`` when
    given. Element ``i`` draws its stochastic-rounding number from (seed, index_offset + i).

    Example::

        >>> x = torch.randn(1000)
        >>> p, s = quantize_pack(x, 4, 128, stochastic=True, seed=7, index_offset=0)
        >>> p.numel(), s.numel()
        (512, 8)
    """
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    fmt.check_seed(seed)
    fmt.check_index_offset(index_offset)
    x = _flat_f32(x)
    n = x.numel()
    payload = _out_buf(payload, (payload_bytes(n, bits, block_size),), torch.uint8, x.device, "payload")
    scales = _out_buf(scales, (num_blocks(n, block_size),), torch.bfloat16, x.device, "scales")
    be = _backend(impl, x.device)
    if be is torch_ref:
        p, s = torch_ref.quantize_pack(x, bits, block_size, bool(stochastic), seed, index_offset)
        payload.copy_(p)
        scales.copy_(s)
    else:
        be.quantize_pack(x, bits, block_size, bool(stochastic), seed, index_offset, payload, scales)
    return payload, scales


def unpack_dequantize(payload, scales, numel, bits, block_size=128, *, out=None, impl=None):
    """Unpack + dequantize one shard into float32 ``out`` of shape ``[numel]`` (returned).

    Example::

        >>> x = torch.randn(1000)
        >>> y = unpack_dequantize(*quantize_pack(x, 8), 1000, 8)
        >>> bool((y - x).abs().max() < 0.05)
        True
    """
    return unpack_dequantize_accumulate(payload.reshape(1, -1), scales.reshape(1, -1), numel, bits,
                                        block_size, out=out, impl=impl)


def unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size=128, *, out=None,
                                 accumulate=False, impl=None):
    """Dequantize P peers' shards and sum them: ``out = [out +] v_0 + ... + v_{P-1}``.

    ``payloads`` uint8 ``[P, >=payload_bytes]`` and ``scales`` bfloat16 ``[P, >=nblocks]`` (rows
    may be views into a larger receive buffer). The sum is float32, added left to right in peer
    order, so every rank and device gets the same bits. Returns float32 ``out`` ``[numel]``.

    Example::

        >>> xs = [torch.randn(300) for _ in range(3)]
        >>> qs = [quantize_pack(x, 8) for x in xs]
        >>> P = torch.stack([q[0] for q in qs]); S = torch.stack([q[1] for q in qs])
        >>> y = unpack_dequantize_accumulate(P, S, 300, 8)
        >>> bool((y - sum(xs)).abs().max() < 0.1)
        True
    """
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    payloads = _rows(payloads, payload_bytes(numel, bits, block_size), torch.uint8, "payloads")
    scales = _rows(scales, num_blocks(numel, block_size), torch.bfloat16, "scales")
    if payloads.shape[0] != scales.shape[0] or payloads.shape[0] < 1:
        raise ValueError(f"payloads and scales need the same P >= 1 rows, got {payloads.shape[0]} and "
                         f"{scales.shape[0]}")
    out = _out_buf(out, (numel,), torch.float32, payloads.device, "out")
    be = _backend(impl, payloads.device)
    return be.unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size, out, bool(accumulate))


def dequantize_sum_requantize(payloads, scales, numel, bits, block_size=128, *, out_bits=None,
                              alpha=1.0, stochastic=False, seed=0, index_offset=0, payload=None,
                              out_scales=None, sum_out=None, impl=None):
    """Fused reduce step of the two-stage all-reduce: dequantize P rows, sum, scale, requantize.

    Steps: 1. ``acc = v_0 + ... + v_{P-1}`` in float32, left to right; 2. ``acc *= alpha`` (e.g.
    1/world_size to average; skipped when 1.0); 3. quantize ``acc`` to ``out_bits`` (default
    ``bits``) exactly as :func:`quantize_pack` would, with ``index_offset`` the shard's global
    offset. ``sum_out`` (float32 ``[numel]``), when given, receives ``acc`` (e.g. for error
    feedback). Returns ``(payload, scales)`` laid out like :func:`quantize_pack`'s.

    Example::

        >>> xs = [torch.randn(256) for _ in range(4)]
        >>> qs = [quantize_pack(x, 8) for x in xs]
        >>> P = torch.stack([q[0] for q in qs]); S = torch.stack([q[1] for q in qs])
        >>> p, s = dequantize_sum_requantize(P, S, 256, 8, alpha=0.25, out_bits=4)
        >>> p.numel(), s.numel()
        (128, 2)
    """
    out_bits = bits if out_bits is None else out_bits
    for b in (bits, out_bits):
        fmt.check_bits(b)
    fmt.check_block_size(block_size)
    fmt.check_seed(seed)
    fmt.check_index_offset(index_offset)
    payloads = _rows(payloads, payload_bytes(numel, bits, block_size), torch.uint8, "payloads")
    scales = _rows(scales, num_blocks(numel, block_size), torch.bfloat16, "scales")
    if payloads.shape[0] != scales.shape[0] or payloads.shape[0] < 1:
        raise ValueError(f"payloads and scales need the same P >= 1 rows, got {payloads.shape[0]} and "
                         f"{scales.shape[0]}")
    dev = payloads.device
    payload = _out_buf(payload, (payload_bytes(numel, out_bits, block_size),), torch.uint8, dev, "payload")
    out_scales = _out_buf(out_scales, (num_blocks(numel, block_size),), torch.bfloat16, dev, "out_scales")
    if sum_out is not None:
        sum_out = _out_buf(sum_out, (numel,), torch.float32, dev, "sum_out")
    be = _backend(impl, dev)
    if be is torch_ref:
        p, s = torch_ref.dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits,
                                                   float(alpha), bool(stochastic), seed, index_offset,
                                                   sum_out)
        payload.copy_(p)
        out_scales.copy_(s)
    else:
        be.dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits, float(alpha),
                                     bool(stochastic), seed, index_offset, payload, out_scales, sum_out)
    return payload, out_scales
