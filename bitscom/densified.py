"""``sparse_as_dense=True``: sparse gradients reduced dense, handed back sparse (Horovod's way).

Why. Horovod's ``DistributedOptimizer(sparse_as_dense=True)`` all-reduces ``p.grad.to_dense()``
and, before the step, puts ``aggregated.to_sparse()`` back into the (sparse) ``p.grad``
(horovod/torch/optimizer.py), so ``torch.optim.SparseAdam`` — which refuses dense gradients —
still steps, and the dense all-reduce (here: the compressed buckets) carries the embedding.

Why a layout round. Horovod decides per rank: a rank whose batch did not touch the embedding
has no gradient, sends zeros and keeps a *dense* ``p.grad``, so SparseAdam raises on that rank
only, and the replicas would step differently. Here the ranks agree each step: one all-reduce
(MAX) of one byte per trainable parameter, on the optimizer's channel right after the step's
last bucket, and a gradient is handed back sparse on every rank when it was sparse on any.

The steps (:class:`DensifiedGradients` holds one optimizer's part of them):

1. backward passes before the completing one leave ``p.grad`` as autograd makes it (sparse
   plus sparse stays sparse), as Horovod does;
2. on the completing pass, and at the step's end for a parameter whose gradient came only in
   an earlier pass, a sparse ``p.grad`` is marked and replaced by its dense form, which fills
   the parameter's bucket slot and is reduced (compressed) like any dense gradient;
3. after the last bucket the marks are all-reduced (MAX): the layout round;
4. after the reduced average was written back into ``p.grad``, each agreed parameter gets
   ``p.grad = p.grad.to_sparse()``: coalesced, ``sparse_dim == p.dim()``, the entries whose
   average is not exactly zero — Horovod's ``to_sparse()``; the same bits on every rank,
   because the dense average is.

Example::

    dense = DensifiedGradients(params, device)
    grad = dense.dense(p)                     # in the hook, on the completing pass
    dense.launch(channel)                     # after the step's last bucket
    params_back, sent = dense.wait(channel)   # after the buckets finished
    ...                                       # write the reduced buckets back into p.grad
    hand_back_sparse(params_back)
"""

from __future__ import annotations

from typing import Any, Generator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from .comm import Comm, Rounds

__all__ = ["DensifiedGradients", "hand_back_sparse"]


def _layout_round(comm: Comm, marks: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    """Round: every rank's marks, MAX-reduced in place (1 where any rank's gradient was sparse)."""
    yield comm.all_reduce(marks, dist.ReduceOp.MAX)
    return marks


class DensifiedGradients:
    """One optimizer's ``sparse_as_dense=True`` state: the parameters (plan order, the same on
    every rank) and which of them had a sparse gradient this step on this rank.

    ``device``: where the one-byte-per-parameter marks travel (the buckets' device: NCCL needs
    CUDA tensors).

    Example::

        dense = DensifiedGradients([p for _, p in trainable], torch.device("cpu"))
    """

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device):
        self.params = list(params)
        self.device = device
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._marked: Set[int] = set()
        self._work: Optional[Rounds] = None

    def dense(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """``p.grad``, made dense in place (``p.grad`` is replaced) and marked when sparse."""
        grad = p.grad
        if grad is not None and grad.is_sparse:
            self._marked.add(self._index[id(p)])
            grad = p.grad = grad.to_dense()
        return grad

    def dense_missing(self, buckets: Sequence[Any]) -> None:
        """Step 2 for the slots not filled on the completing pass (their gradient, if any,
        came in an earlier pass and may still be sparse): before ``fill_missing`` copies it."""
        for bucket in buckets:
            for p, filled in zip(bucket.params, bucket.filled):
                if not filled:
                    self.dense(p)

    def launch(self, channel) -> None:
        """Submit the layout round to the optimizer's channel (after the step's last bucket,
        so every rank issues it at the same place among its collectives); the marks start
        afresh for the next step."""
        marks = torch.zeros(len(self.params), dtype=torch.uint8, device=self.device)
        if self._marked:
            marks[sorted(self._marked)] = 1
        self._marked = set()
        comm = channel.comm()
        self._work = channel.submit(Rounds(_layout_round(comm, marks), [comm], total=1))

    def wait(self, channel) -> Tuple[List[torch.Tensor], int]:
        """Finish the layout round: (the parameters to hand back sparse, bytes it sent)."""
        work, self._work = self._work, None
        if work is None:
            raise RuntimeError("DensifiedGradients.wait() without launch(): the layout round "
                               "was not submitted this step")
        channel.wait(work)
        marks = work.result
        assert isinstance(marks, torch.Tensor), "the layout round returns the reduced marks"
        agreed = marks.tolist()
        return [p for p, sparse in zip(self.params, agreed) if sparse], work.bytes_sent

    def forget(self, channel) -> None:
        """Drop this step's marks and an unfinished layout round (a step abandoned or failed)."""
        self._marked = set()
        work, self._work = self._work, None
        if work is not None and not work.done:
            channel.abort([work])


def hand_back_sparse(params: Sequence[torch.Tensor]) -> None:
    """Step 4: ``p.grad = p.grad.to_sparse()`` for each of ``params`` (Horovod's
    ``aggregated.to_sparse()``); a parameter without a dense ``p.grad`` is left alone."""
    for p in params:
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            p.grad = grad.to_sparse()
