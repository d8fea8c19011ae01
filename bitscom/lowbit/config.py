"""Settings of the low-bit collectives: :class:`LowBitConfig`, one frozen object for every face, stored by canonical
names (``"legacy"`` as ``"residual"``), so configs that differ only in spelling are equal on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .. import kernels
from ..suggest import did_you_mean
from ..validate import choice, flag, instance, number
from .codec import Codec
from .format import FULL_PRECISION, SUPPORTED_BITS

__all__ = ["FULL_PRECISION", "EF_MODES", "EF_MODE_ALIASES", "HIERARCHIES", "BACKEND_OPS", "ALIASES",
           "DEFAULT_STAGE2_BITS", "LowBitConfig", "canonical_ef_mode", "canonical_fingerprint"]

#: Error-feedback modes (see :class:`LowBitConfig`); :data:`EF_MODE_ALIASES` lists other spellings.
EF_MODES = ("none", "residual", "ef21", "ef21_plus")
#: Accepted spellings of a mode: the seed project's ``"legacy"`` is ``"residual"``.
EF_MODE_ALIASES = {"legacy": "residual"}
HIERARCHIES = ("none", "leader", "two_level")
#: Collectives the ``lowbit`` backend can send in low bit (:attr:`LowBitConfig.backend_ops`).
BACKEND_OPS = ("all_reduce", "reduce_scatter", "all_gather")
#: Exact aliases :meth:`LowBitConfig.build` accepts for a setting (older bitscom names).
ALIASES = {"bits": "bitwidth", "stage2_bits": "stage2_bitwidth", "intra_bits": "intra_bitwidth",
           "hierarchical": "hierarchy"}

#: Default width of the requantized reduced shard per first-stage width: never below 4, as stage 2 is not
#: averaged over ranks (alone 0.6-1.1 relative error at 1-2 bits, ~0.12 at 4: docs/lowbit.md, "Stage-2 width").
DEFAULT_STAGE2_BITS = {1: 4, 2: 4, 4: 4, 8: 8, 12: 12, 16: 16, 32: 32}

_WIDTHS = tuple(SUPPORTED_BITS) + (FULL_PRECISION,)


@dataclass(frozen=True)
class LowBitConfig:
    """Settings of the low-bit collectives, one object for every face (``compressors.LowBit``, ``LowBitGroup``, the
    ``lowbit`` backend, ``bitscom.init(bitwidth=...)``: each takes ``config=`` or these names as keywords,
    :meth:`build`); every rank must use equal settings (checked). Each setting: ``docs/lowbit.md``, "Settings".
    Trade-offs: fewer ``bitwidth`` bits, fewer bytes and more error; ``stage2_bitwidth`` costs as many bytes as stage 1
    on a ring but its error is not averaged over ranks; small ``block_size`` tracks magnitudes better at 16 bits of
    scale each; ``stochastic_rounding`` is unbiased at about twice RTN's variance; ``hadamard`` spreads outliers for two
    extra passes over memory; error feedback ``"residual"`` is unbiased over time for one buffer, ``"ef21"`` keeps two
    and returns the estimate, not the raw average; ``hierarchy="leader"`` has fewer inter-node flows, ``"two_level"``
    has every rank carry 1/L of them; smaller ``chunk_size`` overlaps stages better in more, smaller collectives;
    ``simulate_quantization`` gives a setting's accuracy without its bandwidth saving.

    Example::

        cfg = LowBitConfig(bitwidth=4, stochastic_rounding=True, error_feedback=True)
        cfg.error_feedback_mode            # 'residual' (the seed's 'legacy' is accepted too)
        LowBitConfig.build(cfg, bits=2)    # aliases and overrides, validated
    """

    bitwidth: int = 4
    stage2_bitwidth: Optional[int] = None
    block_size: int = 128
    stochastic_rounding: bool = False
    hadamard: bool = False
    error_feedback: bool = False
    error_feedback_mode: Optional[str] = None
    stage2_error_feedback: bool = False
    hierarchy: str = "none"
    intra_bitwidth: int = 8
    local_quantize: bool = False
    chunk_size: Optional[int] = None
    seed: int = 0
    simulate_quantization: bool = False
    backend_ops: tuple = ("all_reduce",)

    def __post_init__(self):
        full = f"{FULL_PRECISION} = full-precision float32"
        choice("bitwidth", self.bitwidth, _WIDTHS, full)
        choice("stage2_bitwidth", self.stage2_bitwidth, _WIDTHS + (None,), full)
        choice("intra_bitwidth", self.intra_bitwidth, _WIDTHS, full)
        kernels.format.check_block_size(self.block_size)
        for name in ("stochastic_rounding", "hadamard", "error_feedback", "stage2_error_feedback",
                     "local_quantize", "simulate_quantization"):
            flag(name, getattr(self, name), f"pick a mode with error_feedback_mode={EF_MODES}" if name == "error_feedback" else "")
        self._resolve_error_feedback()
        choice("hierarchy", self.hierarchy, HIERARCHIES)
        if self.local_quantize and self.hierarchy != "leader":
            raise ValueError("local_quantize=True applies to hierarchy='leader' only, "
                             f"got hierarchy={self.hierarchy!r}")
        if self.chunk_size is not None:
            number("chunk_size", self.chunk_size, minimum=1, integer=True)
        kernels.format.check_seed(self.seed)
        self._resolve_backend_ops()

    def _resolve_error_feedback(self) -> None:
        """Store the canonical mode (``ef21`` + stage-2 feedback = ``ef21_plus``) and its switches."""
        mode = self.error_feedback_mode
        if mode is None:
            mode = "residual" if self.error_feedback else "none"
        mode = canonical_ef_mode(mode)
        if self.error_feedback and mode == "none":
            raise ValueError("error_feedback=True contradicts error_feedback_mode='none'; pass one "
                             f"of them (error_feedback=True means 'residual'; modes: {EF_MODES})")
        if mode == "ef21" and self.stage2_error_feedback:
            mode = "ef21_plus"          # the same algorithm under its one name
        object.__setattr__(self, "error_feedback_mode", mode)
        object.__setattr__(self, "error_feedback", mode != "none")
        object.__setattr__(self, "stage2_error_feedback", self.stage2_error_feedback or mode == "ef21_plus")

    def _resolve_backend_ops(self) -> None:
        ops = self.backend_ops
        if isinstance(ops, str) or not isinstance(ops, (tuple, list, set, frozenset)) \
                or any(op not in BACKEND_OPS for op in ops):
            raise ValueError(f"backend_ops={ops!r} must be a tuple of names from {BACKEND_OPS}")
        object.__setattr__(self, "backend_ops", tuple(op for op in BACKEND_OPS if op in ops))
        if self.ef21 and set(self.backend_ops) - {"all_reduce"}:
            raise ValueError(f"error_feedback_mode={self.error_feedback_mode!r} is defined for all_reduce "
                             f"only; backend_ops={self.backend_ops} also compresses reduce_scatter/all_gather "
                             "(use 'residual' or 'none' there)")

    @classmethod
    def build(cls, config: Optional["LowBitConfig"] = None, **settings) -> "LowBitConfig":
        """``config`` (default: all defaults) with ``settings`` replaced, by their names or
        :data:`ALIASES`; an unknown name is a ``TypeError`` listing the allowed ones."""
        if config is not None:
            instance("config", config, LowBitConfig, "a LowBitConfig")
        names = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for key, value in settings.items():
            name = ALIASES.get(key, key)
            if name not in names:
                raise TypeError(f"unknown low-bit setting {key!r}{did_you_mean(key, list(names) + list(ALIASES))}; "
                                f"the settings are {names} (aliases: {ALIASES})")
            if name in values:
                raise TypeError(f"setting {name!r} given twice (as {key!r} and by its other name)")
            values[name] = value
        if config is None:
            return cls(**values)
        if "error_feedback_mode" in values and "error_feedback" not in values:
            values["error_feedback"] = False       # the mode decides
        if "error_feedback" in values and "error_feedback_mode" not in values:
            values["error_feedback_mode"] = None   # the switch decides
            values.setdefault("stage2_error_feedback", False if config.error_feedback_mode == "ef21_plus"
                              else config.stage2_error_feedback)
        return dataclasses.replace(config, **values)

    @property
    def resolved_stage2_bitwidth(self) -> int:
        return DEFAULT_STAGE2_BITS[self.bitwidth] if self.stage2_bitwidth is None else self.stage2_bitwidth

    @property
    def residual(self) -> bool:
        """Residual error feedback on the first stage (mode ``"residual"``)."""
        return self.error_feedback_mode == "residual"

    @property
    def legacy(self) -> bool:
        """The seed's name of :attr:`residual` (mode ``"legacy"`` = ``"residual"``)."""
        return self.residual

    @property
    def ef21(self) -> bool:
        """EF21 estimates (modes ``"ef21"`` and ``"ef21_plus"``)."""
        return self.error_feedback_mode in ("ef21", "ef21_plus")

    def codec(self, bits: int) -> Codec:
        """The :class:`~bitscom.lowbit.codec.Codec` of a stage at width ``bits``."""
        return Codec(bits, self.block_size, self.stochastic_rounding, self.simulate_quantization)


def canonical_ef_mode(mode) -> str:
    """The canonical name of an error-feedback mode (:data:`EF_MODE_ALIASES` resolved: ``"legacy"`` is
    ``"residual"``); anything but :data:`EF_MODES` is a ``ValueError`` listing them."""
    if isinstance(mode, str):
        mode = EF_MODE_ALIASES.get(mode, mode)
    if mode not in EF_MODES:
        hint = " ('ef' is now called 'legacy', documented as 'residual')" if mode == "ef" else ""
        raise ValueError(f"error_feedback_mode={mode!r} is not one of {EF_MODES} (aliases: "
                         f"{EF_MODE_ALIASES}){hint}")
    return mode


def canonical_fingerprint(text: str) -> str:
    """A settings fingerprint (text holding a :class:`LowBitConfig` ``repr``) with the seed's mode
    spelling made canonical (``error_feedback_mode='legacy'`` becomes ``'residual'``): what a checkpoint
    written before the rename compares equal to."""
    for alias, name in EF_MODE_ALIASES.items():
        text = text.replace(f"error_feedback_mode={alias!r}", f"error_feedback_mode={name!r}")
    return text
