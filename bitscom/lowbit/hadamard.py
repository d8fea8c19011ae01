"""The one Hadamard transform of bitscom (SDP4Bit's smoothing): rotating a gradient before
blockwise quantization spreads an outlier over its run, so a block's scale fits its typical
value. Two back ends, ``"butterfly"`` (the same bits on CPU and GPU) and ``"gemm"`` (faster,
BLAS-dependent last bits): which serves what, and timings, in ``docs/lowbit.md``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..kernels.format import HADAMARD_BLOCK
from ..validate import choice, instance, number

__all__ = ["HADAMARD_BLOCK", "HADAMARD_BACKENDS", "hadamard", "inverse_hadamard", "hadamard_matrix"]

#: The ways :func:`hadamard` can compute the transform (same values, see the module docstring).
HADAMARD_BACKENDS = ("butterfly", "gemm")


def check_float_tensor(x, name: str) -> None:
    """A TypeError unless ``x`` is a dense floating tensor (naming it ``name``)."""
    if instance(name, x, torch.Tensor, "a torch.Tensor").layout != torch.strided:
        raise TypeError(f"{name} must be dense (strided), got layout {x.layout}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {x.dtype}; allowed: floating dtypes (float32, float16, "
                        "bfloat16, float64)")


def _check(x, block, backend) -> None:
    check_float_tensor(x, "x")
    if number("block", block, minimum=1, integer=True) & (block - 1):
        raise ValueError(f"block must be a power of two (e.g. 32), got {block!r}")
    if x.numel() % block:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block={block} (pad it to a "
                         f"multiple of {block})")
    choice("backend", backend, HADAMARD_BACKENDS)


@lru_cache(maxsize=16)
def _matrix(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def hadamard_matrix(n: int = HADAMARD_BLOCK, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The orthonormal ``n x n`` Sylvester Hadamard matrix (symmetric, its own inverse); cached."""
    if number("n", n, minimum=1, integer=True) & (n - 1):
        raise ValueError(f"n must be a power of two, got {n!r}")
    return _matrix(n, dtype, str(torch.device(device)))


def _butterfly(v: torch.Tensor, block: int) -> torch.Tensor:
    h = 1
    while h < block:
        v = v.view(-1, block // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return v * (1.0 / math.sqrt(block))


def hadamard(x: torch.Tensor, block: int = HADAMARD_BLOCK, *, backend: str = "butterfly") -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform of each run of ``block`` (a power of two dividing
    ``x.numel()``) elements of ``x``: a new tensor of ``x``'s shape and dtype (computed in float32,
    float64 for float64); ``backend`` is one of :data:`HADAMARD_BACKENDS`.

    Example::

        y = hadamard(torch.randn(64))          # two runs of 32, each rotated
    """
    _check(x, block, backend)
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    v = x.reshape(-1, block).to(dt)
    v = v @ hadamard_matrix(block, dt, x.device) if backend == "gemm" else _butterfly(v, block)
    return v.reshape(x.shape).to(x.dtype)


def inverse_hadamard(x: torch.Tensor, block: int = HADAMARD_BLOCK, *, backend: str = "butterfly") -> torch.Tensor:
    """Inverse of :func:`hadamard` (the same transform: H is symmetric and orthonormal)."""
    return hadamard(x, block, backend=backend)
