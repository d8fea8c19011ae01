"""Settings of sharded data parallelism (SDP4Bit), validated once, identical on every rank.
Names and defaults are the SDP4Bit Megatron-LM flags' (:mod:`.args`), one to one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernels import format as fmt
from ..ops import Average, ReduceOp, Sum
from ..validate import choice, flag, number

__all__ = ["ShardedConfig", "FULL_PRECISION", "GRADIENT_WIDTHS", "WEIGHT_WIDTHS"]

FULL_PRECISION = 32
"""A gradient stage width of 32 sends raw float32 (no quantization) on that stage."""

WEIGHT_WIDTHS = tuple(fmt.SUPPORTED_BITS)
GRADIENT_WIDTHS = tuple(fmt.SUPPORTED_BITS) + (FULL_PRECISION,)


@dataclass(frozen=True)
class ShardedConfig:
    """What :class:`~bitscom.sharded.ShardedOptimizer` sends and how.

    Attributes:
        quantized_weights: all-gather quantized weight differences (qWD) instead of parameters.
        weight_quantization_bits: width of the differences (small and smooth: 4 bits suffice).
        wq_group_size: elements per scale: larger costs fewer scale bytes, smaller follows magnitudes.
        quantized_gradients: two-level quantized reduce-scatter (TLq); off: exact float32.
        gradient_quantization_bits_intra: width on the fast intra-node links (32 = float32).
        gq_group_size_intra: elements per scale of the intra-node stage.
        gradient_quantization_bits_inter: width on the slow inter-node links (32 = float32).
        gq_group_size_inter: elements per scale of the inter-node stage (128: low 4-bit error).
        hadamard_transform: Hadamard-rotate 32-element runs first (TLq-HS): scales fit, two passes.
        gradient_alltoall_pipeline: chunks per shard: more overlap of the stages, smaller collectives.
        fusion_threshold_mb: bucket cap: larger = fewer collectives, smaller = earlier; 0 = per tensor.
        backward_passes_per_step: backward passes summed locally before one reduce-scatter.
        op: ``bitscom.Average`` (default) or ``bitscom.Sum`` of the ranks' gradients.
        seed: base of the stochastic-rounding seeds (identical on every rank).

    Example::

        cfg = ShardedConfig(quantized_weights=True, quantized_gradients=True,
                            hadamard_transform=True, gradient_alltoall_pipeline=4)
    """

    quantized_weights: bool = False
    weight_quantization_bits: int = 4
    wq_group_size: int = 2048
    quantized_gradients: bool = False
    gradient_quantization_bits_intra: int = 8
    gq_group_size_intra: int = 512
    gradient_quantization_bits_inter: int = 4
    gq_group_size_inter: int = 128
    hadamard_transform: bool = False
    gradient_alltoall_pipeline: int = 1
    fusion_threshold_mb: float = 25
    backward_passes_per_step: int = 1
    op: ReduceOp = Average
    seed: int = 0

    def __post_init__(self):
        for name in ("quantized_weights", "quantized_gradients", "hadamard_transform"):
            flag(name, getattr(self, name))
        choice("weight_quantization_bits", self.weight_quantization_bits, WEIGHT_WIDTHS)
        for name in ("gradient_quantization_bits_intra", "gradient_quantization_bits_inter"):
            choice(name, getattr(self, name), GRADIENT_WIDTHS)
        for name in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter"):
            fmt.check_block_size(getattr(self, name), name)
        for name in ("gradient_alltoall_pipeline", "backward_passes_per_step"):
            number(name, getattr(self, name), minimum=1, integer=True)
        number("fusion_threshold_mb", self.fusion_threshold_mb, minimum=0, finite=True)
        choice("op", self.op, (Average, Sum))
        fmt.check_seed(self.seed)
        if self.hadamard_transform and not self.quantized_gradients:
            raise ValueError("hadamard_transform=True smooths gradient quantization; it needs "
                             "quantized_gradients=True")

    @property
    def fusion_threshold_bytes(self) -> int:
        return int(self.fusion_threshold_mb * 2 ** 20)

    def describe(self) -> dict:
        """A plain dict (for the cross-rank agreement check and checkpoints)."""
        out = dataclasses.asdict(self)
        out["op"] = self.op.value
        return out
