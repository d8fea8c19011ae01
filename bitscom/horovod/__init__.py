"""The Horovod compatibility face: ``import bitscom as hvd`` keeps ``horovod.torch`` code working
(the modules and every deliberate difference from Horovod: docs/horovod.md)."""

from .allgather import allgather, allgather_async
from .allreduce import allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce
from .alltoall import alltoall, alltoall_async
from .broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from .codec import HorovodCodec, HorovodCompressor
from .groups import require_group
from .handles import Handle, poll, synchronize
from .objects import allgather_object, barrier
from .sparse import SparseHandle, sparse_allreduce, sparse_allreduce_async

__all__ = ["Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "synchronize", "poll", "allgather_object", "barrier", "HorovodCodec", "HorovodCompressor",
           "require_group", "SparseHandle", "sparse_allreduce", "sparse_allreduce_async"]
