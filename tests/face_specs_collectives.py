"""The collective faces of the face contract (tests/test_face_contract_collectives.py), one line each.

The optimizer faces (tests/face_specs.py) train a model; these faces are called per tensor or
per DDP bucket, so each is driven through a small adapter with one interface: ``step(rank,
step, poison)`` communicates once (``poison``: a NaN in this rank's input), ``result()`` is what
every rank must hold identically, ``close()``; stateful faces also ``state_dict()`` /
``load_state_dict()``. A face joins the contract by adding one line to ``SPECS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

import bitscom
from bitscom.backend import register_lowbit_backend
from bitscom.collectives import LowBitConfig

NUMEL = 24


@dataclass(frozen=True)
class Spec:
    """How the contract drives one collective face.

    ``build(width=..., **setting)``: the adapter; ``width`` is the tensor / layer size a rank
    uses (the shape mismatch passes a different one on rank 1); ``mismatch``: a setting rank 1
    passes differently; ``has_state``: the face checkpoints; ``shapes``: whether the face sees
    shapes (DDP's own constructor compares parameter shapes before any hook exists);
    ``gone``: what the error after the world went says.
    """

    name: str
    build: Callable[..., Any]
    mismatch: Dict[str, Any]
    has_state: bool = False
    shapes: bool = True
    gone: str = r"shut down.*bitscom\.init\(\)"


def data(rank: int, step: int, numel: int = NUMEL, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randn(numel, generator=g)
    if poison:
        t[0] = float("nan")
    return t


class _Summed:
    """A face called per tensor: ``result()`` is the sum of what it returned."""

    def __init__(self, width: int):
        self.width = width
        self.acc = torch.zeros(width)

    def step(self, rank: int, step: int = 0, poison: bool = False) -> None:
        self.acc += self.reduce(data(rank, step, self.width, poison))

    def result(self) -> torch.Tensor:
        return self.acc.clone()

    def stats(self):
        """``comm_stats()``, or None for a face that counts no bytes."""
        return None

    def close(self) -> None:
        pass


class DDPHook:
    """A small DDP model whose buckets go through ``bitscom.ddp_comm_hook``."""

    def __init__(self, width: int = 8, compression: Any = None):
        if compression is None:         # error feedback: per-rank state in the checkpoint
            compression = bitscom.compressors.LowBit(bitwidth=4, error_feedback=True)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
        self.model = torch.nn.parallel.DistributedDataParallel(net)
        self.state, hook = bitscom.ddp_comm_hook(compression)
        self.model.register_comm_hook(self.state, hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self, rank: int, step: int = 0, poison: bool = False) -> None:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        (loss * float("nan") if poison else loss).backward()
        self.opt.step()
        self.opt.zero_grad()

    def result(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def stats(self) -> dict:
        return self.state.comm_stats()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    def close(self) -> None:
        self.state.close()


class Group(_Summed):
    """``bitscom.LowBitGroup``: keyed 4-bit all-reduce with error feedback."""

    def __init__(self, width: int = NUMEL, bitwidth: int = 4):
        super().__init__(width)
        self.lb = bitscom.LowBitGroup(bitwidth=bitwidth, error_feedback=True)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.lb.all_reduce(t, op=dist.ReduceOp.AVG, key="t")
        return t

    def stats(self) -> dict:
        return self.lb.comm_stats()

    def state_dict(self) -> dict:
        return self.lb.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.lb.load_state_dict(state)

    def close(self) -> None:
        self.lb.close()


class Horovod(_Summed):
    """The module-level Horovod ops on the group the user kept (``process_group=``)."""

    def __init__(self, width: int = NUMEL, op: Any = None):
        super().__init__(width)
        self.group = dist.group.WORLD
        self.op = bitscom.Average if op is None else op

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return bitscom.allreduce(t, op=self.op, name="t", process_group=self.group)


_GROUPS: Dict[tuple, Any] = {}


class Backend(_Summed):
    """``dist.all_reduce`` over a group of the ``lowbit`` backend, made as tests/test_backend.py
    makes one (registered with bitwidth=4, the group's settings in ``pg_options``) once per
    world and setting: torch cannot destroy a Python-backend group on its own
    (``destroy_process_group(pg)``: "ProcessGroup name not set"), so a cycle reuses it."""

    def __init__(self, width: int = NUMEL, bitwidth: int = 4):
        super().__init__(width)
        register_lowbit_backend(bitwidth=4)
        key = (bitscom.runtime.world_token(), bitwidth)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(backend="lowbit", pg_options=LowBitConfig(bitwidth=bitwidth))
        self.pg = _GROUPS[key]

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.pg)
        return t

    def stats(self) -> dict:
        return self.pg.comm_stats()


SPECS = [
    Spec("ddp_comm_hook", DDPHook, {"compression": "fp16"}, has_state=True, shapes=False),
    Spec("LowBitGroup", Group, {"bitwidth": 8}, has_state=True),
    Spec("horovod", Horovod, {"op": bitscom.Sum}),
    # after a new init(), torch's dist.all_reduce refuses the old group before the backend runs
    Spec("lowbit backend", Backend, {"bitwidth": 8},
         gone=r"shut down.*bitscom\.init\(\)|not initialized in the world group map"),
]
