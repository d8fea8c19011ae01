"""The one Hadamard transform of bitscom (SDP4Bit's smoothing), with two back ends.

An orthonormal fast Walsh–Hadamard transform of every consecutive run of ``block`` elements
(natural / Sylvester order). It is symmetric and its own inverse. Rotating a gradient before
blockwise quantization spreads an outlier over its run, so a block's scale fits its typical
value; sums are taken in the rotated domain and the inverse is applied once at the end.

Two back ends compute the same transform:

* ``"butterfly"`` (default): log2(block) passes of elementwise adds. It gives the same bits on
  CPU and GPU, so it is what the low-bit collectives use (their replicas compare bytes).
* ``"gemm"``: one matrix product ``x.view(-1, block) @ H``. Measured about 10x faster on one CPU
  thread (1M float32: 12.9 ms butterfly, 1.2 ms GEMM; ``docs/lowbit.md``); its last bits depend
  on the BLAS, which is fine where only one rank rotates a tensor and the others receive bytes
  (the sharded optimizer's gradient reduce-scatter).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..kernels.format import HADAMARD_BLOCK

__all__ = ["HADAMARD_BLOCK", "HADAMARD_BACKENDS", "hadamard", "inverse_hadamard", "hadamard_matrix"]

HADAMARD_BACKENDS = ("butterfly", "gemm")
"""The ways :func:`hadamard` can compute the transform (same values, see the module docstring)."""


def _check(x, block, backend) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"x must be dense (strided), got layout {x.layout}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x has dtype {x.dtype}; allowed: floating dtypes (float32, float16, "
                        "bfloat16, float64)")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block={block!r} must be a power of two (e.g. 32)")
    if x.numel() % block:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block={block} (pad it to a "
                         f"multiple of {block})")
    if backend not in HADAMARD_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {HADAMARD_BACKENDS}")


@lru_cache(maxsize=16)
def _matrix(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def hadamard_matrix(n: int = HADAMARD_BLOCK, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The orthonormal ``n x n`` Sylvester Hadamard matrix (symmetric, its own inverse); cached.

    Example::

        H = hadamard_matrix(32); torch.allclose(H @ H, torch.eye(32), atol=1e-6)   # True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n={n!r} must be a power of two")
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
    """Orthonormal Walsh–Hadamard transform of each consecutive run of ``block`` elements of ``x``.

    ``x.numel()`` must be a multiple of ``block`` (a power of two); shape and dtype are kept
    (computed in float32 for 16-bit inputs, float64 for float64). Returns a new tensor.
    ``backend`` picks the computation (:data:`HADAMARD_BACKENDS`; see the module docstring).

    Example::

        >>> x = torch.randn(64)
        >>> torch.allclose(inverse_hadamard(hadamard(x)), x, atol=1e-6)
        True
    """
    _check(x, block, backend)
    dt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    v = x.reshape(-1, block).to(dt)
    if backend == "gemm":
        v = v @ hadamard_matrix(block, dt, x.device)
    else:
        v = _butterfly(v, block)
    return v.reshape(x.shape).to(x.dtype)


def inverse_hadamard(x: torch.Tensor, block: int = HADAMARD_BLOCK, *, backend: str = "butterfly") -> torch.Tensor:
    """Inverse of :func:`hadamard` (the same transform: H is symmetric and orthonormal).

    Example::

        >>> x = torch.randn(32)
        >>> torch.allclose(hadamard(inverse_hadamard(x)), x, atol=1e-6)
        True
    """
    return hadamard(x, block, backend=backend)
