"""The low-bit algorithm of bitscom, in one package (imports flow downward; nothing here imports a face). Which file
holds what: ``docs/lowbit.md``, "Where the code lives"; the hot loops are :mod:`bitscom.kernels`.
``bitscom.collectives``, ``bitscom.quantization`` and ``bitscom.error_feedback`` re-export these names unchanged.
"""

from .all_reduce import all_reduce_rounds, wire_bytes_all_reduce
from .codec import Codec
from .config import (ALIASES, BACKEND_OPS, DEFAULT_STAGE2_BITS, EF_MODE_ALIASES, EF_MODES, FULL_PRECISION,
                     HIERARCHIES, LowBitConfig, canonical_ef_mode, canonical_fingerprint)
from .error_feedback import ErrorFeedback, SteppedErrorFeedback
from .format import (HADAMARD_BLOCK, SUPPORTED_BITS, Quantized, bits_per_element, dequantize,
                     dequantize_tensor, pack, pack_signs, quantize, quantize_tensor, unpack,
                     unpack_signs, wire_bytes)
from .hadamard import HADAMARD_BACKENDS, hadamard, hadamard_matrix, inverse_hadamard
from .levelwise import (default_order, levelwise_chunks, levelwise_reduce_scatter_rounds,
                        levelwise_wire_bytes)
from .rounds import pipeline
from .scatter_gather import all_gather_rounds, reduce_scatter_rounds
from .seeds import key_id, mix_seed, stage_seed
from .state import LowBitState

__all__ = [
    "LowBitConfig", "LowBitState", "EF_MODES", "EF_MODE_ALIASES", "HIERARCHIES", "BACKEND_OPS", "ALIASES",
    "DEFAULT_STAGE2_BITS", "FULL_PRECISION", "canonical_ef_mode", "canonical_fingerprint",
    "ErrorFeedback", "SteppedErrorFeedback",
    "all_reduce_rounds", "reduce_scatter_rounds", "all_gather_rounds", "pipeline",
    "wire_bytes_all_reduce",
    "levelwise_chunks", "levelwise_reduce_scatter_rounds", "levelwise_wire_bytes", "default_order",
    "Codec", "Quantized", "quantize", "dequantize", "quantize_tensor", "dequantize_tensor", "pack", "unpack",
    "pack_signs", "unpack_signs", "wire_bytes", "bits_per_element", "SUPPORTED_BITS", "HADAMARD_BLOCK",
    "hadamard", "inverse_hadamard", "hadamard_matrix", "HADAMARD_BACKENDS",
    "mix_seed", "stage_seed", "key_id",
]
