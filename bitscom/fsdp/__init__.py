"""FSDP2 with bitscom compression: low-bit reduce-scatter, HSDP all-reduce and all-gather.
See :func:`compress` and ``docs/fsdp.md``.
"""

from .checkpoint import FSDPCheckpointState, checkpoint_state
from .compress import FSDPCompression, comm_stats, compress, handle
from .reduce_scatter import ByteCount, LowBitReduceScatter, reduce_scale
from .replicate import HSDPBytes, ReplicateAllReduce, replicate_config
from .settings import gradient_config, require_hook
from .weight_settings import WeightConfig, weight_config
from .weights import LowBitAllGather, WeightGathers

__all__ = ["compress", "comm_stats", "handle", "FSDPCompression", "LowBitReduceScatter", "ByteCount", "reduce_scale",
           "gradient_config", "require_hook", "WeightConfig", "weight_config", "LowBitAllGather", "WeightGathers",
           "ReplicateAllReduce", "HSDPBytes", "replicate_config", "checkpoint_state", "FSDPCheckpointState"]
