"""1-bit Adam and 0/1 Adam: Adam-family optimizers that own their (1-bit) communication.
See :class:`OneBitAdam`, :class:`ZeroOneAdam` and ``docs/onebit.md``."""

from .adam import OneBitAdam
from .config import OneBitConfig, ZeroOneConfig, momentum_codec
from .zero_one import ZeroOneAdam

__all__ = ["OneBitAdam", "ZeroOneAdam", "OneBitConfig", "ZeroOneConfig", "momentum_codec"]
