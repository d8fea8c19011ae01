"""SDP4Bit's quantized weight differences (qWD), the one codec both sharded faces use: the owner
sends ``Q(new - replica)`` and every rank adds the same decoded bytes to its replica, so replicas
stay bitwise identical and within one gather's error of the exact values (``docs/sharded.md``).
"""

from __future__ import annotations

import torch

from .codec import Codec

__all__ = ["delta_codec", "encode_delta", "add_delta"]


def delta_codec(bits: int, group_size: int) -> Codec:
    """The codec of the weight differences: stochastic rounding (unbiased, so they do not drift)."""
    return Codec(bits, group_size, stochastic=True)


def encode_delta(codec: Codec, new: torch.Tensor, replica: torch.Tensor, row: torch.Tensor, seed: int) -> None:
    """Write ``Q(new - replica)`` (flat, any float dtype; subtracted in float32) into ``row``."""
    codec.encode(new.to(torch.float32) - replica.to(torch.float32), row, seed)


def add_delta(replica: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``replica + delta`` in ``replica``'s dtype promoted to at least float32 (returned so)."""
    wide = torch.promote_types(replica.dtype, torch.float32)
    return replica.to(wide) + delta
