"""Building blocks of the low-bit round generators (which issue asynchronous collectives through
:class:`bitscom.comm.Comm`, yield the work handles and go on once they completed): one all-to-all stage, the
reduce-then-gather ladder over levels, lockstep pipelining, padding. Names outside ``__all__`` are package-internal.
"""

from __future__ import annotations

from typing import Any, Generator, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import LowBitConfig
from .error_feedback import ErrorFeedback
from .hadamard import hadamard
from .state import LowBitState

__all__ = ["pipeline"]


def scatter(x, comm, codec, seed, offset, sent=None, row_stride=None):
    """Round: quantize x [P*m] in P shards and all-to-all them; returns the received rows (row j =
    this rank's shard from rank j). ``sent`` ([P*m]) receives D(C(x)), what the wire carried (for
    EF); row ``j`` is keyed at element ``offset + j * row_stride`` (default ``m``: global positions).
    """
    P = comm.size
    m = x.numel() // P
    step = m if row_stride is None else row_stride
    R = codec.row_bytes(m)
    send = torch.empty(P, R, dtype=torch.uint8, device=x.device)
    for j in range(P):
        codec.encode(x[j * m:(j + 1) * m], send[j], seed, offset + j * step)
        if sent is not None:
            codec.decode(send[j], m, sent[j * m:(j + 1) * m])
    recv = torch.empty_like(send)
    yield comm.all_to_all(recv.view(-1), send.view(-1))
    return recv


def scatter_reduce(x, comm, codec, seed, offset, sent=None, row_stride=None):
    """Round: x [P*m] -> this rank's shard summed over the group (float32 [m])."""
    recv = yield from scatter(x, comm, codec, seed, offset, sent, row_stride)
    m = x.numel() // comm.size
    acc = torch.empty(m, dtype=torch.float32, device=x.device)
    codec.decode_sum(recv, m, acc)
    return acc


def encode_with_feedback(x, codec, row, seed, offset, ef: Optional[ErrorFeedback]):
    """Encode ``x`` into ``row``; with ``ef``, encode ``x + e`` and keep ``e = x + e - D(C(x + e))``
    (NaN/Inf entries of the new residual dropped: that step's output shows them). In one native
    pass where the codec has one (:meth:`~bitscom.lowbit.codec.Codec.encode_feedback`: same bits)."""
    e = None if ef is None or not ef.enabled else ef.residual
    if e is not None and e.numel() == x.numel() and e.is_contiguous() and codec.fused_feedback(x):
        codec.encode_feedback(x, e, row, seed, offset)
        return
    if ef is not None:
        x = ef.compensate(x)
    codec.encode(x, row, seed, offset)
    if ef is None:
        return
    decoded = torch.empty_like(x)
    codec.decode(row, x.numel(), decoded)
    ef.update(decoded)
    ef.drop_nonfinite()


def decode_sum_scaled(codec, recv, m: int, alpha: float, out: torch.Tensor) -> torch.Tensor:
    """``alpha`` times the sum of the decoded rows of ``recv`` into ``out`` (float32 [m])."""
    codec.decode_sum(recv, m, out)
    return out.mul_(alpha) if alpha != 1.0 else out


