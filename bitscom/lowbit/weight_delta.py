"""SDP4Bit's quantized weight differences (qWD): the one codec both sharded faces use.

A rank that owns a shard sends ``Q(new - replica)``: its updated shard minus the copy of that
shard every rank already holds, quantized with stochastic rounding (``Codec(bits, group_size,
stochastic=True)``). Every rank, the owner included, decodes the same bytes and adds them to its
copy (:func:`add_delta`), so the copies stay bitwise identical. Because the difference is taken
against the *replica*, the error of one gather is part of the next one's difference: the
replica never drifts from the exact values by more than one gather's quantization error.

Used by :mod:`bitscom.sharded.weights` (the ShardedOptimizer's parameter all-gather) and
:mod:`bitscom.fsdp.weights` (FSDP2's parameter all-gather).

Example::

    codec = delta_codec(4, 2048)
    row = torch.empty(codec.row_bytes(n), dtype=torch.uint8)
    encode_delta(codec, new_shard, replica_shard, row, seed)
    replica_shard = add_delta(replica_shard, codec.decode(row, n))
"""

from __future__ import annotations

import torch

from .codec import Codec

__all__ = ["delta_codec", "encode_delta", "add_delta"]


def delta_codec(bits: int, group_size: int) -> Codec:
    """The codec of the weight differences: ``bits`` wide, one scale per ``group_size``
    elements, stochastic rounding (unbiased, so differences do not drift one way).

    Example::

        delta_codec(4, 2048).row_bytes(4096)
    """
    return Codec(bits, group_size, stochastic=True)


def encode_delta(codec: Codec, new: torch.Tensor, replica: torch.Tensor, row: torch.Tensor, seed: int) -> None:
    """Write ``Q(new - replica)`` (both flat, any float dtype; the difference in float32) into
    the uint8 ``row`` (``codec.row_bytes(new.numel())`` bytes).

    Example::

        encode_delta(codec, master_shard, replica_shard, row, seed=mix_seed(0, step, rank))
    """
    codec.encode(new.to(torch.float32) - replica.to(torch.float32), row, seed)


def add_delta(replica: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The new replica: ``replica + delta`` computed in ``replica``'s dtype promoted to at least
    float32, returned in that wide dtype (the caller stores it in the parameter's dtype).

    Example::

        p.copy_(add_delta(p.reshape(-1), codec.decode(row, p.numel())).view(p.shape))
    """
    wide = torch.promote_types(replica.dtype, torch.float32)
    return replica.to(wide) + delta
