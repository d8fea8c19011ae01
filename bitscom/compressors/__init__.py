"""Gradient compressors, one algorithm family per module, and the registry.

``bitscom.compressors.get(name, **settings)`` builds one by name; the classes are also
importable directly (``bitscom.compressors.FP16Compressor``).
"""

from .base import BucketLayout, Comm, Compressor, State, TensorSlot, drive
from .casting import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .registry import get, names, register

register("none", NoneCompressor)
register("fp16", FP16Compressor)
register("bf16", BF16Compressor)
from .topk import TopK  # noqa: E402
from .signsgd import SignSGD  # noqa: E402
register("topk", TopK)
register("signsgd", SignSGD)
from .powersgd import PowerSGD  # noqa: E402
from .acpsgd import ACPSGD  # noqa: E402
register("powersgd", PowerSGD)
register("acpsgd", ACPSGD)
from .lowbit import LowBit  # noqa: E402
register("lowbit", LowBit)

__all__ = [
    "BucketLayout", "Comm", "Compressor", "State", "TensorSlot", "drive",
    "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression",
    "get", "names", "register",
    "PowerSGD", "ACPSGD",
]
