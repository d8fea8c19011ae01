"""Settings of :class:`~bitscom.onebit.OneBitAdam` and :class:`~bitscom.onebit.ZeroOneAdam`:
frozen, validated once, compared across ranks at construction."""

from __future__ import annotations

from dataclasses import dataclass

from .. import validate
from ..lowbit import LowBitConfig

__all__ = ["OneBitConfig", "ZeroOneConfig", "OverlapConfig", "momentum_codec"]


def check_common(owner: str, lr, betas, eps, weight_decay) -> tuple:
    """The Adam settings both optimizers share; returns ``betas`` as a tuple."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        validate.number(f"{owner} {name}", value, minimum=0, finite=True)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{owner} betas must be a pair (beta1, beta2), got {betas!r}")
    validate.numbers(f"{owner} betas", betas, minimum=0, maximum=1, inclusive=(True, False))
    return (float(betas[0]), float(betas[1]))


def momentum_codec(block_size: int, stage2_bits: int) -> LowBitConfig:
    """The two-stage 1-bit all-reduce with worker AND server error feedback (DeepSpeed's
    ``compressed_allreduce``): each rank sends ``C(x + e_worker)`` chunk-wise (all-to-all), the
    owner of a chunk averages, requantizes with its server error and all-gathers. The 1-bit
    code is sign × mean|x| per ``block_size`` block (DeepSpeed: ``||x||/sqrt(n)`` per chunk)."""
    return LowBitConfig(bitwidth=1, stage2_bitwidth=stage2_bits, block_size=block_size,
                        error_feedback_mode="residual", stage2_error_feedback=True)


@dataclass(frozen=True)
class OneBitConfig:
    """Settings of :class:`~bitscom.onebit.OneBitAdam` other than the per-group ``lr`` / ``weight_decay``.

    Attributes:
        betas, eps: Adam's (one pair for the whole model: the momentum is one flat buffer).
        freeze_step: exact warm-up steps (>= 1); too few freeze ``v`` early, too many cost bytes.
        block_size: elements per 1-bit scale: smaller follows magnitudes, at 16/block_size bits.
        stage2_bits: server stage width (1 as DeepSpeed; 4 halves its error for 3 more bits).
        bias_correction: Adam's, frozen with ``v`` (False: DeepSpeed's arithmetic, docs/onebit.md).
    """

    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    freeze_step: int = 100
    block_size: int = 2048
    stage2_bits: int = 1
    bias_correction: bool = True

    def __post_init__(self):
        validate.number("OneBitAdam freeze_step", self.freeze_step, minimum=1, integer=True,
                        why="the exact warm-up that estimates the variance; 0 would freeze it at zero")
        _check_codec("OneBitAdam", self.block_size, self.stage2_bits)
        validate.flag("OneBitAdam bias_correction", self.bias_correction)

    @property
    def codec(self) -> LowBitConfig:
        return momentum_codec(self.block_size, self.stage2_bits)


@dataclass(frozen=True)
class ZeroOneConfig:
    """Settings of :class:`~bitscom.onebit.ZeroOneAdam` other than ``lr`` / ``weight_decay``.

    Attributes:
        betas, eps, block_size, stage2_bits: as :class:`OneBitConfig`.
        var_freeze_step: the last step that may update the variance (the end of the lr warm-up).
        var_update_scaler: kappa: variance updates per doubling of their interval (1, 2, 4, ...).
        local_step_scaler: frozen steps per doubling of the local-step interval ...
        local_step_clipper: ... up to H local steps between syncs: fewer bytes, more drift.
        bias_correction: as :class:`OneBitConfig` (``k`` = the exact variance updates so far).
    """

    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    var_freeze_step: int = 100
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16
    block_size: int = 2048
    stage2_bits: int = 1
    bias_correction: bool = True

    def __post_init__(self):
        validate.flag("ZeroOneAdam bias_correction", self.bias_correction)
        validate.number("ZeroOneAdam var_freeze_step", self.var_freeze_step, minimum=1, integer=True,
                        why="the variance needs at least one exact update")
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            validate.number(f"ZeroOneAdam {name}", getattr(self, name), minimum=1, integer=True)
        _check_codec("ZeroOneAdam", self.block_size, self.stage2_bits)

    @property
    def codec(self) -> LowBitConfig:
        return momentum_codec(self.block_size, self.stage2_bits)


def _check_codec(owner: str, block_size, stage2_bits) -> None:
    validate.choice(f"{owner} stage2_bits", stage2_bits, (1, 2, 4, 8))
    try:
        momentum_codec(block_size, stage2_bits)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{owner} block_size={block_size!r}: {err}") from None


@dataclass(frozen=True)
class OverlapConfig:
    """How the 1-bit optimizers overlap their all-reduce with backward. Kept apart from the
    algorithm's settings: it changes when bytes move, never which bits arrive, so a checkpoint
    loads with either choice.

    Attributes:
        overlap: send each bucket from the gradient hooks; same bits, but ``p.grad`` must reach
            step() as backward left it (clipping, GradScaler: refused). Default False.
        bucket_mb: largest bucket (MiB): smaller sends earlier, larger costs fewer collectives.
        backward_passes_per_step: with ``overlap``, the buckets leave on the last of these passes.
    """

    overlap: bool = False
    bucket_mb: float = 25.0
    backward_passes_per_step: int = 1

    def __post_init__(self):
        validate.flag("overlap", self.overlap)
        validate.number("bucket_mb", self.bucket_mb, minimum=0.0, inclusive=(False, True), finite=True)
        validate.number("backward_passes_per_step", self.backward_passes_per_step, minimum=1, integer=True)

    def max_elements(self, block_size: int) -> int:
        """Elements per bucket: whole 1-bit blocks, at least one."""
        return max(block_size, int(self.bucket_mb * 2 ** 20) // 4 // block_size * block_size)
