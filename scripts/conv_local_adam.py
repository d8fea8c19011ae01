"""Study-only: Adam's preconditioning on each rank, before compression (the AdamW analogue of
DGC's momentum correction, bitscom.compressors.MomentumCorrection).

Why try it: with AdamW, Top-k / Sign-SGD / ACP-SGD with error feedback lose 13-15% of final
loss on the suite's GPT while they are within ~0.3 pp on SGD tasks (docs/convergence.md, "Why
AdamW is hard"). Error feedback delivers a coordinate in bursts; Adam's second moment ``v`` is
an average of *squares*, so bursts inflate it and the steps come out wrong. Here each rank
keeps its own ``m``, ``v`` (of its local gradient, fp32, bias-corrected) and hands the
preconditioned update ``m̂ / (sqrt(v̂) + eps)`` to the inner compressor; its error feedback then
delivers update mass, and the optimizer is a plain SGD (no momentum; its weight decay equals
AdamW's decoupled decay, since for SGD the two coincide). With nothing compressed this is
"local-statistics Adam": each rank's ``v`` sees a half batch (2 ranks), which ``ssgd-ladam``
isolates.

Not in the library: it is measured here to decide whether it belongs there. Used by
``scripts/convergence.py`` settings ``ladam=True`` (+ ``opt.local_adam=True`` on text_lm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bitscom.compressors.base import BucketLayout, Comm, Compressor, State


class LocalAdamState(State):
    def __init__(self, numel: int, device, inner: State):
        self.m = torch.zeros(int(numel), dtype=torch.float32, device=device)
        self.v = torch.zeros(int(numel), dtype=torch.float32, device=device)
        self.t = 0
        self.inner = inner


@dataclass(frozen=True)
class LocalAdam(Compressor):
    """``inner`` compresses each rank's Adam update ``m̂/(sqrt(v̂)+eps)`` (betas as AdamW's)."""

    inner: Compressor = None
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8

    name = "local_adam"

    def __post_init__(self):
        from bitscom.compressors.registry import resolve
        object.__setattr__(self, "inner", resolve("topk" if self.inner is None else self.inner,
                                                  "LocalAdam inner"))

    @property
    def uses_names(self) -> bool:
        return self.inner.uses_names

    def init_state(self, layout: BucketLayout) -> LocalAdamState:
        return LocalAdamState(layout.numel, layout.device, self.inner.init_state(layout))

    def reduce(self, flat, layout, state: LocalAdamState, comm: Comm):
        state.t += 1
        g = flat.reshape(-1).float()
        state.m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        state.v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        v_hat = state.v / (1 - self.beta2 ** state.t)
        u = (state.m / (1 - self.beta1 ** state.t)).div_(v_hat.sqrt_().add_(self.eps))
        flat.copy_(u.view_as(flat))
        yield from self.inner.reduce(flat, layout, state.inner, comm)
