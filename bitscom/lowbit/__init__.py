"""The low-bit algorithm of bitscom, in one package.

Where the code lives (imports flow downward, nothing here imports a face)::

    config.py          LowBitConfig: the settings of every low-bit face (frozen, validated)
    state.py           LowBitState: step counter, residuals, EF21 estimates (checkpointable)
    error_feedback.py  ErrorFeedback: the one residual-feedback piece every lossy compressor uses
    rounds.py          building blocks of the round generators (all-to-all stage, level ladder,
                       pipeline, padding)
    call_header.py     the call header LowBitGroup and the lowbit backend check before each call
    all_reduce.py      all_reduce_rounds: flat, "leader" and "two_level" hierarchies
    scatter_gather.py  reduce_scatter_rounds, all_gather_rounds
    levelwise.py       the level-wise reduce-scatter (SDP4Bit's gradient rounds: intra then inter)
    format.py          the wire format: quantize / dequantize, pack / unpack, signs
    codec.py           Codec: one stage's byte row (low-bit payload + scales, or float32)
    hadamard.py        the one Hadamard transform (butterfly and GEMM back ends)
    seeds.py           mix_seed, the one seed mixer; stage_seed, key_id

The hot loops (quantize-pack, unpack-dequantize, fused reduce) are :mod:`bitscom.kernels`.
The older module paths ``bitscom.collectives``, ``bitscom.quantization`` and
``bitscom.error_feedback`` re-export these names unchanged.

Example::

    from bitscom.lowbit import LowBitConfig, LowBitState, all_reduce_rounds
    from bitscom.comm import Comm, drive
    drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(bitwidth=4), LowBitState()))
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
