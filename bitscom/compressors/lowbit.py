"""LowBit: blockwise low-bit two-stage all-reduce as a DistributedOptimizer compressor.

A thin adapter: the algorithm lives in :mod:`bitscom.collectives` (shared with
:class:`bitscom.LowBitGroup` and the ``lowbit`` backend); this class holds the settings and
one :class:`~bitscom.collectives.LowBitState` per bucket (error-feedback buffers and the step
that keys stochastic-rounding seeds), checkpointed with the optimizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..collectives import LowBitConfig, LowBitState, all_reduce_rounds, wire_bytes_all_reduce
from .base import BucketLayout, Comm, Compressor

__all__ = ["LowBit"]


@dataclass(frozen=True)
class LowBit(Compressor):
    """Two-stage low-bit all-reduce of each bucket (quantize shards -> all-to-all -> sum ->
    requantize -> all-gather), flat or hierarchical.

    Settings (see :class:`~bitscom.collectives.LowBitConfig` for each trade-off): ``bits``,
    ``stage2_bits`` (None = max(bits, 4), measured), ``block_size``, ``stochastic_rounding``,
    ``hadamard``, ``error_feedback`` ("none" | "ef" | "ef21"), ``stage2_error_feedback``,
    ``hierarchical`` ("none" | "leader" | "two_level"), ``intra_bits``, ``local_quantize``,
    ``chunk_size``, ``seed``. A hierarchical compressor also needs ``intra_group`` and
    ``inter_group`` (e.g. ``bitscom.intra_group()``, ``bitscom.inter_group()``); use them for
    this optimizer only: all of its collectives are issued from the engine's in-order later
    rounds, which keeps their order identical on every rank.

    Wire cost of the flat scheme, per rank and bucket of n elements: n·(bits + 16/block_size)/8
    bytes of all-to-all plus n/P·(stage2_bits + 16/block_size)/8 of all-gather input.

    Example::

        opt = bitscom.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=bitscom.compressors.LowBit(bits=4, error_feedback="ef"))
    """

    name = "lowbit"

    bits: int = 4
    stage2_bits: Optional[int] = None
    block_size: int = 128
    stochastic_rounding: bool = False
    hadamard: bool = False
    error_feedback: str = "none"
    stage2_error_feedback: bool = False
    hierarchical: str = "none"
    intra_bits: int = 8
    local_quantize: bool = False
    chunk_size: Optional[int] = None
    seed: int = 0
    intra_group: Any = field(default=None, compare=False, repr=False)
    inter_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        cfg = self.config  # validates every setting, naming the bad value
        if cfg.hierarchy != "none" and (self.intra_group is None or self.inter_group is None):
            raise ValueError(f"hierarchical={self.hierarchical!r} needs intra_group and inter_group, "
                             "e.g. LowBit(..., intra_group=bitscom.intra_group(), "
                             "inter_group=bitscom.inter_group())")

    @property
    def config(self) -> LowBitConfig:
        # Every LowBitConfig field has a same-named setting here, except ``hierarchy``, which the
        # optimizer-facing API calls ``hierarchical``.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LowBitConfig)
                  if f.name != "hierarchy"}
        return LowBitConfig(hierarchy=self.hierarchical, **values)

    def init_state(self, layout: BucketLayout) -> LowBitState:
        return LowBitState()

    def reduce(self, flat, layout, state, comm):
        cfg = self.config
        if cfg.hierarchy == "none":
            yield from all_reduce_rounds(flat, comm, cfg, state, average=True, key=layout.index)
            return
        intra, inter = Comm(self.intra_group), Comm(self.inter_group)
        # Issue nothing in the first round: every collective then runs as a later round, which the
        # engine starts strictly in bucket order, so intra/inter groups see one order everywhere.
        yield None
        try:
            yield from all_reduce_rounds(flat, None, cfg, state, average=True, key=layout.index,
                                         intra=intra, inter=inter)
        finally:
            comm.bytes_sent += intra.bytes_sent + inter.bytes_sent

    def fingerprint(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.compare)
        if self.hierarchical != "none":
            fields += (f", intra_size={dist.get_world_size(self.intra_group)}, "
                       f"inter_size={dist.get_world_size(self.inter_group)}")
        return f"LowBit({fields})"

    def wire_bytes(self, layout: BucketLayout, world_size: int, step=None) -> Optional[int]:
        if self.hierarchical != "none" or world_size <= 1:
            return None
        return wire_bytes_all_reduce(layout.numel, world_size, self.config)
