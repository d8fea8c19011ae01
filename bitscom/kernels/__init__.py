"""Hot loops of the low-bit format on flat float32 buffers, in three implementations with
identical bytes, dispatched by device (``docs/format.md``). ``index_offset`` keys stochastic
rounding by the *global* element index, so the bytes do not depend on how a buffer is sharded.
"""
from __future__ import annotations

import torch

from . import format as fmt
from . import torch_ref
from ..validate import choice, instance
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


# impl -> (the device type it needs, how to get it when it is unavailable)
_COMPILED = {"native": ("cpu", "no working C++ compiler"), "cuda": ("cuda", "pip install cupy-cuda13x")}


def implementation(device) -> str:
    """Name of the implementation ``impl=None`` uses for tensors on ``device``.

    Example::

        implementation("cpu")   # 'native', or 'torch' without a C++ compiler
    """
    device = torch.device(device)
    if device.type == "cpu":
        return "native" if _native() is not None else "torch"
    if device.type == "cuda":
        return "cuda" if _cuda() is not None else "torch"
    return "torch"


def _backend(impl, device):
    choice("impl", impl, IMPLEMENTATIONS + (None,))
    name = implementation(device) if impl is None else impl
    if name == "torch":
        return torch_ref
    needs, fix = _COMPILED[name]
    if device.type != needs:
        raise ValueError(f"impl={name!r} needs {needs.upper()} tensors, got device {device}")
    mod = _native() if name == "native" else _cuda()
    if mod is None:
        raise RuntimeError(f"impl={name!r} is unavailable ({fix}); use impl='torch'")
    return mod


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


def _received(payloads, scales, numel, bits, block_size):
    """The checked P received rows: uint8 payloads and bfloat16 scales, the same P >= 1."""
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    payloads = _rows(payloads, payload_bytes(numel, bits, block_size), torch.uint8, "payloads")
    scales = _rows(scales, num_blocks(numel, block_size), torch.bfloat16, "scales")
    if payloads.shape[0] != scales.shape[0] or payloads.shape[0] < 1:
        raise ValueError(f"payloads and scales need the same P >= 1 rows, got {payloads.shape[0]} and "
                         f"{scales.shape[0]}")
    return payloads, scales


def quantize_pack(x, bits, block_size=128, *, stochastic=False, seed=0, index_offset=0,
                  payload=None, scales=None, impl=None):
    """Fused blockwise quantize + bit-pack of a flat float32 tensor: ``(payload, scales)``, uint8
    ``[payload_bytes(...)]`` and bfloat16 ``[num_blocks(...)]`` (into ``payload``/``scales`` when
    given). Element ``i`` draws its stochastic-rounding number from (seed, index_offset + i).

    Example::

        p, s = quantize_pack(torch.randn(1000), 4, 128, stochastic=True, seed=7)   # 512 and 8 elements
    """
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    fmt.check_seed(seed)
    fmt.check_index_offset(index_offset)
    if instance("x", x, torch.Tensor, "a torch.Tensor").dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise TypeError(f"x must be a contiguous 1-D float32 tensor, got {x.dtype} shape "
                        f"{tuple(x.shape)} (contiguous={x.is_contiguous()})")
    n = x.numel()
    payload = _out_buf(payload, (payload_bytes(n, bits, block_size),), torch.uint8, x.device, "payload")
    scales = _out_buf(scales, (num_blocks(n, block_size),), torch.bfloat16, x.device, "scales")
    be = _backend(impl, x.device)
    return be.quantize_pack(x, bits, block_size, bool(stochastic), seed, index_offset, payload, scales)


def unpack_dequantize(payload, scales, numel, bits, block_size=128, *, out=None, impl=None):
    """Unpack + dequantize one shard into float32 ``out`` of shape ``[numel]`` (returned).

    Example::

        y = unpack_dequantize(*quantize_pack(x, 8), x.numel(), 8)   # x to 8-bit precision
    """
    return unpack_dequantize_accumulate(payload.reshape(1, -1), scales.reshape(1, -1), numel, bits,
                                        block_size, out=out, impl=impl)


def unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size=128, *, out=None,
                                 accumulate=False, impl=None):
    """Dequantize P peers' shards and sum them into float32 ``out = [out +] v_0 + ... + v_{P-1}`` (returned), left to
    right, so every rank and device gets the same bits. ``payloads`` uint8 ``[P, >=payload_bytes]`` and ``scales``
    bfloat16 ``[P, >=nblocks]`` may be views of one buffer (``recv[:, :pb]``, ``recv[:, pb:].view(torch.bfloat16)``)."""
    payloads, scales = _received(payloads, scales, numel, bits, block_size)
    out = _out_buf(out, (numel,), torch.float32, payloads.device, "out")
    return _backend(impl, payloads.device).unpack_dequantize_accumulate(payloads, scales, numel, bits,
                                                                        block_size, out, bool(accumulate))


def dequantize_sum_requantize(payloads, scales, numel, bits, block_size=128, *, out_bits=None,
                              alpha=1.0, stochastic=False, seed=0, index_offset=0, payload=None,
                              out_scales=None, sum_out=None, impl=None):
    """Fused reduce step of the two-stage all-reduce: ``acc = v_0 + ... + v_{P-1}`` (float32, left to right),
    ``acc *= alpha`` (skipped when 1.0), then :func:`quantize_pack` of ``acc`` at ``out_bits`` (default ``bits``);
    ``sum_out`` (float32 ``[numel]``), when given, receives ``acc``. Returns ``(payload, scales)``.

    Example::

        p, s = dequantize_sum_requantize(payloads, scales, m, 8, alpha=1 / world, out_bits=4, index_offset=rank * m)
    """
    out_bits = bits if out_bits is None else out_bits
    fmt.check_bits(out_bits)
    fmt.check_seed(seed)
    fmt.check_index_offset(index_offset)
    payloads, scales = _received(payloads, scales, numel, bits, block_size)
    dev = payloads.device
    payload = _out_buf(payload, (payload_bytes(numel, out_bits, block_size),), torch.uint8, dev, "payload")
    out_scales = _out_buf(out_scales, (num_blocks(numel, block_size),), torch.bfloat16, dev, "out_scales")
    if sum_out is not None:
        sum_out = _out_buf(sum_out, (numel,), torch.float32, dev, "sum_out")
    return _backend(impl, dev).dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits,
                                                         float(alpha), bool(stochastic), seed, index_offset,
                                                         payload, out_scales, sum_out)
