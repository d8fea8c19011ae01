"""Checkpointing DiLoCo: every part of the state a bitwise resume needs loads, or none does."""

from __future__ import annotations

import torch

from ..face import load_all_or_nothing

__all__ = ["load_checked"]


def load_checked(opt, inner: dict, extra: dict) -> None:
    """Load everything into ``opt`` (a DiLoCo) or, on any error, leave it as it was."""
    saved = extra["global"]
    if len(saved) != len(opt._global) or any(
            s.shape != g.shape for s, g in zip(saved, opt._global)):
        raise ValueError("checkpoint θ_global has shapes "
                         f"{[tuple(s.shape) for s in saved]}, this plan has "
                         f"{[tuple(g.shape) for g in opt._global]}; was the model changed?")
    parts = [opt._reducer, opt._warmup_reducer, opt.outer_optimizer, opt.inner]

    def put(states, tensors) -> None:
        for part, state in zip(parts, states):
            if state is not None:     # no warm-up state in checkpoints from before warmup_steps
                part.load_state_dict(state)
        with torch.no_grad():
            for g, s in zip(opt._global, tensors):
                g.copy_(s)

    new = ([extra["reducer"], extra.get("warmup_reducer"), extra["outer"], inner], saved)
    load_all_or_nothing(lambda: ([p.state_dict() for p in parts], [g.detach().clone() for g in opt._global]),
                        lambda: put(*new), lambda backup: put(*backup))
    opt._counters.update({"warmup_syncs": 0, **extra["counters"]})
