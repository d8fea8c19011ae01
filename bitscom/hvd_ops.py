"""Horovod's module-level collectives' old import path: re-exports :mod:`bitscom.horovod`. Example::

    from bitscom.hvd_ops import allreduce, synchronize
"""

from .horovod import (Handle, allgather, allgather_async, allgather_object, allreduce, allreduce_,
                      allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                      broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allreduce,
                      poll, synchronize)

__all__ = ["Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "allgather", "allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "synchronize",
           "poll", "allgather_object", "barrier"]
