"""0/1 Adam (Lu et al., 2022), after DeepSpeed's ``ZeroOneAdam``."""

from __future__ import annotations

from typing import Any, Dict

import torch

from ..face import renamed
from .base import OneBitBase
from .config import ZeroOneConfig

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OneBitBase):
    """0/1 Adam: the variance updated on an exponentially spaced schedule until
    ``var_freeze_step``, every other step 1-bit, then local steps whose interval grows.

    The algorithm, step ``t``, ``g`` = this rank's gradient, counters as DeepSpeed's:

    1. ``t <= var_freeze_step`` (variance phase). If ``t % var_interval == 0``: ``g``
       averaged exactly, ``v = b2 v + (1-b2) g²``, ``m = b1 m + (1-b1) g``; else ``g`` averaged
       by the 1-bit all-reduce (worker + server error feedback), masked, and
       ``m = b1 m + (1-b1) g``. Then ``p -= lr (m / (sqrt(v)+eps) + wd p)``. Every
       ``var_update_scaler`` variance updates ``var_interval`` doubles (1, 2, 4, ...).
    2. ``t > var_freeze_step`` (frozen phase; the residuals are zeroed once on entry, since
       they now belong to another quantity). ``m = b1 m + (1-b1) g`` locally; ``lrs += lr``;
       ``d = lr (m / (sqrt(v)+eps) + wd p)``; ``p -= d``; ``u -= d``. If
       ``t % local_step_interval == 0`` (synchronization): ``u *= sqrt(v)+eps``;
       ``u`` = 1-bit average of ``u``, masked; ``m = -u / lrs``;
       ``p = p_sync + u / (sqrt(v)+eps)`` (``p_sync``: the parameters at the last
       synchronization; DeepSpeed writes ``p - u`` for it, equal in exact arithmetic);
       ``u = 0``; ``lrs = 0``. Every ``local_step_scaler`` frozen steps ``local_step_interval``
       doubles, up to ``local_step_clipper``.

    Where it differs from DeepSpeed: docs/onebit.md. On short runs measure before trusting it:
    ``sqrt(v)`` keeps falling long after the lr warm-up, so a variance frozen early makes every
    later step too small. Arguments as :class:`~bitscom.onebit.OneBitAdam`'s, the schedule's
    :class:`~bitscom.onebit.ZeroOneConfig`'s.

    Example::

        bitscom.init()
        opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=100,
                          local_step_scaler=100, local_step_clipper=8)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    """

    _NAME = "ZeroOneAdam"
    _CONFIG = ZeroOneConfig

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, *, process_group=None,
                 block_size: int = 2048, stage2_bits: int = 1, bias_correction: bool = True, group=None,
                 overlap: bool = False, bucket_mb: float = 25.0, backward_passes_per_step: int = 1):
        group = renamed(process_group, group, new="process_group", old="group", where="ZeroOneAdam")
        super().__init__(params, lr, weight_decay, group, locals())
        self._sched: Dict[str, Any] = {"var_interval": 1, "var_counter": 0, "local_step_interval": 1,
                       "local_step_counter": 0, "errors_reset": False,
                       "lrs": [0.0] * len(self.param_groups)}
        self.momentum_accumulator = torch.zeros_like(self.exp_avg)
        # The parameters at the last synchronization: DeepSpeed's ``p - u`` differs between ranks
        # by the rounding of their local steps; this keeps synchronized replicas bitwise equal.
        self.anchor = torch.zeros_like(self.exp_avg)

    @property
    def variance_frozen(self) -> bool:
        return self._counters["step"] >= self.config.var_freeze_step

    def _extra_state(self) -> Dict[str, Any]:
        return {**self._sched, "lrs": list(self._sched["lrs"]),
                "momentum_accumulator": self.momentum_accumulator.clone(), "anchor": self.anchor.clone()}

    def _load_extra(self, extra: Dict[str, Any]) -> None:
        extra = dict(extra)
        self.momentum_accumulator.copy_(extra.pop("momentum_accumulator"))
        self.anchor.copy_(extra.pop("anchor"))
        extra["lrs"] = list(extra["lrs"])
        self._sched = extra

    def _overlap_kind(self, t: int) -> str:
        """The variance phase's 1-bit gradient steps go from the hooks; the rest runs in step()."""
        if t <= self.config.var_freeze_step and t % self._sched["var_interval"] != 0:
            return "gradient"
        return "none"

    def _update(self, grad: torch.Tensor, t: int) -> None:
        if t <= self.config.var_freeze_step:
            self._variance_phase(grad, t)
        else:
            self._frozen_phase(grad, t)

    def _variance_phase(self, grad: torch.Tensor, t: int) -> None:
        cfg, s = self.config, self._sched
        b1, b2 = cfg.betas
        m, v = self.exp_avg, self.exp_avg_sq
        if t % s["var_interval"] == 0:
            g = self._exact_average(grad)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            self._counters["exact_steps"] += 1
            s["var_counter"] += 1
            if s["var_counter"] == cfg.var_update_scaler:
                s["var_counter"] = 0
                s["var_interval"] *= 2
        else:
            g = self._onebit_average(grad)
            self._mask(g)
            self._counters["compressed_steps"] += 1
        m.mul_(b1).add_(g, alpha=1 - b1)
        bc1, bc2 = self._bias_corrections(t)
        update = m / self._denominator(bc2)
        self._apply(update.div_(bc1) if bc1 != 1.0 else update)

    def _frozen_phase(self, grad: torch.Tensor, t: int) -> None:
        cfg, s = self.config, self._sched
        b1 = cfg.betas[0]
        m, u = self.exp_avg, self.momentum_accumulator
        if not s["errors_reset"]:       # the residuals held gradient error; now they hold u's
            self._lowbit.residual.reset()
            self._lowbit.stage2_residual.reset()
            s["errors_reset"] = True
            for p, _, view in self._views(self.anchor):
                view.copy_(p)
        m.mul_(b1).add_(grad, alpha=1 - b1)
        # With bias correction, the step size is lr / bc1 (torch's Adam); lrs sums it, so
        # -u * denom / lrs is still the step-weighted average of the (uncorrected) momenta.
        bc1, bc2 = self._bias_corrections(t)
        s["lrs"] = [acc + g["lr"] / bc1 for acc, g in zip(s["lrs"], self.param_groups)]
        denom = self._denominator(bc2)
        update = m / denom
        self._apply(update.div_(bc1) if bc1 != 1.0 else update, u)
        if t % s["local_step_interval"] == 0:
            self._synchronize(denom)
        s["local_step_counter"] += 1
        if s["local_step_counter"] == cfg.local_step_scaler:
            s["local_step_counter"] = 0
            s["local_step_interval"] = min(cfg.local_step_clipper, s["local_step_interval"] * 2)

    def _synchronize(self, denom: torch.Tensor) -> None:
        """``u`` 1-bit averaged (times denom), ``m = -u / lrs``, ``p = p_sync + u / denom``, ``u = lrs = 0``."""
        s, m, u = self._sched, self.exp_avg, self.momentum_accumulator
        u.mul_(denom)
        self._onebit_average(u)
        self._mask(u)
        lrs = [acc for acc, g in zip(s["lrs"], self.param_groups) for _ in g["params"]]
        for (_, _, uv, mv), lr_sum in zip(self._views(u, m), lrs):
            mv.copy_(uv / lr_sum).neg_()
        self.anchor.add_(u / denom)
        for p, _, view in self._views(self.anchor):
            p.copy_(view)
        u.zero_()
        s["lrs"] = [0.0] * len(self.param_groups)
        self._counters["compressed_steps"] += 1

    @torch.no_grad()
    def sync(self) -> None:
        """Synchronize now if local steps ran since the last synchronization (the schedule is
        unchanged): every rank then holds the same parameters and momentum.

        Example::

            for x, y in loader:
                loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
            opt.sync()                       # replicas bitwise identical for eval / save
        """
        super().sync()
        t = self._counters["step"]
        if t <= self.config.var_freeze_step or not any(self._sched["lrs"]):
            return
        self._synchronize(self._denominator(self._bias_corrections(t)[1]))

    def _bias_corrections(self, t: int):
        """(1 - b1^t, 1 - b2^k), k = the exact variance updates so far; (1, 1) without."""
        if not self.config.bias_correction:
            return 1.0, 1.0
        b1, b2 = self.config.betas
        return 1 - b1 ** t, 1 - b2 ** self._counters["exact_steps"]
