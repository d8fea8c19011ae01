"""1-bit Adam (Tang et al., ICML 2021), after DeepSpeed's ``OnebitAdam``."""

from __future__ import annotations

import torch

from ..face import renamed
from .base import OneBitBase
from .config import OneBitConfig

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitBase):
    """1-bit Adam: exact AdamW for ``freeze_step`` steps, then the variance frozen and the
    momentum averaged by a 1-bit all-reduce with worker and server error feedback.

    Why: compressing Adam's *gradients* breaks its variance (bursty error-feedback gradients
    inflate ``v``), but ``v`` settles early. After the warm-up ``m / sqrt(v_frozen)`` is linear
    in the momentum, so the momentum itself can be compressed to 1 bit with error feedback.

    The algorithm, step ``t`` on every rank, ``g`` = this rank's gradient (``p.grad``):

    1. ``t <= freeze_step`` (warm-up): ``g`` averaged exactly (fp32 all-reduce);
       ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g²``.
    2. ``t > freeze_step``: ``m = b1 m + (1-b1) g_local``; ``m`` = the two-stage 1-bit
       all-reduce of ``m`` (:func:`~bitscom.onebit.momentum_codec`); ``m *= exp_avg_mask``
       where a group has one; ``v`` unchanged.
    3. ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` (decoupled weight decay).

    Where it differs from DeepSpeed's ``OnebitAdam`` (bias correction by default, among
    others): docs/onebit.md. Use it alone with LOCAL gradients (no DistributedOptimizer, no
    DDP) and call ``step()`` on every rank every iteration. A parameter group may set ``lr``,
    ``weight_decay`` and ``exp_avg_mask`` (0/1, broadcastable: 0 for rows always zero, such as
    unused embedding rows); ``freeze_step`` ... ``bias_correction`` are
    :class:`~bitscom.onebit.OneBitConfig`'s, ``overlap`` ... those of
    :class:`~bitscom.onebit.config.OverlapConfig`.

    Example::

        bitscom.init()
        opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        for x, y in loader:                      # this rank's shard of the data
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.comm_stats()["compression_ratio"]

        opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100, overlap=True)
    """

    _NAME = "OneBitAdam"
    _CONFIG = OneBitConfig

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100, *, process_group=None,
                 block_size: int = 2048, stage2_bits: int = 1, bias_correction: bool = True, group=None,
                 overlap: bool = False, bucket_mb: float = 25.0, backward_passes_per_step: int = 1):
        group = renamed(process_group, group, new="process_group", old="group", where="OneBitAdam")
        super().__init__(params, lr, weight_decay, group, locals())

    @property
    def variance_frozen(self) -> bool:
        """True once ``freeze_step`` steps were taken (later steps send the 1-bit momentum)."""
        return self._counters["step"] >= self.config.freeze_step

    def _overlap_kind(self, t: int) -> str:
        return "none" if t <= self.config.freeze_step else "momentum"

    def _overlap_target(self, kind: str, start: int, stop: int) -> torch.Tensor:
        """The bucket's momentum update, ``m = b1 m + (1-b1) g`` on ``[start, stop)``."""
        assert self._buckets is not None
        b1 = self.config.betas[0]
        self.exp_avg[start:stop].mul_(b1).add_(self._buckets.grad[start:stop], alpha=1 - b1)
        return self.exp_avg

    def _update(self, grad: torch.Tensor, t: int) -> None:
        cfg = self.config
        b1, b2 = cfg.betas
        m, v = self.exp_avg, self.exp_avg_sq
        if t <= cfg.freeze_step:
            g = self._exact_average(grad)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            self._counters["exact_steps"] += 1
        else:
            if self._sent is None:        # else: done bucket by bucket from the hooks
                m.mul_(b1).add_(grad, alpha=1 - b1)
            self._onebit_average(m)
            self._mask(m)
            self._counters["compressed_steps"] += 1
        if cfg.bias_correction:     # v's correction freezes with v (k = exact updates so far)
            update = m / self._denominator(1 - b2 ** min(t, cfg.freeze_step))
            self._apply(update.div_(1 - b1 ** t))
        else:
            self._apply(m / self._denominator())
