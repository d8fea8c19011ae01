"""Mutable, checkpointable state of one stream of low-bit reductions (:class:`LowBitState`)."""

from __future__ import annotations

import torch

from ..scratch import Scratch
from .error_feedback import ErrorFeedback

__all__ = ["LowBitState"]


class LowBitState:
    """Mutable state of one stream of reductions (one bucket, or one user key): ``step`` (advanced
    once per reduction, keys the seeds), the :class:`~bitscom.lowbit.error_feedback.ErrorFeedback`
    residuals ``residual`` and ``stage2_residual``, the EF21 estimates ``local_estimate`` (g_i)
    and ``global_estimate`` (g); tensors are made on first use (rotated when ``hadamard`` is on)."""

    _ESTIMATES = ("local_estimate", "global_estimate", "global_shard")

    def __init__(self):
        self.step = 0
        self.numel = None
        self.residual = ErrorFeedback.lazy()
        self.stage2_residual = ErrorFeedback.lazy()
        self.local_estimate = None
        self.global_estimate = None
        self.global_shard = None    # ef21: this rank's exact shard of g (it owns that shard)
        self._scratch = Scratch()   # buffers reused every step (not checkpointed)

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer kept between steps (contents undefined): a fresh one would page-fault each step."""
        return self._scratch.get(name, shape, dtype, device)

    def estimate(self, name: str, numel: int, device) -> torch.Tensor:
        """The EF21 estimate ``name`` (zeros on first use)."""
        t = getattr(self, name)
        if t is None or t.numel() != numel or t.device != torch.device(device):
            t = torch.zeros(numel, dtype=torch.float32, device=device)
            setattr(self, name, t)
        return t

    def bind(self, numel: int) -> None:
        """Tie this state to tensors of ``numel`` elements (a different size is an error)."""
        if self.numel is not None and self.numel != numel:
            raise ValueError(f"this low-bit state was used for tensors of {self.numel} elements and "
                             f"now gets {numel}; use a different key per tensor")
        self.numel = numel

    def state_dict(self) -> dict:
        out = {"step": self.step, "numel": self.numel, "residual": self.residual.state_dict(),
               "stage2_residual": self.stage2_residual.state_dict()}
        for name in self._ESTIMATES:
            t = getattr(self, name)
            out[name] = None if t is None else t.detach().clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.numel = state.get("numel")
        for name in ("residual", "stage2_residual"):
            ef = ErrorFeedback.lazy()
            ef.load_state_dict(state[name])
            setattr(self, name, ef)
        for name in self._ESTIMATES:
            t = state.get(name)
            setattr(self, name, None if t is None else t.detach().clone().to(torch.float32))
