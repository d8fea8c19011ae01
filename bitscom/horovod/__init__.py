"""The Horovod compatibility face: ``import bitscom as hvd`` keeps ``horovod.torch`` code working.

Layout (imports flow downward: collectives → handles / negotiation → groups / failures, all
on :mod:`bitscom.comm` and :mod:`bitscom.runtime`):

* :mod:`.allreduce`, :mod:`.allgather`, :mod:`.broadcast`, :mod:`.alltoall`: the tensor
  collectives with their in-place and ``_async`` forms and their autograd functions;
* :mod:`.objects`: ``allgather_object``, ``barrier`` and the object broadcast;
* :mod:`.sparse`: ``sparse_allreduce(_async)`` (all-gathered indices and values, coalesced)
  and DistributedOptimizer's sparse-gradient path;
* :mod:`.handles`: :class:`Handle`, :func:`synchronize`, :func:`poll` — handles wrap the one
  round driver, :class:`bitscom.comm.Rounds`, and finish in call order;
* :mod:`.negotiation`: the header all-gather that checks every rank makes the same call;
* :mod:`.groups`: the group a call uses (a clear error before ``bitscom.init()`` under a
  multi-process launcher) and each call's comm on its group's channel
  (:func:`bitscom.runtime.channel`, whose later group carries the payloads);
* :mod:`.failures`: a failed collective names the bitscom call and the likely cause;
* :mod:`.codec`: :class:`HorovodCodec`, published as ``bitscom.compression.Compressor``.

Deliberate differences from Horovod: ``process_group=`` (a torch ProcessGroup) replaces
``process_set=`` (which raises); ``root_rank`` is a global rank; integer ``Average`` divides
with truncation toward zero; ``Adasum`` raises ``NotImplementedError``.

Example::

    import bitscom as hvd
    hvd.init()
    avg = hvd.synchronize(hvd.allreduce_async(torch.tensor([loss]), name="loss"))
"""

from .allgather import allgather, allgather_async
from .allreduce import allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce
from .alltoall import alltoall, alltoall_async
from .broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from .codec import HorovodCodec, HorovodCompressor
from .groups import require_group
from .handles import Handle, poll, synchronize
from .objects import allgather_object, barrier
from .sparse import SparseHandle, sparse_allreduce, sparse_allreduce_async

__all__ = ["Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "allgather", "allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "synchronize",
           "poll", "allgather_object", "barrier", "HorovodCodec", "HorovodCompressor",
           "require_group", "SparseHandle", "sparse_allreduce", "sparse_allreduce_async"]
