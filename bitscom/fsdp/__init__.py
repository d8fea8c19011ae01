"""FSDP2 with bitscom compression: ``fully_shard``'s gradient reduce-scatter in low bit
(``FSDPModule.set_custom_reduce_scatter``), HSDP's replicate all-reduce in low bit
(:mod:`.replicate`) and, with ``weights=``, the parameter all-gather too (:mod:`.weights`).
See :func:`compress` and ``docs/fsdp.md``.
"""

from .checkpoint import FSDPCheckpointState, checkpoint_state
from .compress import FSDPCompression, comm_stats, compress, handle
from .reduce_scatter import ByteCount, LowBitReduceScatter, reduce_scale
from .replicate import HSDPBytes, ReplicateAllReduce, replicate_config
from .settings import gradient_config, require_hook
from .weight_settings import WeightConfig, weight_config
from .weights import LowBitAllGather, WeightGathers

__all__ = ["compress", "comm_stats", "handle", "FSDPCompression", "LowBitReduceScatter", "ByteCount",
           "reduce_scale", "gradient_config", "require_hook", "WeightConfig", "weight_config", "LowBitAllGather",
           "WeightGathers", "ReplicateAllReduce", "HSDPBytes", "replicate_config", "checkpoint_state",
           "FSDPCheckpointState"]
