"""Hadamard smoothing of gradients (SDP4Bit's TLq-HS): the library's one Hadamard transform,
:func:`bitscom.lowbit.hadamard.hadamard`, with its GEMM back end.

One matrix product per 32-element run instead of five butterfly passes (measured about 10x
faster on one CPU thread; ``docs/lowbit.md``). Bitwise agreement across ranks or devices is not
needed here: each rank rotates only its own gradient before quantizing, and only the owner
un-rotates its reduced shard; replicas stay identical because they are rebuilt from the same
all-gathered bytes.
"""

from __future__ import annotations

import torch

from ..lowbit.hadamard import HADAMARD_BLOCK, hadamard, hadamard_matrix

__all__ = ["rotate", "hadamard_matrix"]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotate every run of 32 elements of the flat float ``x`` (numel a multiple of 32); the
    transform is its own inverse. Returns a new float32 tensor (flat).

    Example::

        y = rotate(grad_bucket); torch.allclose(rotate(y), grad_bucket, atol=1e-5)   # True
    """
    return hadamard(x.reshape(-1).to(torch.float32), HADAMARD_BLOCK, backend="gemm")
