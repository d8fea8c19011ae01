"""bitscom: data-parallel PyTorch training that sends fewer bytes (re-exports only; README.md has the tour)."""

from . import checkpointing, compression, compressors, cost, diloco, fsdp, runtime
from .backend import register_lowbit_backend
from .build_info import __version__ as __version__, cuda_built, gloo_built, mpi_built, nccl_built
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .compressors import Compression
from .ddp import ddp_comm_hook
from .group import LowBitGroup
from .horovod import (Handle, allgather, allgather_async, allgather_object, allreduce,
                      allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
                      barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      grouped_allreduce, poll, sparse_allreduce, sparse_allreduce_async,
                      synchronize)
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .frozen_adam import FrozenVarianceAdamW
from .optimizer import DistributedOptimizer
from .uneven import join
from .runtime import (cross_rank, cross_size, init, inter_group, intra_group, is_initialized,
                      local_rank, local_size, rank, shutdown, size)
from .sharded import ShardedOptimizer
from .diloco import DiLoCo
from .onebit import OneBitAdam, ZeroOneAdam

runtime.use_lowbit_backend(register_lowbit_backend)   # init(bitwidth=...): runtime imports no face


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "intra_group", "inter_group",
    "DistributedOptimizer", "FrozenVarianceAdamW", "Compression", "compression", "compressors", "Average", "Sum",
    "ReduceOp",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "ddp_comm_hook", "LowBitGroup", "register_lowbit_backend", "ShardedOptimizer", "join",
    # Horovod's module-level collectives (bitscom.hvd_ops) and build queries
    "Min", "Max", "Product", "Adasum", "Handle", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "allgather", "allgather_async", "allgather_object",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "synchronize", "poll", "barrier", "sparse_allreduce", "sparse_allreduce_async",
    "fsdp", "checkpointing", "diloco", "DiLoCo", "cost", "OneBitAdam", "ZeroOneAdam",
    "nccl_built", "gloo_built", "mpi_built", "cuda_built",
]

_OLD_PATHS = ("collectives", "quantization", "error_feedback", "hvd_ops")


def __getattr__(name: str):
    """The older module paths (``bitscom.collectives``, …), imported on first use. Example::

        bitscom.collectives.LowBitConfig(bitwidth=4)
    """
    if name in _OLD_PATHS:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
