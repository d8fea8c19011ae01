"""AdamW whose second-moment estimate freezes after a warm-up: 1-bit Adam's idea, for any compressor.

Why: error feedback hands Adam a bursty gradient whose average is right but whose square is
not; with ``v`` frozen (1-bit Adam, ICML 2021) the update is linear in the gradient. Pair it
with a compressor warm-up of the same length (docs/api.md). Example::

    comp = bitscom.compressors.get("signsgd", start_iter=30)
    base = bitscom.FrozenVarianceAdamW(model.parameters(), lr=3e-3, freeze_step=30)
    opt = bitscom.DistributedOptimizer(base, model.named_parameters(), compression=comp)
"""

from __future__ import annotations

import torch

from .validate import number, numbers

__all__ = ["FrozenVarianceAdamW"]


def _check_group(group: dict) -> None:
    for name in ("lr", "eps", "weight_decay"):
        number(f"FrozenVarianceAdamW {name}", group[name], minimum=0)
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"FrozenVarianceAdamW betas must be a pair, got {betas!r}")
    numbers("FrozenVarianceAdamW betas", betas, minimum=0, maximum=1, inclusive=(True, False))
    number("FrozenVarianceAdamW freeze_step", group["freeze_step"], minimum=1, integer=True)


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """:class:`torch.optim.AdamW` (same arguments and state keys) that stops updating
    ``exp_avg_sq`` after ``freeze_step`` steps, per parameter group (≥ 1: 0 would divide by ``eps``)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, freeze_step: int = 100):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step)
        _check_group(defaults)
        defaults["betas"] = tuple(betas)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with the group's settings checked like the constructor's."""
        if isinstance(param_group, dict):       # torch's own errors for anything else
            _check_group({**getattr(self, "defaults", {}), **param_group})
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        # A torch.optim.AdamW checkpoint has no freeze_step (the default applies); settings this
        # class does not implement must not load silently. Checked before anything is replaced.
        defaults = state.get("defaults", getattr(self, "defaults", {}))
        for group in state.get("param_groups", ()):
            if "freeze_step" in defaults:
                group.setdefault("freeze_step", defaults["freeze_step"])
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ValueError(f"FrozenVarianceAdamW does not implement {key}=True, "
                                     f"found in a loaded parameter group: {group.get(key)!r}")
            _check_group(group)
        super().__setstate__(state)

    def variance_frozen(self) -> bool:
        """True once every parameter has taken its group's ``freeze_step`` steps."""
        steps = [(int(self.state[p]["step"]), g["freeze_step"]) for g in self.param_groups
                 for p in g["params"] if p in self.state]
        return bool(steps) and all(step >= freeze for step, freeze in steps)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, freeze = group["lr"], group["eps"], group["weight_decay"], group["freeze_step"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FrozenVarianceAdamW does not support sparse gradients "
                                       f"(parameter of shape {tuple(p.shape)})")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                if step <= freeze:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** min(step, freeze)
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
