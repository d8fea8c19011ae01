"""Reduction ops (Horovod's ``hvd.Average`` / ``hvd.Sum`` / ``hvd.Min`` / ...).

The distributed optimizer accepts ``Average`` and ``Sum``; the module-level tensor
collectives (:mod:`bitscom.hvd_ops`) accept every op but ``Adasum``, which bitscom does not
implement: it exists so Horovod scripts that mention it get a clear error where it is used,
not an ``AttributeError`` at import.
"""

import enum

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum"]


class ReduceOp(enum.Enum):
    """How tensors of the ranks are combined.

    Example::

        opt = bitscom.DistributedOptimizer(opt, op=bitscom.Sum)
        biggest = bitscom.allreduce(torch.tensor([loss]), op=bitscom.Max)
    """

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM
