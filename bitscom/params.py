"""Which parameters an optimizer trains, by name: the one validation both optimizers share
(the same mistakes refused in the same words, plans from the same registration order)."""

from __future__ import annotations

from typing import Dict, List

import torch

__all__ = ["named_parameters_of", "checked_pairs"]


def checked_pairs(named_parameters) -> List[tuple]:
    """``named_parameters`` as ``(name, tensor)`` pairs with unique names."""
    named = list(named_parameters)
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("named_parameters must be (name, tensor) pairs, e.g. "
                            f"model.named_parameters(); got an item {type(item).__name__}")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters contains duplicate names {dups}; names must be unique")
    return named


def named_parameters_of(optimizer: torch.optim.Optimizer, named_parameters) -> List[tuple]:
    """Checked (name, parameter) pairs of ``optimizer``, registration order (else ``param.<i>``)."""
    seen = {id(p): p for group in optimizer.param_groups for p in group["params"]}   # each once, in order
    opt_params = list(seen.values())
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(opt_params)]
    named = checked_pairs(named_parameters)
    _check_same_parameters(named, opt_params, seen)
    return [(n, p) for n, p in named if id(p) in seen]


def _check_same_parameters(named: List[tuple], opt_params: list, seen: Dict[int, torch.Tensor]) -> None:
    by_id = {id(p): n for n, p in named}
    missing_from_opt = [n for n, p in named if id(p) not in seen and p.requires_grad]
    if missing_from_opt:
        raise ValueError(f"parameters {missing_from_opt[:5]} are in named_parameters but not in the "
                         "optimizer's param_groups; pass the optimizer every trainable parameter")
    unnamed = [i for i, p in enumerate(opt_params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameter(s) (e.g. index {unnamed[0]}) are missing "
                         "from named_parameters; pass model.named_parameters() of the same model")
