"""Checkpointing DiLoCo: what a resume must restore, all or nothing.

θ_global, the outer SGD's momentum, the compressor state (this rank's error-feedback residual)
and the inner optimizer's state are all needed to continue bitwise; ``load_checked`` replaces
none of them unless all load.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["owner_check", "load_checked"]


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def owner_check(extra: dict, rank: int, world: int) -> None:
    """Refuse another rank's compressor state (per-rank error feedback): resuming from it would
    run, but not reproduce the uninterrupted run.

    Example::

        owner_check(state_dict["diloco"], rank=0, world=2)
    """
    saved, saved_world = extra.get("rank"), extra.get("world")
    if saved_world is not None and saved_world != world:
        raise ValueError(f"this checkpoint was saved by a DiLoCo over {saved_world} ranks; this one "
                         f"has {world}")
    states = [extra["reducer"]["states"], extra.get("warmup_reducer", {}).get("states", [])]
    if saved is not None and saved != rank and _has_tensor(states):
        raise ValueError(f"this checkpoint holds the compressor state of rank {saved} (per-rank "
                         f"error-feedback memory); this is rank {rank}. Save opt.state_dict() on "
                         "every rank and load each rank's own file")


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
