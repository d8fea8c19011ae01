"""Buffers a compressor state reuses every step: allocating a bucket-sized buffer each step
costs a page-faulting pass over it. Never checkpointed; imports nothing of bitscom."""

from __future__ import annotations

from typing import Dict

import torch

__all__ = ["Scratch"]


class Scratch:
    """Named buffers kept between steps, reallocated only when shape, dtype or device change."""

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: Dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """The buffer ``name`` of ``shape``/``dtype`` on ``device`` (contents undefined)."""
        t = self._buffers.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != torch.device(device):
            t = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return t
