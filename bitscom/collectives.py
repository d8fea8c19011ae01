"""Low-bit collectives' old import path: re-exports :mod:`bitscom.lowbit`. Example::

    drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(bitwidth=4), LowBitState()))
"""

from .lowbit.all_reduce import all_reduce_rounds, wire_bytes_all_reduce
from .lowbit.codec import Codec
from .lowbit.config import (ALIASES, BACKEND_OPS, DEFAULT_STAGE2_BITS, EF_MODE_ALIASES, EF_MODES, FULL_PRECISION,
                            HIERARCHIES, LowBitConfig)
from .lowbit.levelwise import levelwise_chunks, levelwise_reduce_scatter_rounds, levelwise_wire_bytes
from .lowbit.rounds import pipeline
from .lowbit.scatter_gather import all_gather_rounds, reduce_scatter_rounds
from .lowbit.seeds import key_id, stage_seed
from .lowbit.state import LowBitState

__all__ = ["FULL_PRECISION", "EF_MODES", "EF_MODE_ALIASES", "HIERARCHIES", "BACKEND_OPS", "ALIASES",
           "DEFAULT_STAGE2_BITS", "LowBitConfig", "LowBitState", "Codec", "all_reduce_rounds",
           "reduce_scatter_rounds", "all_gather_rounds", "pipeline", "stage_seed", "key_id",
           "wire_bytes_all_reduce", "levelwise_chunks", "levelwise_reduce_scatter_rounds",
           "levelwise_wire_bytes"]
