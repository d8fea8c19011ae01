"""LowBit: blockwise low-bit two-stage all-reduce as a DistributedOptimizer compressor.

A thin adapter: the algorithm lives in :mod:`bitscom.collectives` (shared with
:class:`bitscom.LowBitGroup` and the ``lowbit`` backend) and the settings in one
:class:`~bitscom.collectives.LowBitConfig`; this class holds that config, the hierarchy's
groups, and one :class:`~bitscom.collectives.LowBitState` per bucket (error-feedback buffers
and the step that keys stochastic-rounding seeds), checkpointed with the optimizer.
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
    """Two-stage low-bit all-reduce of each bucket (quantize shards -> all-to-all -> sum ->
    requantize -> all-gather), flat or hierarchical.

    Takes a :class:`~bitscom.collectives.LowBitConfig` (``config=``) or its settings as
    keywords, by the same names (``bitwidth``, ``error_feedback``, ``error_feedback_mode``,
    ``stage2_bitwidth``, ``block_size``, ``stochastic_rounding``, ``hadamard``,
    ``stage2_error_feedback``, ``hierarchy``, ``intra_bitwidth``, ``local_quantize``,
    ``chunk_size``, ``seed``, ``simulate_quantization``; see the config for each trade-off).
    A hierarchical compressor also needs ``intra_group`` and ``inter_group`` (e.g.
    ``bitscom.intra_group()``, ``bitscom.inter_group()``); use them for this optimizer only:
    all of its collectives are issued from the engine's in-order later rounds, which keeps
    their order identical on every rank.

    Wire cost of the flat scheme, per rank and bucket of n elements: n·(bitwidth + 16/block_size)/8
    bytes of all-to-all plus n/P·(stage2_bitwidth + 16/block_size)/8 of all-gather input.

    Example::

        comp = bitscom.compressors.LowBit(bitwidth=4, error_feedback=True)
        opt = bitscom.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=comp)
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
        # The cost model's local run hands a transport that emulates the node groups (bitscom.cost.local).
        levels = getattr(comm.transport, "levels", None)
        intra, inter = levels() if levels is not None else (Comm(self.intra_group), Comm(self.inter_group))
        # Issue nothing in the first round: every collective then runs as a later round, which the
        # engine starts strictly in bucket order, so intra/inter groups see one order everywhere.
        yield None
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
