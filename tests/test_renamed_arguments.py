"""One name per concept: ``process_group=`` and ``compression=`` on every face; the old
spellings (``group=`` of DiLoCo / OneBitAdam / ZeroOneAdam, ``ddp_comm_hook(compressor=)``)
still work and warn with DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import bitscom


def _builders(model):
    world = dist.group.WORLD
    return {
        "DiLoCo": lambda **g: bitscom.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1),
                                            model.named_parameters(), **g),
        "OneBitAdam": lambda **g: bitscom.OneBitAdam(model.parameters(), **g),
        "ZeroOneAdam": lambda **g: bitscom.ZeroOneAdam(model.parameters(), **g),
    }, world


def _renamed(rank, world_size):
    seen = {}
    for name in ("DiLoCo", "OneBitAdam", "ZeroOneAdam"):
        model = torch.nn.Linear(4, 2)
        builders, world = _builders(model)
        for spelling in ("process_group", "group"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                face = builders[name](**{spelling: world})
            face.close()
            seen[(name, spelling)] = any(issubclass(w.category, DeprecationWarning) for w in caught)
    for spelling in ("compression", "compressor"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = bitscom.ddp_comm_hook(**{spelling: "fp16"})
        state.close()
        seen[("ddp_comm_hook", spelling)] = any(issubclass(w.category, DeprecationWarning) for w in caught)
    return seen


def test_old_names_warn_and_new_names_do_not(pools):
    for seen in pools.run(2, _renamed):
        for (face, spelling), warned in seen.items():
            assert warned == (spelling in ("group", "compressor")), (face, spelling, warned)


def test_both_names_at_once_is_an_error():
    with pytest.raises(TypeError, match="pass process_group= only"):
        bitscom.OneBitAdam(torch.nn.Linear(2, 2).parameters(), process_group=object(), group=object())
