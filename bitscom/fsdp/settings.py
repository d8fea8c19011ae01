"""What :func:`bitscom.fsdp.compress` accepts: the gradient settings (meaningless ones are refused,
not silently ignored) and the torch hook it needs."""

from __future__ import annotations

import torch

from ..lowbit.config import LowBitConfig
from ..lowbit.format import FULL_PRECISION, SUPPORTED_BITS
from ..validate import choice, instance

__all__ = ["gradient_config", "require_hook", "LOWBIT_WIDTHS"]

LOWBIT_WIDTHS = f"{tuple(SUPPORTED_BITS) + (FULL_PRECISION,)} ({FULL_PRECISION}: exact float32)"
"""The int bit widths ``gradients=`` and HSDP's ``replicate=`` accept, in their TypeError's words."""


def gradient_config(gradients) -> LowBitConfig:
    """The :class:`~bitscom.lowbit.LowBitConfig` of the gradient reduce-scatter: ``gradients``
    itself, or ``LowBitConfig(bitwidth=gradients)`` for an int.

    Example::

        gradient_config(4)                                          # 4-bit, flat
        gradient_config(LowBitConfig(bitwidth=4, hierarchy="two_level", hadamard=True))
    """
    if isinstance(gradients, int) and not isinstance(gradients, bool):
        gradients = LowBitConfig(bitwidth=gradients)
    cfg = instance("gradients", gradients, LowBitConfig,
                   f"a bitscom.lowbit.LowBitConfig or an int bit width, one of {LOWBIT_WIDTHS}")
    if cfg.ef21:
        raise ValueError(f"error_feedback_mode={cfg.error_feedback_mode!r} is defined for all_reduce "
                         "only; the FSDP reduce-scatter allows 'residual' or 'none'")
    if cfg.stage2_error_feedback:
        raise ValueError("stage2_error_feedback=True has no meaning here: a reduce-scatter has no "
                         "second (all-gather) stage; leave it False")
    choice("the FSDP reduce-scatter's hierarchy", cfg.hierarchy, ("none", "two_level"))
    if cfg.hierarchy == "two_level" and cfg.error_feedback:
        raise ValueError("error_feedback with hierarchy='two_level' is not supported (the level-wise "
                         "reduce-scatter keeps no residual); use hierarchy='none' for error feedback")
    if cfg.chunk_size is not None:
        raise ValueError(f"chunk_size={cfg.chunk_size!r} is not used by the FSDP reduce-scatter "
                         "(one round per FSDP parameter group); leave it None")
    return cfg


def require_hook(cls, name: str) -> None:
    """Raise a ``RuntimeError`` naming the torch version when FSDP2's ``name`` hook is missing.

    Example::

        require_hook(FSDPModule, "set_custom_reduce_scatter")
    """
    if not hasattr(cls, name):
        raise RuntimeError(f"bitscom.fsdp needs FSDPModule.{name}, which torch {torch.__version__} "
                           "does not have; use a torch whose FSDPModule has it (2.13 is tested)")