def levels_rounds(x, levels, out_codec, alpha, seeds, offset, sent=None, stage2_ef=None,
                  anchor=None, pending=None):
    """Reduce ``x`` through ``levels`` [(comm, codec), ...] (outermost first) to one shard, scale
    it by ``alpha``, requantize it with ``out_codec`` (``stage2_ef``'s feedback) and all-gather the
    bytes back through the levels unchanged, so every rank decodes identical bytes.

    ``anchor`` (EF21 without stage-2 feedback), this rank's exact shard of the estimate g: then
    ``anchor + shard`` (the new estimate) is requantized and ``(anchor, shard)`` appended to
    ``pending``, for the caller to add once it knows the step was finite on every rank.
    """
    shard, off = x, offset
    for k, (comm, codec) in enumerate(levels[:-1]):
        m = shard.numel() // comm.size
        shard = yield from scatter_reduce(shard, comm, codec, seeds(k), off, sent if k == 0 else None)
        off += comm.rank * m
    comm, codec = levels[-1]
    m = shard.numel() // comm.size
    last = len(levels) - 1
    recv = yield from scatter(shard, comm, codec, seeds(last), off, sent if last == 0 else None)
    off += comm.rank * m
    R = out_codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    if anchor is None and stage2_ef is None:   # the fused dequantize-sum-scale-requantize kernel
        codec.decode_sum_encode(recv, m, alpha, out_codec, buf, seeds(len(levels)), off)
    else:
        shard = decode_sum_scaled(codec, recv, m, alpha, torch.empty(m, dtype=torch.float32, device=x.device))
        if anchor is not None:
            out_codec.encode(anchor + shard, buf, seeds(len(levels)), off)
            pending.append((anchor, shard))
        else:
            encode_with_feedback(shard, out_codec, buf, seeds(len(levels)), off, stage2_ef)
    for comm, _ in reversed(levels):
        gathered = torch.empty(comm.size * buf.numel(), dtype=torch.uint8, device=x.device)
        yield comm.all_gather(gathered, buf)
        buf = gathered
    rows = buf.view(-1, R)
    out = torch.empty(rows.shape[0] * m, dtype=torch.float32, device=x.device)
    for i in range(rows.shape[0]):
        out_codec.decode(rows[i], m, out[i * m:(i + 1) * m])
    return out


def leader_rounds(x, intra, inter, cfg, alpha, seeds, offset, sent=None, stage2_ef=None,
                  anchor=None, pending=None):
    """Hierarchy "leader": local reduce to the node leader, low-bit all-reduce among the leaders,
    local broadcast. Non-leaders yield ``None`` for each leader round, so every chunk takes as many
    rounds on every rank and the pipeline issues collectives in the same order everywhere."""
    if cfg.local_quantize:
        local = cfg.codec(cfg.intra_bitwidth)
        y = yield from levels_rounds(x, [(intra, local)], local, 1.0, lambda s: seeds(10 + s), offset)
        x.copy_(y)  # in place: the caller's error feedback reads the local sum from x
    else:
        yield intra.reduce(x, 0)
    if intra.rank == 0:
        x = yield from levels_rounds(x, [(inter, cfg.codec(cfg.bitwidth))],
                                     cfg.codec(cfg.resolved_stage2_bitwidth), alpha, seeds, offset,
                                     sent, stage2_ef, anchor, pending)
    else:
        yield None
        yield None
    yield intra.broadcast(x, 0)
    return x


def pipeline(gens: Sequence[Iterator[Any]]) -> Generator[List[Any], None, List[Any]]:
    """Run several round generators in lockstep, starting one more each round: round t advances chunk t's first stage
    with chunk t-1's second, and so on, in list order (the same on every rank, so each group sees the same collective
    order). Yields lists of work handles; returns the generators' results.

    Example::

        results = yield from pipeline([chunk_rounds(c) for c in chunks])
    """
    pending = list(enumerate(gens))
    results: List[Any] = [None] * len(pending)
    active: List[Tuple[int, Iterator[Any]]] = []
    while pending or active:
        if pending:
            active.append(pending.pop(0))
        works = []
        for i, g in list(active):
            try:
                w = next(g)
            except StopIteration as stop:
                results[i] = stop.value
                active.remove((i, g))
                continue
            if w is not None:
                works.append(w)
        if works or active:
            yield works
    return results


def pad(flat: torch.Tensor, unit: int, cfg: LowBitConfig, state: LowBitState) -> torch.Tensor:
    """``flat`` zero-padded to whole ``unit``s (then rotated with ``cfg.hadamard``) in ``state``'s reused buffer."""
    n = flat.numel()
    N = max(unit, -(-n // unit) * unit)
    x = state.scratch("workspace", (N,), torch.float32, flat.device)
    x[:n].copy_(flat.reshape(-1))
    x[n:].zero_()
    if cfg.hadamard:
        x = hadamard(x)
    return x


def chunk_bounds(N: int, unit: int, chunk_size: Optional[int]):
    if chunk_size is None:
        return [(0, N)]
    c = max(unit, -(-chunk_size // unit) * unit)
    return [(s, min(N, s + c)) for s in range(0, N, c)]


def world_rank(comm) -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else comm.rank
