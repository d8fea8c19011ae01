"""CUDA path: CuPy RawKernels from ``quant.cu`` on torch's current stream, so they order with the
surrounding ops and NCCL calls without synchronizing; bfloat16 scales travel as int16 views,
which every DLPack consumer understands (``docs/format.md``)."""
from __future__ import annotations

import functools
import pathlib

import numpy as np
import torch

from . import format as fmt

SOURCE = pathlib.Path(__file__).with_name("quant.cu")
OPTIONS = ("-std=c++17", "--fmad=false")
THREADS = 256


@functools.lru_cache(maxsize=None)
def _cupy():
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy build that cannot find its CUDA runtime
        return None
    return cupy


def available() -> bool:
    """True when CuPy imports (kernels compile on first launch)."""
    return _cupy() is not None


@functools.lru_cache(maxsize=None)
def _module(device_index: int):
    cp = _cupy()
    with cp.cuda.Device(device_index):
        return cp.RawModule(code=SOURCE.read_text(), options=OPTIONS)


def _lanes(bs: int, *bits: int) -> int:
    return min(32, bs // max(fmt.group(b)[0] for b in bits))


def _launch(name, device, grid, args):
    cp = _cupy()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    kern = _module(idx).get_function(name)
    with cp.cuda.Device(idx):
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(idx).cuda_stream)
        with stream:
            conv = [cp.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
            kern((grid,), (THREADS,), tuple(conv), stream=stream)


def quantize_pack(x, bits, block_size, stochastic, seed, index_offset, payload, scales):
    nb = fmt.num_blocks(x.numel(), block_size)
    if nb == 0:
        return payload, scales
    k1, k2 = fmt.seed_keys(seed)
    L = _lanes(block_size, bits)
    grid = -(-nb * L // THREADS)
    _launch("bq_quantize", x.device, grid,
            [x, np.int64(x.numel()), np.int32(bits), np.int32(block_size), np.int32(L), np.int32(stochastic),
             np.uint32(k1), np.uint32(k2), np.uint64(index_offset), payload, scales.view(torch.int16),
             np.int64(nb)])
    return payload, scales


def unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size, out, accumulate):
    if numel == 0:
        return out
    g = fmt.group(bits)[0]
    groups = -(-numel // g)                     # ceil(numel / g) thread groups
    grid = -(-groups // THREADS)                # ceil(groups / THREADS) blocks
    _launch("bq_dequant_acc", payloads.device, grid,
            [payloads, np.int64(payloads.stride(0)), scales.view(torch.int16), np.int64(scales.stride(0)),
             np.int32(payloads.shape[0]), np.int64(numel), np.int32(bits), np.int32(block_size), out,
             np.int32(accumulate)])
    return out


def dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits, alpha, stochastic, seed,
                              index_offset, payload, out_scales, sum_out):
    nb = fmt.num_blocks(numel, block_size)
    if nb == 0:
        return payload, out_scales
    if sum_out is None:
        sum_out = torch.empty(numel, dtype=torch.float32, device=payloads.device)
    k1, k2 = fmt.seed_keys(seed)
    L = _lanes(block_size, bits, out_bits)
    grid = -(-nb * L // THREADS)
    _launch("bq_dsr", payloads.device, grid,
            [payloads, np.int64(payloads.stride(0)), scales.view(torch.int16), np.int64(scales.stride(0)),
             np.int32(payloads.shape[0]), np.int64(numel), np.int32(bits), np.int32(block_size),
             np.int32(out_bits), np.int32(L), np.float32(alpha), np.int32(stochastic), np.uint32(k1),
             np.uint32(k2), np.uint64(index_offset), payload, out_scales.view(torch.int16), sum_out,
             np.int64(nb)])
    return payload, out_scales
