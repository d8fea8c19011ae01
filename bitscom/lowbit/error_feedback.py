"""Error feedback: the one reusable piece every lossy compressor shares.

Why: a biased compressor C (top-k, scaled sign, low-rank, low-bit) loses part of every
gradient. Error feedback (Seide et al. 2014; Karimireddy et al. 2019; Stich et al. 2018)
keeps what was lost in a residual ``e`` and adds it to the next gradient, so nothing is lost
for good, only delayed; with it biased compressors converge like SGD.

The algorithm, per bucket and step:

1. ``x = g + e``                      (:meth:`ErrorFeedback.compensate`)
2. send ``C(x)``                      (the compressor's business)
3. ``e = x − D(C(x))``                (:meth:`ErrorFeedback.update` for a dense decoded
                                       tensor, :meth:`ErrorFeedback.update_sparse` for
                                       values at indices)

The invariant tests check is step 3 read backwards: ``g + e_old = D(C(x)) + e_new`` to float
precision. The residual lives in fp32 whatever the gradient dtype, so fp16/bf16 gradients do
not lose their small leftovers to rounding.

The residual buffer *is* ``x`` between steps 1 and 3 (no extra allocation): a compressor
must not modify the tensor :meth:`compensate` returns in place. The object is a
:class:`~bitscom.compressors.base.State`, so it checkpoints on its own or inside a
compressor's state (see :meth:`state_dict`). It sits below the compressors and the low-bit
collectives (it imports only bitscom.scratch, which imports nothing), so both use this one implementation; it is
re-exported as ``bitscom.compressors.ErrorFeedback``.

EF21 (each worker keeps ``g_i`` and sends ``C(∇f_i − g_i)``) is a different algorithm and is
not what this class does.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

from ..scratch import Scratch

__all__ = ["ErrorFeedback", "SteppedErrorFeedback"]

_EF = TypeVar("_EF", bound="ErrorFeedback")


class ErrorFeedback:
    """The residual ``e`` of one flat buffer (one bucket, or one tensor of it).

    Args:
        numel: elements of the buffer the residual shadows.
        device: where the residual lives (the gradient's device).
        enabled: ``False`` makes :meth:`compensate` return the gradient itself and the
            updates no-ops, so a compressor can be written once for both settings.

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
        """A zero residual shaped like ``layout``'s flat buffer.

        Example::

            state = ErrorFeedback.for_layout(layout, enabled=self.error_feedback)
        """
        return cls(layout.numel, layout.device, enabled)

    @classmethod
    def lazy(cls: type[_EF]) -> _EF:
        """An enabled residual whose buffer is made (zeros) by the first :meth:`compensate`:
        for callers that learn the size and device only with the first tensor.

        Example::

            ef = ErrorFeedback.lazy(); x = ef.compensate(flat)
        """
        ef = cls(0, enabled=True)
        ef.residual = None
        return ef

    @classmethod
    def over(cls: type[_EF], residual: torch.Tensor) -> _EF:
        """Error feedback whose residual *is* ``residual`` (e.g. one chunk's view of a larger
        residual), so several chunks can each run the algorithm on their part.

        Example::

            chunk_ef = ErrorFeedback.over(state.residual.ensure(n, dev)[s:t])
        """
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
        """Return ``x = grad + e`` in fp32 (the residual buffer itself when enabled).

        Disabled: ``grad`` as fp32 (no copy if it already is fp32).
        """
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
        """Zero the residual entries that are NaN/Inf: a step AMP skips for overflow must not
        poison every later step (the low-bit collectives' policy; others :meth:`reset`)."""
        if self.enabled and self.residual is not None:
            torch.nan_to_num_(self.residual, nan=0.0, posinf=0.0, neginf=0.0)

    def update_sparse(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``e = x − D(C(x))`` for ``D(C(x))`` that is ``values`` at ``indices``, zero elsewhere.

        Indices must be unique (top-k's are). Entries sent at full fp32 precision end exactly 0.
        """
        if self.enabled:
            residual = self._compensated("update_sparse")
            residual.index_put_((indices,), residual[indices] - values)

    def _compensated(self, what: str) -> torch.Tensor:
        """The residual an enabled update works on: :meth:`compensate` made it (a RuntimeError
        naming ``what`` if a lazy residual was updated before any compensate)."""
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
    (``start_iter`` plain all-reduce steps before compressing). The count checkpoints with the
    residual, so a resumed run neither repeats nor skips its warm-up.

    Example::

        state = SteppedErrorFeedback.for_layout(layout, enabled=True)
        step, state.step = state.step, state.step + 1
    """

    def __init__(self, numel: int, device=None, enabled: bool = True):
        super().__init__(numel, device, enabled)
        self.step = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))
