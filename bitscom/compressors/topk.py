"""Top-k sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018).

Why all-gather: ranks keep different coordinates, so sparse vectors cannot be summed on the wire; with the same k
everywhere one ``all_gather`` of fixed-size (values, indices) records suffices, averaged in rank order (bitwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch

from .base import BucketLayout, Comm, Compressor
from ..validate import choice, flag, number
from .warmup import StartIter, check_start_iter
from ..lowbit.error_feedback import SteppedErrorFeedback

__all__ = ["TopK"]

_INT32_LIMIT = 2 ** 31 - 1
SELECTIONS = ("exact", "sampled")
_SAMPLE_FRACTION, _SAMPLE_MIN, _MARGIN = 0.01, 4096, 1.25


def _native_for(x: torch.Tensor):
    """The native CPU kernels when they apply to ``x`` (contiguous fp32 on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    from ..kernels import cpu_native
    return cpu_native if cpu_native.has_scatter() else None


def _native_topk(x: torch.Tensor):
    """The native selection kernel when it applies to ``x`` (as above, < 2³¹ entries), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    from ..kernels import cpu_native
    if x.numel() > cpu_native.TOPK_MAX_NUMEL or not cpu_native.has_topk():
        return None
    return cpu_native.topk


def _exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    return mag.topk(k, sorted=False).indices


def _sampled_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``mag`` among the entries above a threshold read off a
    strided sample (DGC): whenever at least k pass, the top k are all among them (the same set
    as :func:`_exact_topk` up to ties); else the exact path runs."""
    n = mag.numel()
    stride = max(1, n // max(_SAMPLE_MIN, math.ceil(n * _SAMPLE_FRACTION)))
    if stride == 1 or k * _MARGIN >= n:
        return _exact_topk(mag, k)
    sample = mag[::stride]
    j = min(sample.numel(), max(1, math.ceil(sample.numel() * _MARGIN * k / n)))
    threshold = sample.topk(j, sorted=False).values.min()
    candidates = (mag < threshold).logical_not_().nonzero().flatten()   # NaN stays in, as in topk
    if candidates.numel() < k:
        return _exact_topk(mag, k)
    return candidates[mag[candidates].topk(k, sorted=False).indices]


@dataclass(frozen=True)
class TopK(StartIter, Compressor[SteppedErrorFeedback]):
    """Send the ``ratio`` fraction of largest-magnitude gradient entries (values + indices).

    Args:
        ratio: fraction of each bucket's entries sent, in (0, 1]: fewer bytes, more delayed in the residual.
        error_feedback: keep the unsent entries (without it small coordinates never move).
        per_tensor: pick ``ceil(ratio · numel)`` of *each* tensor (DGC's), so small-gradient tensors still send.
        selection: ``"exact"``, or ``"sampled"``: the same set from above a sampled threshold, less compute.
        start_iter: plain all-reduce steps first (with Adam: ``FrozenVarianceAdamW(freeze_step=start_iter)``).

    Example::

        opt = bitscom.DistributedOptimizer(opt, compression=bitscom.compressors.TopK(ratio=0.05))
    """

    ratio: float = 0.05
    error_feedback: bool = True
    start_iter: int = 0
    per_tensor: bool = False
    selection: str = "exact"

    name = "topk"

    def __post_init__(self):
        number("TopK ratio", self.ratio, minimum=0, maximum=1, inclusive=(False, True))
        flag("TopK error_feedback", self.error_feedback)
        check_start_iter("TopK", self.start_iter)
        flag("TopK per_tensor", self.per_tensor)
        choice("TopK selection", self.selection, SELECTIONS)

    def k_for(self, numel: int) -> int:
        """Entries sent for a bucket of ``numel`` elements: ``ceil(ratio · numel)``, at least 1
        (the ratio read as a fraction, so 0.01 × 100 is exactly 1, not 2 by binary rounding)."""
        if numel == 0:
            return 0
        exact = Fraction(self.ratio).limit_denominator(10 ** 9) * numel
        return max(1, min(numel, math.ceil(exact)))

    def k_of(self, layout: BucketLayout) -> int:
        """Entries one rank sends per compressed step of ``layout`` (``per_tensor``: summed per tensor)."""
        return sum(self.k_for(s.numel) for s in layout.slots) if self.per_tensor else self.k_for(layout.numel)

    def init_state(self, layout: BucketLayout) -> SteppedErrorFeedback:
        return SteppedErrorFeedback.for_layout(layout, enabled=self.error_feedback)

    def compress(self, x: torch.Tensor, k: int, layout: Optional[BucketLayout] = None):
        """``(values, indices)`` of the ``k`` largest ``|x|`` (fp32 values, int64 indices);
        with ``per_tensor`` and a ``layout``, of each tensor's ``k_for(numel)`` largest."""
        values, indices, _ = self._select(x, k, layout, None)
        return values, indices

    def _select(self, x, k, layout, residual):
        """:meth:`compress`, plus whether ``residual[indices] -= values`` was done on the way
        (the native kernel fuses error feedback's sparse update; the torch path does not)."""
        cuts = self._cuts(k, layout)
        native = _native_topk(x)
        if native is not None:                   # the exact set, sampled threshold, ~1 pass
            picks = [native(x[a:b], n, None if residual is None else residual[a:b]) for a, b, n in cuts]
            return _joined([v for v, _ in picks]), _joined([i for _, i in picks], cuts), True
        pick = _sampled_topk if self.selection == "sampled" else _exact_topk
        mag = x.abs()
        indices = _joined([pick(mag[a:b], n) for a, b, n in cuts], cuts)
        return x[indices], indices, False

    def _cuts(self, k, layout) -> list:
        """``(start, end, k)`` of each selection: the whole bucket, or with ``per_tensor`` each non-empty tensor."""
        if self.per_tensor and layout is not None and len(layout.slots) > 1:
            return [(s.offset, s.end, self.k_for(s.numel)) for s in layout.slots if s.numel]
        return [(0, None, k)]

    def compressed(self, flat, layout, state, comm: Comm):
        k = self.k_of(layout)
        if k == 0:
            return
        x = state.compensate(flat)
        residual = state.residual if state.enabled else None
        values, indices, updated = self._select(x, k, layout, residual)
        state.last_sent = indices    # which entries this step sent (MomentumCorrection's masking)
        native = _native_for(flat)
        index_dtype = torch.int32 if flat.numel() <= _INT32_LIMIT else torch.int64
        words = 1 if index_dtype == torch.int32 else 2          # int32 words per index
        record = torch.empty(k * (1 + words), dtype=torch.int32, device=flat.device)
        record[:k] = values.view(torch.int32)
        record[k:] = indices.to(index_dtype).view(torch.int32)
        if not updated and native is not None and state.enabled:   # error feedback's sparse update
            native.scatter(state.residual, indices, values, subtract=True)
        elif not updated:                        # (the native selection fuses update_sparse)
            state.update_sparse(indices, values)
        gathered = torch.empty(comm.size * record.numel(), dtype=torch.int32, device=flat.device)
        yield comm.all_gather(gathered, record)
        if _sum_into(flat, gathered.view(comm.size, -1), k, index_dtype, native):
            state.reset()  # NaN/Inf reached the output (visible to AMP); don't carry it on


def _joined(parts, cuts=None):
    """The cuts' picks as one tensor; with ``cuts``, indices shifted to bucket positions."""
    if cuts is not None:
        parts = [p + a if a else p for p, (a, _, _) in zip(parts, cuts)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sum_into(flat, gathered, k: int, index_dtype, native) -> bool:
    """Average every rank's (values, indices) record into ``flat`` in rank order (bitwise the same on every rank; in
    place when fp32, whose values were read before the all-gather); returns whether any rank sent NaN/Inf."""
    size, numel = gathered.shape[0], flat.numel()
    in_place = flat.dtype == torch.float32 and flat.is_contiguous()
    dense = flat.view(-1).zero_() if in_place else torch.zeros(numel, dtype=torch.float32, device=flat.device)
    fused = native is not None and in_place
    nonfinite = False                      # some rank sent NaN/Inf (the native scatter reports it)
    for r in range(size):                                       # fixed order: bitwise identical
        vals = gathered[r, :k].view(torch.float32)
        if fused:
            nonfinite |= native.scatter(dense, gathered[r, k:].view(index_dtype), vals)
            continue
        idx = gathered[r, k:].contiguous().view(index_dtype).long()
        dense.index_put_((idx,), dense[idx] + vals)
    dense.div_(size)
    if not in_place:
        flat.copy_(dense)
    if not fused:
        nonfinite = not gathered.is_meta and not bool(torch.isfinite(gathered[:, :k].view(torch.float32)).all())
    return nonfinite
