"""bitscom: data-parallel PyTorch training that sends fewer bytes.

The public face: re-exports only. See README.md for the tour.
"""

from . import compressors
from .backend import register_lowbit_backend
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .compressors import Compression
from .ddp import ddp_comm_hook
from .group import LowBitGroup
from .ops import Average, ReduceOp, Sum
from .optimizer import DistributedOptimizer
from .uneven import join
from .runtime import (cross_rank, cross_size, init, inter_group, intra_group, is_initialized,
                      local_rank, local_size, rank, shutdown, size)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "intra_group", "inter_group",
    "DistributedOptimizer", "Compression", "compressors", "Average", "Sum", "ReduceOp",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "ddp_comm_hook", "LowBitGroup", "register_lowbit_backend", "join",
]
