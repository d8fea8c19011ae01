"""FSDP2 with bitscom compression: ``fully_shard``'s gradient reduce-scatter in low bit.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters every sharded module's
gradients in float32 (or its reduce dtype). :func:`compress` replaces that collective, through
``FSDPModule.set_custom_reduce_scatter`` (torch 2.11+), by bitscom's low-bit reduce-scatter:
the flat one (:func:`bitscom.lowbit.reduce_scatter_rounds`, optional residual error feedback
per module) or SDP4Bit's two-level one (:func:`bitscom.lowbit.levelwise_reduce_scatter_rounds`).
Under HSDP (``replicate_group=``) the replicate-dimension (inter-node) all-reduce goes through
bitscom's low-bit all-reduce with error feedback instead (:mod:`bitscom.fsdp.replicate`).
With ``weights=`` (:class:`WeightConfig`) the parameter all-gather is low bit too, through
``FSDPModule.set_custom_all_gather``: ZeRO++'s blockwise 8-bit qwZ or SDP4Bit's 4-bit weight
differences (:class:`~bitscom.fsdp.weights.LowBitAllGather`). See ``docs/fsdp.md``.

Where the code lives::

    settings.py        which LowBitConfig settings apply; the torch-hook check
    reduce_scatter.py  LowBitReduceScatter: FSDP's ReduceScatter protocol for one module
    replicate.py       ReplicateAllReduce: HSDP's replicate all-reduce (FSDP's all-reduce hook)
    weight_settings.py WeightConfig: the settings of the parameter all-gather
    weights.py         LowBitAllGather: FSDP's AllGather protocol for one module; WeightGathers
    weight_state.py    WeightState (gather count, the replica of "difference"), GatherCount
    compress.py        compress(), FSDPCompression (bytes, checkpoint), comm_stats()
    checkpoint.py      checkpoint_state(): the handle's per-rank state in dcp.save / dcp.load

Example::

    import bitscom.fsdp
    from bitscom.lowbit import LowBitConfig
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    handle = bitscom.fsdp.compress(model, gradients=LowBitConfig(bitwidth=4, error_feedback=True))
    loss.backward(); optimizer.step()
    print(bitscom.fsdp.comm_stats(model))
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
