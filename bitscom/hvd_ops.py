"""Old home of Horovod's module-level collectives; they live in :mod:`bitscom.horovod` now.

A thin re-export so ``bitscom.hvd_ops.X`` keeps importing.

Example::

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
