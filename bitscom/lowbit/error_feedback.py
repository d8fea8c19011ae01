"""Error feedback: the one residual every lossy compressor and the low-bit collectives share.

Why: a biased compressor C loses part of every gradient; error feedback (Seide et al. 2014; Karimireddy et al.
2019) keeps it in a residual ``e`` for the next step, so it is only delayed and biased compressors converge like
SGD. Per bucket and step:

1. ``x = g + e`` (:meth:`ErrorFeedback.compensate`; the residual buffer *is* ``x``: do not modify it in place)
2. send ``C(x)`` (the compressor's business)
3. ``e = x − D(C(x))`` (:meth:`~ErrorFeedback.update` dense, :meth:`~ErrorFeedback.update_sparse` sparse)

The residual is fp32 whatever the gradient dtype, so fp16/bf16 gradients keep their small leftovers. EF21
(sending ``C(∇f_i − g_i)``) is a different algorithm, not this class.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

from ..scratch import Scratch

__all__ = ["ErrorFeedback", "SteppedErrorFeedback"]

_EF = TypeVar("_EF", bound="ErrorFeedback")


class ErrorFeedback:
    """The residual ``e`` of one flat buffer of ``numel`` elements on ``device`` (one bucket, or
    one tensor of it). ``enabled=False`` makes :meth:`compensate` return the gradient and the
    updates no-ops, so a compressor is written once for both settings.

    Example::

        ef = ErrorFeedback.for_layout(layout)
        x = ef.compensate(flat)            # g + e, fp32; do not modify in place
        values, idx = select(x)            # C(x)
        ef.update_sparse(idx, values)      # e = x - D(C(x))
    """

    def __init__(self, numel: int, device=None, enabled: bool = True):
        self._scratch = Scratch()       # a compressor's per-step buffers (not checkpointed)
        self.enabled = bool(enabled)
        self.residual: Optional[torch.Tensor] = (
            torch.zeros(int(numel), dtype=torch.float32, device=device) if enabled else None)

    @classmethod
    def for_layout(cls: type[_EF], layout, enabled: bool = True) -> _EF:
        """A zero residual shaped like ``layout``'s flat buffer."""
        return cls(layout.numel, layout.device, enabled)

    @classmethod
    def lazy(cls: type[_EF]) -> _EF:
        """An enabled residual whose buffer the first :meth:`compensate` makes (zeros)."""
        return cls.over(None)

    @classmethod
    def over(cls: type[_EF], residual: Optional[torch.Tensor]) -> _EF:
        """Error feedback whose residual *is* ``residual`` (e.g. one chunk's view of a larger one)."""
        ef = cls(0, enabled=True)
        ef.residual = residual
        return ef

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer the compressor owning this state reuses every step (contents undefined)."""
        return self._scratch.get(name, shape, dtype, device)

    def ensure(self, numel: int, device) -> torch.Tensor:
        """The residual buffer, made (zeros) if absent or of another size/device; returns it."""
        r = self.residual
        if r is None or r.numel() != numel or r.device != torch.device(device):
            r = self.residual = torch.zeros(int(numel), dtype=torch.float32, device=device)
        return r

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """``x = grad + e`` in fp32 (the residual buffer itself); disabled: ``grad`` as fp32."""
        if not self.enabled:
            return grad if grad.dtype == torch.float32 else grad.float()
        if self.residual is None:
            self.residual = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        if grad.numel() != self.residual.numel():
            raise RuntimeError(f"error-feedback residual has {self.residual.numel()} elements, the "
                               f"gradient {grad.numel()}; the bucket layout changed without a new state")
        return self.residual.add_(grad.reshape(-1))

    def update(self, decoded: torch.Tensor) -> None:
        """``e = x − decoded`` where ``decoded = D(C(x))`` is dense, shaped like ``x``."""
        if self.enabled:
            self._compensated("update").sub_(decoded.reshape(-1))

    def drop_nonfinite(self) -> None:
        """Zero the NaN/Inf entries: a step AMP skips must not poison every later step."""
        if self.enabled and self.residual is not None:
            torch.nan_to_num_(self.residual, nan=0.0, posinf=0.0, neginf=0.0)

    def update_sparse(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``e = x − D(C(x))`` for ``D(C(x))`` = ``values`` at the unique ``indices``, 0 elsewhere."""
        if self.enabled:
            residual = self._compensated("update_sparse")
            residual.index_put_((indices,), residual[indices] - values)

    def _compensated(self, what: str) -> torch.Tensor:
        if self.residual is None:
            raise RuntimeError(f"error feedback: {what}() before compensate(): this lazy residual has no "
                               "buffer yet")
        return self.residual

    def reset(self) -> None:
        """Forget the residual (e.g. after a learning-rate restart)."""
        if self.enabled and self.residual is not None:
            self.residual.zero_()

    def state_dict(self) -> dict:
        return {"enabled": self.enabled,
                "residual": None if self.residual is None else self.residual.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("enabled", True)) != self.enabled:
            raise ValueError(f"checkpoint has error_feedback={state.get('enabled')}, this compressor "
                             f"error_feedback={self.enabled}")
        saved = state.get("residual")
        if self.enabled and self.residual is None:  # a lazy residual: take the saved one
            self.residual = None if saved is None else saved.detach().clone().float().reshape(-1)
        elif self.enabled and self.residual is not None:
            if saved is None or saved.numel() != self.residual.numel():
                got = None if saved is None else saved.numel()
                raise ValueError(f"checkpoint residual has {got} elements, this bucket "
                                 f"has {self.residual.numel()} elements; load it into the same bucket plan")
            self.residual.copy_(saved.reshape(-1))


class SteppedErrorFeedback(ErrorFeedback):
    """:class:`ErrorFeedback` plus the bucket's step count, for compressors with a warm-up
    (``start_iter``): it checkpoints with the residual, so a resume neither repeats nor skips it."""

    def __init__(self, numel: int, device=None, enabled: bool = True):
        super().__init__(numel, device, enabled)
        self.step = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))
