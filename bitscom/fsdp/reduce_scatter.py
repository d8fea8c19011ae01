"""The reduce-scatter FSDP2 calls for one parameter group, sent in low bit: ``input_tensor`` holds
``P`` equal shards (shard ``j`` for group rank ``j``), ``output_tensor`` this rank's; the scale
is read from ``op`` (:func:`reduce_scale`), never assumed. FSDP ignores the return value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import runtime
from ..comm import Comm, Rounds
from ..lowbit.config import LowBitConfig
from ..lowbit.hadamard import HADAMARD_BLOCK
from ..lowbit.levelwise import levelwise_reduce_scatter_rounds
from ..lowbit.scatter_gather import reduce_scatter_rounds
from ..lowbit.seeds import key_id
from ..lowbit.state import LowBitState

__all__ = ["ByteCount", "LowBitReduceScatter", "reduce_scale"]


@dataclass
class ByteCount:
    """Bytes of the compressed reduce-scatters and of FSDP's float32 one of the same inputs."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    calls: int = 0
    inter_bytes: int = 0      # hierarchy="two_level": the part sent on the inter-node level


def reduce_scale(op, size: int, divide_factor=None) -> float:
    """The factor FSDP asks the reduce-scatter to apply to the sum: ``AVG`` = ``1/size``,
    ``PREMUL_SUM(s)`` = ``s``, ``SUM`` = 1. ``divide_factor`` (a callable) is asked for
    ``PREMUL_SUM`` on a torch whose op does not carry its factor.

    Example::

        reduce_scale(dist.ReduceOp.PREMUL_SUM(0.25), 2)   # 0.25
    """
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / size
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None and divide_factor is not None:
            f = divide_factor()
            factor = None if f is None else 1.0 / f
        if isinstance(factor, (int, float)):
            return float(factor)
        raise RuntimeError(f"FSDP asked for PREMUL_SUM and torch {torch.__version__} does not say its "
                           "factor; do not call set_gradient_divide_factor with bitscom.fsdp")
    raise ValueError(f"FSDP asked for reduce op {op!r}; the low-bit reduce-scatter computes SUM, "
                     "AVG and PREMUL_SUM only")


def _ranks(group):
    return dist.get_process_group_ranks(group)


class LowBitReduceScatter:
    """FSDP2's ``ReduceScatter`` for one parameter group (one ``fully_shard``-ed module); ``key``
    (the module's name) keys the seeds, ``levels`` are the two-level node groups.

    Example::

        fsdp_module.set_custom_reduce_scatter(LowBitReduceScatter(cfg, "layers.0", LowBitState(),
                                                                  ByteCount()))
    """

    def __init__(self, cfg: LowBitConfig, key: str, state: LowBitState, counter: ByteCount,
                 process_group=None, levels=None, divide_factor=None, before=None):
        self.cfg, self.key, self.state, self.counter = cfg, key, state, counter
        self.process_group, self.levels, self.divide_factor = process_group, levels, divide_factor
        self.before = before
        self._checked = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's buffers: plain ``torch.empty``."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False) -> Optional[object]:
        """``output_tensor`` = this rank's shard of the reduced ``input_tensor`` (synchronous)."""
        if self.before is not None:
            self.before()
        group = self._group(group)
        alpha = reduce_scale(op, dist.get_world_size(group), self.divide_factor)
        acc = output_tensor if output_tensor.dtype == torch.float32 else \
            torch.empty(output_tensor.numel(), dtype=torch.float32, device=output_tensor.device)
        if self.cfg.hierarchy == "two_level":
            comms = self._levelwise(acc.view(-1), input_tensor, alpha)
        else:
            channel = runtime.channel(group)          # one order with every face on the group
            comms = [channel.comm()]
            channel.wait(channel.submit(Rounds(reduce_scatter_rounds(
                acc, input_tensor, comms[0], self.cfg, self.state, key=self.key), comms)))
            if alpha != 1.0:
                acc.mul_(alpha)
        if acc is not output_tensor:
            output_tensor.copy_(acc.view(output_tensor.shape))
        self.counter.bytes_sent += sum(c.bytes_sent for c in comms)
        self.counter.dense_bytes += input_tensor.numel() * 4
        self.counter.calls += 1
        return None

    def _levelwise(self, out: torch.Tensor, flat: torch.Tensor, alpha: float):
        """SDP4Bit's two levels; shards padded to whole Hadamard runs when rotating."""
        intra, inter = Comm(self.levels[0]), Comm(self.levels[1])
        P, S = intra.size * inter.size, out.numel()
        padded = -(-S // HADAMARD_BLOCK) * HADAMARD_BLOCK if self.cfg.hadamard else S
        x, y = flat, out
        if padded != S:
            x = torch.zeros(P, padded, dtype=torch.float32, device=flat.device)
            x[:, :S].copy_(flat.view(P, S))
            y = torch.empty(padded, dtype=torch.float32, device=flat.device)
        step, self.state.step = self.state.step, self.state.step + 1
        levels = [(intra, self.cfg.codec(self.cfg.intra_bitwidth)), (inter, self.cfg.codec(self.cfg.bitwidth))]
        rounds = levelwise_reduce_scatter_rounds(
            x.view(-1), y, levels, hadamard=self.cfg.hadamard, hadamard_backend="butterfly",
            alpha=alpha, seed_parts=(self.cfg.seed, key_id(self.key), step, dist.get_rank()))
        Rounds(rounds, [intra, inter]).wait()
        if y is not out:
            out.copy_(y[:S])
        self.counter.inter_bytes += inter.bytes_sent
        return [intra, inter]

    def _group(self, fsdp_group):
        """The group to use, checked once against FSDP's (and the two levels' layout)."""
        if self._checked is not None:
            return self._checked
        group = fsdp_group if self.process_group is None else self.process_group
        if self.process_group is not None and _ranks(self.process_group) != _ranks(fsdp_group):
            raise ValueError(f"process_group has ranks {_ranks(self.process_group)}, FSDP reduce-scatters "
                             f"over ranks {_ranks(fsdp_group)}; pass FSDP's shard group (or None)")
        if self.levels is not None:
            _check_levels(_ranks(fsdp_group), dist.get_rank(fsdp_group), *self.levels)
        self._checked = group
        return group


def _check_levels(ranks, rank, intra, inter) -> None:
    """The node groups must be contiguous nodes of FSDP's ranks (shard ``r`` goes to ``node * L + local``)."""
    L = dist.get_world_size(intra)
    M = dist.get_world_size(inter)
    if L * M != len(ranks):
        raise ValueError(f"hierarchy='two_level': intra group ({L} ranks) x inter group ({M} ranks) "
                         f"!= FSDP's reduce-scatter group ({len(ranks)} ranks)")
    want_intra, want_inter = runtime.node_layout(ranks, L, rank)
    if _ranks(intra) != want_intra or _ranks(inter) != want_inter:
        raise ValueError(f"hierarchy='two_level': intra group {_ranks(intra)} / inter group {_ranks(inter)} "
                         f"do not match FSDP's ranks {ranks} laid out as nodes of {L} (expected intra "
                         f"{want_intra}, inter {want_inter})")
