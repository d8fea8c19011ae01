"""``sparse_as_dense=True``: sparse gradients reduced dense, handed back sparse (Horovod's way,
so ``SparseAdam`` steps). Horovod decides per rank, so SparseAdam raises on a rank whose batch
missed the embedding; here a layout round makes the ranks agree (docs/design.md)."""

from __future__ import annotations

from typing import Any, Generator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from .comm import Comm, Rounds

__all__ = ["DensifiedGradients", "hand_back_sparse"]


def _layout_round(comm: Comm, marks: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    yield comm.all_reduce(marks, dist.ReduceOp.MAX)
    return marks


class DensifiedGradients:
    """One optimizer's parameters and which had a sparse gradient this step on this rank."""

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
        return [p for p, sparse in zip(self.params, marks.tolist()) if sparse], work.bytes_sent

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
