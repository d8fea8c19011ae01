"""Gradient compressors, one algorithm family per module, and the registry: ``bitscom.compressors.get(name,
**settings)`` builds one by name, or import the class (``bitscom.compressors.ACPSGD(rank=4)``).
"""

from .acpsgd import ACPSGD
from .base import BucketLayout, Comm, Compressor, State, TensorSlot, drive
from .casting import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .error_feedback import ErrorFeedback
from .exclude import Exclude
from .lowbit import LowBit
from .momentum import MomentumCorrection
from .powersgd import PowerSGD
from .registry import get, names, register, resolve
from .signsgd import SignSGD
from .topk import TopK
from .warmup import WarmUp

for _cls in (NoneCompressor, FP16Compressor, BF16Compressor, LowBit, PowerSGD, ACPSGD, TopK, SignSGD, Exclude,
             MomentumCorrection):
    register(_cls.name, _cls)       # "none", "fp16", ..., "exclude", "dgc"

__all__ = [
    "BucketLayout", "Comm", "Compressor", "State", "TensorSlot", "drive", "ErrorFeedback",
    "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
    "LowBit", "PowerSGD", "ACPSGD", "TopK", "SignSGD", "Exclude", "MomentumCorrection", "WarmUp",
    "get", "names", "register", "resolve",
]
