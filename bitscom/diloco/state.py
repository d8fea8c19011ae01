"""Checkpointing DiLoCo: what a resume must restore, all or nothing.

θ_global, the outer SGD's momentum, the compressor state (this rank's error-feedback residual)
and the inner optimizer's state are all needed to continue bitwise; ``load_checked`` replaces
none of them unless all load.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["has_tensor", "load_checked"]


def has_tensor(obj: Any) -> bool:
    """Whether a nested state holds a tensor (per-rank state such as error-feedback residuals).

    Example::

        has_tensor({"residual": torch.zeros(3)})   # True
    """
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensor(v) for v in obj)
    return False


def load_checked(opt, inner: dict, extra: dict) -> None:
    """Load everything into ``opt`` (a DiLoCo) or, on any error, leave it as it was.

    Example::

        load_checked(opt, inner_state_dict, state_dict["diloco"])
    """
    saved = extra["global"]
    if len(saved) != len(opt._global) or any(
            s.shape != g.shape for s, g in zip(saved, opt._global)):
        raise ValueError("checkpoint θ_global has shapes "
                         f"{[tuple(s.shape) for s in saved]}, this plan has "
                         f"{[tuple(g.shape) for g in opt._global]}; was the model changed?")
    backup = {"reducer": opt._reducer.state_dict(),
              "warmup_reducer": opt._warmup_reducer.state_dict(),
              "outer": opt.outer_optimizer.state_dict(),
              "inner": opt.inner.state_dict(), "global": [g.detach().clone() for g in opt._global]}
    try:
        opt._reducer.load_state_dict(extra["reducer"])
        if "warmup_reducer" in extra:     # absent in checkpoints from before warmup_steps
            opt._warmup_reducer.load_state_dict(extra["warmup_reducer"])
        opt.outer_optimizer.load_state_dict(extra["outer"])
        opt.inner.load_state_dict(inner)
        with torch.no_grad():
            for g, s in zip(opt._global, saved):
                g.copy_(s)
    except BaseException:
        opt._reducer.load_state_dict(backup["reducer"])
        opt._warmup_reducer.load_state_dict(backup["warmup_reducer"])
        opt.outer_optimizer.load_state_dict(backup["outer"])
        opt.inner.load_state_dict(backup["inner"])
        with torch.no_grad():
            for g, s in zip(opt._global, backup["global"]):
                g.copy_(s)
        raise
    opt._counters.update({"warmup_syncs": 0, **extra["counters"]})
