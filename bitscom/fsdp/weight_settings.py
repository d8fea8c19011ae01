"""What ``bitscom.fsdp.compress(weights=...)`` accepts: the settings of the parameter all-gather."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..kernels.format import check_block_size
from ..lowbit.codec import Codec
from ..lowbit.format import SUPPORTED_BITS
from ..lowbit.weight_delta import delta_codec
from ..validate import choice, instance, number

__all__ = ["WeightConfig", "weight_config", "WEIGHT_MODES"]

WEIGHT_MODES = ("blockwise", "difference")
_DEFAULTS = {"blockwise": (8, 128), "difference": (4, 2048)}   # (bitwidth, block_size) per mode


@dataclass(frozen=True)
class WeightConfig:
    """Settings of the low-bit FSDP2 parameter all-gather: ``"blockwise"`` (ZeRO++'s qwZ,
    stateless) or ``"difference"`` (SDP4Bit's qWD against the kept replica; the first gather
    is exact). Small shards and non-floating parameters travel exactly.

    Attributes:
        mode: ``"blockwise"`` (qwZ, default) or ``"difference"`` (SDP4Bit qWD).
        bitwidth: bits per element (1, 2, 4, 8, 12, 16); default 8 (blockwise) or 4 (difference).
        block_size: elements per bfloat16 scale (power of two, 32..65536); default 128 or 2048.
        min_numel: a parameter whose per-rank shard has fewer elements is sent exactly.
        seed: the stochastic-rounding seed of ``"difference"``.

    Example::

        bitscom.fsdp.compress(model, weights=WeightConfig(mode="difference"))
    """

    mode: str = "blockwise"
    bitwidth: Optional[int] = None
    block_size: Optional[int] = None
    min_numel: int = 1024
    seed: int = 0

    def __post_init__(self):
        choice("WeightConfig mode", self.mode, WEIGHT_MODES)
        bits, block = _DEFAULTS[self.mode]
        object.__setattr__(self, "bitwidth", bits if self.bitwidth is None else self.bitwidth)
        object.__setattr__(self, "block_size", block if self.block_size is None else self.block_size)
        choice("WeightConfig bitwidth", self.bitwidth, SUPPORTED_BITS)
        check_block_size(self.block_size, "WeightConfig block_size")
        number("WeightConfig min_numel", self.min_numel, minimum=0, integer=True)
        number("WeightConfig seed", self.seed, minimum=0, integer=True)

    @property
    def difference(self) -> bool:
        """Whether the all-gather sends differences against the kept copy (SDP4Bit qWD)."""
        return self.mode == "difference"

    def codec(self) -> Codec:
        """The byte format of a quantized shard: round to nearest, or SDP4Bit's difference codec."""
        bits, block = self.bitwidth, self.block_size
        assert bits is not None and block is not None      # resolved in __post_init__
        return delta_codec(bits, block) if self.difference else Codec(bits, block)


def weight_config(weights) -> WeightConfig:
    """``weights`` itself, or ``WeightConfig(bitwidth=weights)`` (blockwise) for an int; any
    other type is a ``TypeError``.

    Example::

        weight_config(8) == WeightConfig()    # True
    """
    if isinstance(weights, int) and not isinstance(weights, bool):
        return WeightConfig(bitwidth=weights)
    return instance("weights", weights, WeightConfig,
                    f"a bitscom.fsdp.WeightConfig or an int bit width, one of {tuple(SUPPORTED_BITS)}")
