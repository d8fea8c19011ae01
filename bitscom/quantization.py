"""The low-bit wire format's old import path: re-exports :mod:`bitscom.lowbit` (docs/format.md). Example::

    x = bitscom.quantization.dequantize(bitscom.quantization.quantize(torch.randn(1000), 4))
"""

from .lowbit.codec import Codec
from .lowbit.format import (FULL_PRECISION, HADAMARD_BLOCK, SUPPORTED_BITS, Quantized, bits_per_element,
                            dequantize, dequantize_tensor, pack, pack_signs, quantize, quantize_tensor,
                            unpack, unpack_signs, wire_bytes)
from .lowbit.hadamard import hadamard, hadamard_matrix, inverse_hadamard
from .lowbit.seeds import key_id, mix_seed, stage_seed

__all__ = ["SUPPORTED_BITS", "FULL_PRECISION", "Quantized", "quantize", "dequantize", "quantize_tensor",
           "mix_seed", "dequantize_tensor", "pack", "unpack", "pack_signs", "unpack_signs", "hadamard",
           "inverse_hadamard", "hadamard_matrix", "wire_bytes", "bits_per_element", "HADAMARD_BLOCK", "Codec",
           "stage_seed", "key_id"]
