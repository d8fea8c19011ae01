"""The low-bit wire format (kept as an import path): quantize, pack, Hadamard, :class:`Codec`, seeds.

The code lives in :mod:`bitscom.lowbit` (``format.py``, ``codec.py``, ``hadamard.py``,
``seeds.py``); this module re-exports it so ``from bitscom.quantization import ...`` keeps
working. The format's specification is ``docs/format.md``.

Example::

    from bitscom.quantization import quantize, dequantize
    x = dequantize(quantize(torch.randn(1000), 4))
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
