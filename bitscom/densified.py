"""``sparse_as_dense=True``: sparse gradients reduced dense, handed back sparse (Horovod's way).

Why: Horovod all-reduces ``p.grad.to_dense()`` and hands back ``aggregated.to_sparse()``, so
``SparseAdam`` (which refuses dense gradients) still steps. Why a layout round: Horovod
decides per rank, so a rank whose batch missed the embedding keeps a dense ``p.grad`` and
SparseAdam raises there only; here one MAX all-reduce of a byte per parameter, after the
step's last bucket, makes a gradient sparse on every rank when it was sparse on any.

1. passes before the completing one leave ``p.grad`` as autograd makes it (sparse stays sparse);
2. on the completing pass (or at the step's end for a gradient of an earlier pass) a sparse
   ``p.grad`` is marked and made dense, and is reduced like any dense gradient;
3. after the last bucket the marks are all-reduced (MAX): the layout round;
4. after the write-back each agreed parameter gets ``p.grad = p.grad.to_sparse()``, the same
   bits on every rank because the dense average is. Example::

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
    """One optimizer's ``sparse_as_dense=True`` state: the parameters (plan order) and which had
    a sparse gradient this step on this rank; ``device``: the buckets' (NCCL needs CUDA). Example::

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
        """Step 2 for the slots not filled on the completing pass, before ``fill_missing``."""
        for bucket in buckets:
            for p, filled in zip(bucket.params, bucket.filled):
                if not filled:
                    self.dense(p)

    def launch(self, channel) -> None:
        """Submit the layout round to the optimizer's channel; the marks start afresh."""
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
    """Step 4: ``p.grad = p.grad.to_sparse()`` for each of ``params`` with a dense ``p.grad``."""
    for p in params:
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            p.grad = grad.to_sparse()
