"""Leave some tensors of every bucket uncompressed: embeddings, norms, biases.

Why: they cost little to send exactly, and under Adam a coordinate that error feedback delivers
in bursts gets a wrong step size, not just a late one. Matching slots are all-reduced as one
exact fp32 buffer beside the inner compressor's rounds on the rest (docs/compressors.md).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .base import BucketLayout, Comm, Compressor, State, TensorSlot, Wrapper

__all__ = ["Exclude", "split_layout"]


@functools.lru_cache(maxsize=1024)      # per step and bucket: name matching is not free
def split_layout(layout: BucketLayout, patterns) -> Tuple[BucketLayout, Tuple[TensorSlot, ...]]:
    """``(compressed sub-layout, excluded slots)``: the sub-layout packs the unmatched slots
    contiguously (same index); the excluded slots keep their offsets in ``layout``."""
    kept, excluded, offset = [], [], 0
    for s in layout.slots:
        if any(fnmatch.fnmatchcase(s.name, p) for p in patterns):
            excluded.append(s)
        else:
            kept.append(TensorSlot(s.name, offset, s.numel, s.shape))
            offset += s.numel
    return BucketLayout(layout.index, tuple(kept), layout.dtype, layout.device), tuple(excluded)


class ExcludeState(State):
    """The inner compressor's state for the compressed sub-layout (``None`` if nothing is left)."""

    def __init__(self, inner: Optional[State]):
        self.inner = inner


@dataclass(frozen=True)
class Exclude(Wrapper, Compressor[ExcludeState]):
    """Send the slots whose names match ``patterns`` as exact fp32, the rest through ``inner``.

    ``inner``: an instance or a registry name; ``patterns``: a non-empty tuple of case-sensitive
    ``fnmatch`` patterns on parameter names.

    Example::

        comp = bitscom.compressors.Exclude("signsgd", patterns=("*emb*", "*norm*", "*.bias"))
    """

    inner: Union[Compressor, str, None] = None
    patterns: tuple = ("*.bias", "*norm*")

    name = "exclude"
    uses_names = True

    def __post_init__(self):
        from .registry import resolve
        inner = resolve(self.inner, "Exclude inner") if self.inner is not None else None
        if inner is None:
            raise ValueError("Exclude needs an inner compressor (an instance or a registry name), got None")
        if isinstance(inner, Exclude):
            raise ValueError(f"Exclude inner must not be another Exclude (give one Exclude all "
                             f"the patterns), got {inner!r}")
        if getattr(inner, "applies_momentum", False):
            raise ValueError(f"Exclude inner must not be a MomentumCorrection: the excluded tensors "
                             f"would get no momentum. Put it outside: MomentumCorrection(Exclude("
                             f"..., patterns)), got {inner!r}")
        object.__setattr__(self, "inner", inner)
        pats = (self.patterns,) if isinstance(self.patterns, str) else self.patterns
        if not isinstance(pats, (tuple, list)) or not pats or \
                not all(isinstance(p, str) and p for p in pats):
            raise ValueError(f"Exclude patterns must be a non-empty tuple of non-empty strings, "
                             f"got {self.patterns!r}")
        object.__setattr__(self, "patterns", tuple(pats))

    def init_state(self, layout: BucketLayout) -> ExcludeState:
        kept, _ = split_layout(layout, self.patterns)
        return ExcludeState(self._inner.init_state(kept) if kept.slots else None)

    def reduce(self, flat, layout, state: ExcludeState, comm: Comm):
        kept, excluded = split_layout(layout, self.patterns)
        if not excluded:
            yield from self._inner.reduce(flat, layout, state.inner, comm)
            return
        exact = torch.cat([flat[s.offset:s.end].float() for s in excluded])
        work = comm.all_reduce(exact)
        if kept.slots:
            skip = {s.offset for s in excluded}
            original = [s for s in layout.slots if s.offset not in skip]    # kept.slots' sources
            sub = torch.cat([flat[s.offset:s.end] for s in original])
            yield from self._inner.reduce(sub, kept, state.inner, comm)
            for src, dst in zip(original, kept.slots):
                flat[src.offset:src.end].copy_(sub[dst.offset:dst.end])
        yield work
        exact.div_(comm.size)
        for s, part in zip(excluded, exact.split([e.numel for e in excluded])):
            flat[s.offset:s.end].copy_(part)
