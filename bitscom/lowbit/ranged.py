"""The flat two-stage low-bit all-reduce, one block-aligned range at a time (:func:`range_rounds`).

Why: 1-bit Adam sends each part of its flat momentum as soon as backward fills it, yet must get the very bits of
:func:`~bitscom.lowbit.all_reduce_rounds` (``docs/onebit.md``). Every step of that algorithm is local to one block, so a
range of whole blocks inside one owner's shard runs alone, its bytes summing to the whole-tensor call's.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from .config import LowBitConfig
from .error_feedback import ErrorFeedback
from .rounds import encode_with_feedback, world_rank
from .seeds import key_id, stage_seed
from .state import LowBitState

__all__ = ["owner_ranges", "range_rounds", "check_ranged"]


def check_ranged(cfg: LowBitConfig) -> None:
    """A ValueError unless ``cfg`` is one :func:`range_rounds` reproduces bitwise."""
    if cfg.hierarchy != "none" or cfg.hadamard or cfg.error_feedback_mode not in ("none", "residual") \
            or cfg.simulate_quantization or cfg.chunk_size is not None:
        raise ValueError(f"range_rounds reproduces the flat all-reduce only (hierarchy 'none', no "
                         f"Hadamard, no chunks, error feedback 'none' or 'residual'); got {cfg!r}")


def owner_ranges(numel: int, world: int, block_size: int, max_elements: int) -> List[Tuple[int, int, int]]:
    """``(start, stop, owner)`` pieces that tile the padded ``[0, N)`` of a flat all-reduce of ``numel`` elements over
    ``world`` ranks: whole blocks, inside one owner's shard, at most ``max(block_size, max_elements)`` long; last piece
    first (a flat buffer filled by backward in reverse parameter order completes from its end)."""
    unit = world * block_size
    N = max(unit, -(-numel // unit) * unit)
    m = N // world
    step = max(block_size, max_elements // block_size * block_size)
    pieces = [(s, min((j + 1) * m, s + step), j) for j in range(world) for s in range(j * m, (j + 1) * m, step)]
    return pieces[::-1]


def range_rounds(flat: torch.Tensor, start: int, stop: int, owner: int, comm, cfg: LowBitConfig,
                 state: LowBitState, step: int) -> Iterator:
    """Round generator: replace ``flat[start:stop]`` by the low-bit average over ranks, bitwise
    what ``all_reduce_rounds(flat, comm, cfg, state)`` gives there. ``(start, stop, owner)`` is
    one of :func:`owner_ranges`; ``step`` is the whole-tensor call's ``state.step`` (the caller
    advances it and calls ``state.bind(flat.numel())`` once per all-reduce)."""
    n, P, dev = flat.numel(), comm.size, flat.device
    unit = P * cfg.block_size
    N = max(unit, -(-n // unit) * unit)
    m, length, hi = N // P, stop - start, min(stop, n)
    c1, c2 = cfg.codec(cfg.bitwidth), cfg.codec(cfg.resolved_stage2_bitwidth)
    r1, r2 = c1.row_bytes(length), c2.row_bytes(length)
    rank, kid = world_rank(comm), key_id(0)
    x = torch.zeros(length, dtype=torch.float32, device=dev)
    if hi > start:
        x[:hi - start].copy_(flat[start:hi])
    send = torch.empty(r1, dtype=torch.uint8, device=dev)
    ef = ErrorFeedback.over(state.residual.ensure(N, dev)[start:stop]) if cfg.residual else None
    encode_with_feedback(x, c1, send, stage_seed(cfg.seed, kid, step, rank, 0), start, ef)
    mine = comm.rank == owner
    recv = torch.empty(P * r1 if mine else 0, dtype=torch.uint8, device=dev)
    yield comm.all_to_all_v(recv, send, [r1 if mine else 0] * P, [r1 if j == owner else 0 for j in range(P)])
    row = torch.empty(r2, dtype=torch.uint8, device=dev)
    if mine:
        shard = torch.empty(length, dtype=torch.float32, device=dev)
        c1.decode_sum(recv.view(P, r1), length, shard)
        shard.mul_(1.0 / P)
        e2 = state.stage2_residual.ensure(m, dev) if cfg.stage2_error_feedback else None
        ef = None if e2 is None else ErrorFeedback.over(e2[start - owner * m:stop - owner * m])
        encode_with_feedback(shard, c2, row, stage_seed(cfg.seed, kid, step, rank, 1), start, ef)
    yield comm.broadcast(row, owner)
    if hi > start:
        c2.decode_prefix(row, length, flat[start:hi])
