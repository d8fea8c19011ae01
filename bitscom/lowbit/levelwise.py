"""Level-wise low-bit reduce-scatter (SDP4Bit's TLq / TLq-HS; the algorithm: ``docs/sharded.md``, "TLq").

Each level of the rank grid (SDP4Bit: intra-node, then inter-node) is one quantized all-to-all and a float32
sum in peer order; a level of one rank sends nothing but still takes its round (yielding ``None``). A rank owns
the shard its level coordinates number as a mixed-radix number, ``order`` listing the levels from the most
significant digit (default: the last, ``node * L + local``, the ZeRO layout). Seeds:
``mix_seed(*seed_parts, chunk, level + 1)``, shared by a level's rows (a peer sums rows of different ranks).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator, List, Optional, Sequence, Tuple

import torch

from ..validate import choice, instance, number
from .codec import Codec
from .hadamard import HADAMARD_BACKENDS, HADAMARD_BLOCK, hadamard as _hadamard
from .rounds import pipeline, scatter_reduce
from .seeds import mix_seed

if TYPE_CHECKING:
    from ..comm import Comm

__all__ = ["levelwise_chunks", "levelwise_reduce_scatter_rounds", "levelwise_wire_bytes", "default_order"]


def default_order(levels: int) -> Tuple[int, ...]:
    """The shard order where the last level is the most significant digit: ``(levels - 1, ..., 0)``
    (two levels: shard = inter_rank * L + intra_rank)."""
    return tuple(reversed(range(levels)))


def _check(flat, out, levels, chunks, order, hadamard, hadamard_backend):
    if not levels:
        raise ValueError("levels must list at least one (comm, codec) pair")
    for i, (_, codec) in enumerate(levels):
        instance(f"levels[{i}] codec", codec, Codec, "a bitscom.lowbit.Codec (levels are (comm, Codec) pairs)")
    world = math.prod(comm.size for comm, _ in levels)
    if not (flat.is_floating_point() and out.is_floating_point()):
        raise TypeError(f"level-wise reduce-scatter needs floating tensors, got {flat.dtype} -> {out.dtype}")
    S = out.numel()
    if flat.numel() != world * S:
        raise ValueError(f"input has {flat.numel()} elements; the levels' sizes "
                         f"{[c.size for c, _ in levels]} x output numel {S} need {world * S}")
    if S % number("chunks", chunks, minimum=1, integer=True):
        raise ValueError(f"chunks={chunks!r} must be an int >= 1 dividing the shard size {S}")
    if sorted(order) != list(range(len(levels))):
        raise ValueError(f"order={tuple(order)!r} must be a permutation of the level indices "
                         f"{tuple(range(len(levels)))}")
    if hadamard and (S // chunks) % HADAMARD_BLOCK:
        raise ValueError(f"hadamard needs chunks of whole {HADAMARD_BLOCK}-element runs; shard {S} / "
                         f"chunks {chunks} = {S // chunks}")
    choice("hadamard_backend", hadamard_backend, HADAMARD_BACKENDS)


def _chunk_rounds(x: torch.Tensor, out: torch.Tensor, levels, order, seeds: List[int],
                  hadamard: Optional[str], alpha: float) -> Iterator:
    """One chunk: ``x`` [world, C] (row i = shard i's chunk), ``out`` [C]."""
    sizes = [comm.size for comm, _ in levels]
    C = out.numel()
    dims = list(order)
    cur = x.view(*[sizes[d] for d in dims], C)
    for j, (comm, codec) in enumerate(levels):
        rows = cur.movedim(dims.index(j), 0)
        dims.remove(j)
        if comm.size == 1:
            cur = rows[0].clone() if j == 0 else rows[0]   # own the input: read later rounds
            yield None
            continue
        send = rows.reshape(comm.size, -1).reshape(-1)
        acc = yield from scatter_reduce(send, comm, codec, seeds[j], 0, row_stride=0)
        cur = acc.view(*[sizes[d] for d in dims], C)
    red = cur.reshape(-1)
    if hadamard is not None:
        red = _hadamard(red, backend=hadamard)
    if alpha != 1.0:
        red = red * alpha
    out.copy_(red)


def levelwise_chunks(flat: torch.Tensor, out: torch.Tensor, levels: Sequence[Tuple[Comm, Codec]], *,
                     chunks: int = 1, order: Optional[Sequence[int]] = None, hadamard: bool = False,
                     hadamard_backend: str = "gemm", alpha: float = 1.0,
                     seed_parts: Sequence[int] = ()) -> List[Iterator]:
    """One round generator per pipeline chunk of a level-wise reduce-scatter of ``flat`` (all shards; read here,
    converted to float32 and rotated once) into ``out`` (this rank's shard), each yielding once per level of ``levels``,
    ``[(comm, codec), ...]`` in round order. Per level, issue chunk ``k``'s round only after every earlier chunk's, or
    use :func:`levelwise_reduce_scatter_rounds`."""
    order = default_order(len(levels)) if order is None else tuple(order)
    _check(flat, out, levels, chunks, order, hadamard, hadamard_backend)
    S = out.numel()
    world = math.prod(comm.size for comm, _ in levels)
    x = flat.reshape(-1).to(torch.float32)
    if hadamard:
        x = _hadamard(x, backend=hadamard_backend)
    x = x.view(world, S)
    C = S // chunks
    backend = hadamard_backend if hadamard else None
    return [_chunk_rounds(x[:, k * C:(k + 1) * C], out[k * C:(k + 1) * C], levels, order,
                          [mix_seed(*seed_parts, k, j + 1) for j in range(len(levels))], backend, alpha)
            for k in range(chunks)]


def levelwise_reduce_scatter_rounds(flat: torch.Tensor, out: torch.Tensor,
                                    levels: Sequence[Tuple[Comm, Codec]], **settings) -> Iterator:
    """Round generator: the level-wise reduce-scatter of ``flat`` into ``out``, its chunks
    pipelined in lockstep; ``settings`` are :func:`levelwise_chunks`'.

    Example::

        drive(levelwise_reduce_scatter_rounds(bucket, shard, [(intra, c8), (inter, c4)], chunks=4))
    """
    yield from pipeline(levelwise_chunks(flat, out, levels, **settings))


def levelwise_wire_bytes(shard_numel: int, levels: Sequence[Tuple[int, Codec]], chunks: int = 1) -> int:
    """Bytes one rank sends in a level-wise reduce-scatter with shards of ``shard_numel`` elements (per chunk and level
    of ``P > 1`` ranks, the all-to-all's ``P`` rows); ``levels`` are ``(size, codec)`` pairs."""
    C = shard_numel // chunks
    return chunks * sum(size * codec.row_bytes(math.prod(s for s, _ in levels[j + 1:]) * C)
                        for j, (size, codec) in enumerate(levels) if size > 1)
