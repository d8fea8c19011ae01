"""Reduction ops (Horovod's ``hvd.Average`` / ``hvd.Sum`` / ...). ``Adasum`` is not implemented:
it exists so Horovod scripts that mention it get a clear error where it is used, not at import."""

import enum

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum"]


class ReduceOp(enum.Enum):
    """How tensors of the ranks are combined. Example::

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
