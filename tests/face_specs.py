"""The faces of the face-contract suite (tests/test_face_contract.py), one entry each.

A face joins the contract by adding one line to ``SPECS``: a :class:`Spec` that builds it on a
model, runs one training step with it, and names a setting that can differ between ranks.
Everything the contract checks (mismatches, liveness, DDP-wrapped models, checkpoints, NaN,
replica identity, leaks) is then run for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

import torch

import bitscom
from helpers import make_model


@dataclass(frozen=True)
class Spec:
    """How the contract drives one face.

    build(model, **setting) -> face; ``mismatch``: a setting rank 1 passes differently;
    ``steps_to_communicate``: how many steps until the face has communicated at least once.
    """

    name: str
    build: Callable[..., Any]
    mismatch: Dict[str, Any]
    steps_to_communicate: int = 1
    has_state: bool = True


def _distributed(model, compression="none"):
    return bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), compression=compression)


def _sharded(model, quantized_gradients=False):
    return bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                    quantized_gradients=quantized_gradients)


def _diloco(model, sync_every=2):
    return bitscom.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                          sync_every=sync_every)


def _onebit(model, freeze_step=1):
    return bitscom.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=freeze_step)


def _zero_one(model, var_freeze_step=1):
    return bitscom.ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=var_freeze_step,
                               local_step_clipper=1)


def _onebit_overlap(model, overlap=True):
    return bitscom.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1, overlap=overlap, block_size=32,
                              bucket_mb=64 * 4 / 2 ** 20)


def _zero_one_overlap(model, overlap=True):
    return bitscom.ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=8, var_update_scaler=1,
                               local_step_clipper=1, overlap=overlap, block_size=32, bucket_mb=64 * 4 / 2 ** 20)


SPECS = [
    Spec("DistributedOptimizer", _distributed, {"compression": "fp16"}),
    Spec("ShardedOptimizer", _sharded, {"quantized_gradients": True}),
    Spec("DiLoCo", _diloco, {"sync_every": 3}, steps_to_communicate=2),
    Spec("OneBitAdam", _onebit, {"freeze_step": 2}),
    Spec("ZeroOneAdam", _zero_one, {"var_freeze_step": 2}),
    Spec("OneBitAdam-overlap", _onebit_overlap, {"overlap": False}, steps_to_communicate=2),
    Spec("ZeroOneAdam-overlap", _zero_one_overlap, {"overlap": False}, steps_to_communicate=2),
]


def batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train_step(opt, model, rank: int, step: int = 0, poison: bool = False) -> None:
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    opt.zero_grad()


def build(spec: Spec, rank: int, seed: int = 0, **setting):
    model = make_model(seed)
    return model, spec.build(model, **setting)


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
