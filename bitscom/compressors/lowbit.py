"""LowBit: blockwise low-bit two-stage all-reduce as a compressor; a thin adapter over
:mod:`bitscom.lowbit` (shared with :class:`bitscom.LowBitGroup` and the ``lowbit`` backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..lowbit import LowBitConfig, LowBitState, all_reduce_rounds
from .base import BucketLayout, Comm, Compressor

__all__ = ["LowBit"]


@dataclass(frozen=True, init=False)
class LowBit(Compressor[LowBitState]):
    """Two-stage low-bit all-reduce of each bucket (quantize shards -> all-to-all -> sum -> requantize -> all-gather),
    flat or hierarchical, from a :class:`~bitscom.collectives.LowBitConfig` (``config=``) or its settings as keywords;
    a hierarchical one also needs ``intra_group`` and ``inter_group``, for this optimizer only.

    Example::

        comp = bitscom.compressors.LowBit(bitwidth=4, error_feedback=True)   # then compression=comp
    """

    name = "lowbit"
    models_on_meta = False      # its rank-by-rank rows run faster on real data (see Compressor)

    config: LowBitConfig
    intra_group: Any = field(default=None, compare=False, repr=False)
    inter_group: Any = field(default=None, compare=False, repr=False)

    def __init__(self, config: Optional[LowBitConfig] = None, *, intra_group=None, inter_group=None,
                 **settings):
        cfg = LowBitConfig.build(config, **settings)  # validates every setting, naming the bad value
        object.__setattr__(self, "config", cfg)
        object.__setattr__(self, "intra_group", intra_group)
        object.__setattr__(self, "inter_group", inter_group)
        if cfg.hierarchy != "none" and (intra_group is None or inter_group is None):
            raise ValueError(f"hierarchy={cfg.hierarchy!r} needs intra_group and inter_group, "
                             "e.g. LowBit(..., intra_group=bitscom.intra_group(), "
                             "inter_group=bitscom.inter_group())")

    def init_state(self, layout: BucketLayout) -> LowBitState:
        return LowBitState()

    def reduce(self, flat, layout, state, comm):
        cfg = self.config
        if cfg.hierarchy == "none":
            yield from all_reduce_rounds(flat, comm, cfg, state, average=True, key=layout.index)
            return
        levels = getattr(comm.transport, "levels", None)     # the cost model's LocalTransport
        intra, inter = levels() if levels is not None else (Comm(self.intra_group), Comm(self.inter_group))
        yield None      # nothing in round one: later rounds start in bucket order on every rank
        try:
            yield from all_reduce_rounds(flat, None, cfg, state, average=True, key=layout.index,
                                         intra=intra, inter=inter)
        finally:
            comm.bytes_sent += intra.bytes_sent + inter.bytes_sent

    def fingerprint(self) -> str:
        text = repr(self.config)
        if self.config.hierarchy != "none":
            text += (f", intra_size={dist.get_world_size(self.intra_group)}, "
                     f"inter_size={dist.get_world_size(self.inter_group)}")
        return f"LowBit({text})"
