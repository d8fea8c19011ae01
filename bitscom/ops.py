"""Reduction ops of the distributed optimizer (Horovod's ``hvd.Average`` / ``hvd.Sum``)."""

import enum

__all__ = ["ReduceOp", "Average", "Sum"]


class ReduceOp(enum.Enum):
    """How gradients of the ranks are combined: their average (the default) or their sum.

    Example::

        opt = bitscom.DistributedOptimizer(opt, op=bitscom.Sum)
    """

    AVERAGE = "average"
    SUM = "sum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
