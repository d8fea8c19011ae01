"""Eager torch implementation of the hot loops: the portable path (any device; slow on CPU, one
pass over memory per op) and the byte-exact reference. Every step is an IEEE-exact or correctly
rounded elementwise op in a fixed order, so the native and CUDA kernels reproduce its bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import format as fmt

_M32 = fmt.MASK32


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32) without int64 overflow (16-bit split)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform24(seed: int, index_offset: int, count: int, device) -> torch.Tensor:
    """24-bit counter-hash integers (as float32, exact) for global indices offset..offset+count-1."""
    k1, k2 = fmt.seed_keys(seed)
    idx = torch.arange(count, dtype=torch.int64, device=device) + index_offset
    h = _fmix32((idx & _M32) ^ k1)
    h = _fmix32(h ^ (idx >> 32) ^ k2)
    return (h >> 8).to(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian bit stream: code i occupies stream bits [i*b, (i+1)*b); ceil(n*b/8) bytes."""
    n = codes.numel()
    g, gb = fmt.group(bits)
    c = codes.reshape(-1).to(torch.int64)
    c = F.pad(c, (0, (-n) % g)).view(-1, g)
    w = c[:, 0].clone()
    for j in range(1, g):
        w |= c[:, j] << (j * bits)
    out = torch.stack([(w >> (8 * k)) & 0xFF for k in range(gb)], dim=1) if gb > 1 else w.unsqueeze(1)
    return out.to(torch.uint8).reshape(-1)[: (n * bits + 7) // 8]


def unpack_codes(payload: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``count`` codes as int32."""
    g, gb = fmt.group(bits)
    ngroups = -(-count // g)
    p = payload.reshape(-1)[: ngroups * gb].to(torch.int64)
    p = F.pad(p, (0, ngroups * gb - p.numel())).view(ngroups, gb)
    w = p[:, 0].clone()
    for k in range(1, gb):
        w |= p[:, k] << (8 * k)
    mask = (1 << bits) - 1
    c = torch.stack([(w >> (j * bits)) & mask for j in range(g)], dim=1) if g > 1 else w.unsqueeze(1)
    return c.reshape(-1)[:count].to(torch.int32)


def _tree_sum(a: torch.Tensor) -> torch.Tensor:
    """Row sums by the contiguous-halves tree ((a0+a1)+(a2+a3))+...: a fixed order every path copies."""
    while a.shape[1] > 1:
        a = a.reshape(a.shape[0], a.shape[1] // 2, 2)
        a = a[..., 0] + a[..., 1]
    return a[:, 0]


def _stored_scales(raw: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """fp32 scales rounded *up* to bfloat16 (so no code clips) as int64 bit patterns, by integer ops (exact everywhere):
    non-zero blocks at least the smallest subnormal, overflow to the largest finite, non-finite to NaN."""
    raw = torch.where(finite, raw, torch.zeros_like(raw))
    b = raw.view(torch.int32).to(torch.int64)
    b = ((b + 0xFFFF) >> 16)
    b = torch.where((b == 0) & (amax > 0), torch.ones_like(b), b)
    b = torch.where(b >= 0x7F80, torch.full_like(b, 0x7F7F), b)
    return torch.where(finite, b, torch.full_like(b, 0x7FC0))


def quantize_pack(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int, index_offset: int,
                  payload: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat float32 ``x`` into ``payload`` (uint8 [payload_bytes]) and ``scales`` (bfloat16 [nblocks])."""
    n = x.numel()
    nb = fmt.num_blocks(n, block_size)
    xp = F.pad(x.reshape(-1).to(torch.float32), (0, nb * block_size - n)).view(nb, block_size)
    finite = torch.isfinite(xp).all(dim=1)
    ax = xp.abs()
    amax = ax.amax(dim=1) if nb else ax.sum(dim=1)
    qm = fmt.qmax(bits)
    sign = bits == 1 and not stochastic          # scaled sign: mean |x| scale, code 1 = negative
    sbits = _stored_scales(_tree_sum(ax) / block_size if sign else amax / qm, amax, finite)
    s = (sbits << 16).to(torch.int32).view(torch.float32)
    live = (finite & (sbits > 0)).unsqueeze(1)
    if sign:
        u = (xp < 0).to(torch.int64)
    else:
        y = xp / s.unsqueeze(1)
        if stochastic:
            r = uniform24(seed, index_offset, nb * block_size, x.device).view(nb, block_size)
        if bits == 1:
            u = (r < (1.0 - y) * 0.5 * 16777216.0).to(torch.int64)
        else:
            if stochastic:
                fl = torch.floor(y)
                q = fl + (r < (y - fl) * 16777216.0).to(torch.float32)
            else:
                q = torch.round(y)
            u = q.clamp(-qm, qm).to(torch.int64) + qm
    u = torch.where(live, u, torch.full_like(u, 0 if bits == 1 else qm))
    payload.copy_(pack_codes(u, bits))
    scales.copy_(sbits.to(torch.int16).view(torch.bfloat16))
    return payload, scales


def unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size, out, accumulate):
    """out = [out +] v_0 + ... + v_{P-1} ([P, bytes] payloads, [P, nblocks] scales), left to right in float32."""
    nb, P = fmt.num_blocks(numel, block_size), payloads.shape[0]
    pb = fmt.payload_bytes(numel, bits, block_size)
    codes = unpack_codes(payloads[:, :pb].reshape(-1), bits, P * nb * block_size).view(P, nb, block_size)
    s = scales[:, :nb].to(torch.float32).unsqueeze(2)
    v = ((1 - 2 * codes) if bits == 1 else (codes - fmt.qmax(bits))).to(torch.float32) * s
    v = v.view(P, nb * block_size)[:, :numel]
    if not accumulate:
        out.copy_(v[0])
    for p in range(0 if accumulate else 1, v.shape[0]):
        out.add_(v[p])
    return out


def dequantize_sum_requantize(payloads, scales, numel, bits, block_size, out_bits, alpha,
                              stochastic, seed, index_offset, payload, out_scales, sum_out):
    """Sum of P dequantized shards (left to right), times alpha, requantized to ``out_bits``."""
    acc = sum_out if sum_out is not None else torch.empty(numel, dtype=torch.float32, device=payloads.device)
    unpack_dequantize_accumulate(payloads, scales, numel, bits, block_size, acc, False)
    if alpha != 1.0:
        acc.mul_(alpha)
    return quantize_pack(acc, out_bits, block_size, stochastic, seed, index_offset, payload, out_scales)
