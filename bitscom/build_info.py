"""Horovod's ``*_built()`` queries, answered from the torch build bitscom runs on (bitscom's
collectives are torch.distributed's), and bitscom's version."""

import torch
import torch.distributed as dist

# The version lives here, below runtime (its build fingerprint hashes it), not in __init__.
__version__ = "0.1.0"

__all__ = ["nccl_built", "gloo_built", "mpi_built", "cuda_built"]


def nccl_built() -> bool:
    """Whether torch.distributed has NCCL (collectives on CUDA tensors). Example::

        backend = "nccl" if bitscom.nccl_built() and torch.cuda.is_available() else "gloo"
    """
    return dist.is_available() and dist.is_nccl_available()


def gloo_built() -> bool:
    """Whether torch.distributed has gloo (collectives on CPU tensors)."""
    return dist.is_available() and dist.is_gloo_available()


def mpi_built() -> bool:
    """Whether torch.distributed has its MPI backend (bitscom only needs mpi4py under mpirun)."""
    return dist.is_available() and dist.is_mpi_available()


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.backends.cuda.is_built()
