"""Top-k sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018).

Why all-gather and not all-reduce: each rank keeps a different set of coordinates, so the
sparse vectors cannot be summed on the wire. With the same k on every rank every message has
the same size, so one ``all_gather`` of fixed-size (values, indices) records suffices and no
size exchange round is needed.

Algorithm, per bucket and step:

1. ``x = g + e`` (error feedback, :class:`~bitscom.compressors.error_feedback.ErrorFeedback`);
2. pick the ``k = ceil(ratio · numel)`` entries of largest ``|x|``;
3. all-gather one record per rank: k fp32 values followed by k indices (int32 while the
   bucket has < 2³¹ elements, else int64), in one buffer;
4. every rank adds rank 0's values into a zero dense buffer, then rank 1's, … (indices are
   unique within a rank, so each addition is a gather-add-scatter with no races) — the same
   order everywhere, hence bitwise-identical results — and divides by N;
5. ``e = x − (x at the chosen indices)``: the sent entries are zeroed in the residual.

Wire cost per rank and step: ``k · (4 + 4)`` bytes (``k · (4 + 8)`` for buckets of ≥ 2³¹
elements), against ``4 · numel`` for fp32 all-reduce. The receive side grows with N (each
rank receives N·k records), which is top-k's weakness on many ranks.
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
    """The native selection kernel when it applies to ``x`` (contiguous fp32 on the CPU, fewer
    than 2³¹ entries), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    from ..kernels import cpu_native
    if x.numel() > cpu_native.TOPK_MAX_NUMEL or not cpu_native.has_topk():
        return None
    return cpu_native.topk


def _exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    return mag.topk(k, sorted=False).indices


def _sampled_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of ``mag`` (the same set as :func:`_exact_topk` up to ties),
    found among the entries above a threshold read off a strided sample (DGC, Lin et al. 2018).

    Every entry of the true top k is >= the k-th largest value; whenever at least k entries
    pass the threshold, that value is >= the threshold, so the top k are all candidates and
    topk over the candidates finds them. The threshold sits at the sample's
    ``_MARGIN * k / n`` quantile, so about ``1.25 k`` pass; otherwise the exact path runs."""
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
        ratio: fraction of each bucket's entries sent, in (0, 1]. Smaller sends less
            (``8·k`` bytes vs ``4·numel``) but delays more of the gradient in the residual.
            The default 0.05 (10× fewer bytes) stays within 0.1 pp of S-SGD on the digits
            test, where the literature's 0.01 (50× fewer) lost 1 pp (docs/convergence.md);
            both need error feedback. 1 sends everything (exact, 2× fp32's bytes).
        error_feedback: keep the unsent entries and add them to the next gradient. Without
            it the small coordinates are never updated.
        per_tensor: pick ``ceil(ratio · numel)`` entries of *each* tensor of the bucket (DGC's
            layer-wise selection) instead of the bucket's largest overall. With one pick per
            bucket, tensors whose gradients are small next to the others' (narrow layers,
            norm gains) are starved and then delivered in rare, stale bursts; per tensor,
            every layer moves every step. Same wire format and about the same bytes (each
            tensor's count is rounded up).
        selection: how the ``k`` entries are found. ``"exact"`` (default): ``torch.topk`` over
            the whole bucket. ``"sampled"`` (DGC-style, opt-in): a threshold from every
            ``stride``-th magnitude (about 1% of the bucket, at least 4096), a little below the
            sample's top-``ratio`` quantile, then ``torch.topk`` over the few entries above it
            only; if fewer than ``k`` pass, the exact selection runs. It picks the same entries as
            ``"exact"`` (up to ties at the k-th magnitude), so the average and the residual are
            the same, at a fraction of the compute; only the order of the records on the wire
            differs. Deterministic (no random numbers). On the CPU with fp32 buckets and the
            native library (the usual case) both settings run one native kernel instead: the
            sampled threshold, then an exact selection among the candidates (all entries when
            too few pass), the sparse error-feedback update fused in, records in ascending index
            order; the same entries as ``torch.topk`` (lower index first among equal
            magnitudes), about 5× less compute per BERT-base step (docs/benchmarks.md).
        start_iter: plain all-reduce of the bucket (its dtype, full bytes) for the first
            ``start_iter`` steps of the bucket, as PowerSGD's warm-up and DGC's. With Adam,
            pair it with :class:`bitscom.FrozenVarianceAdamW` (``freeze_step ==
            start_iter``): Adam's variance of error-fed sparse updates is wrong
            (docs/convergence.md).

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
        """Entries sent for a bucket of ``numel`` elements: ``ceil(ratio · numel)``, at least 1.

        The ratio is read as the nearest fraction with a denominator ≤ 10⁹, so 0.01 × 100
        is exactly 1 and not 2 through binary rounding.
        """
        if numel == 0:
            return 0
        exact = Fraction(self.ratio).limit_denominator(10 ** 9) * numel
        return max(1, min(numel, math.ceil(exact)))

    def k_of(self, layout: BucketLayout) -> int:
        """Entries one rank sends per compressed step of ``layout``: :meth:`k_for` of the
        bucket, or with ``per_tensor`` the sum of :meth:`k_for` of each tensor."""
        if not self.per_tensor:
            return self.k_for(layout.numel)
        return sum(self.k_for(s.numel) for s in layout.slots)

    @staticmethod
    def _index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel <= _INT32_LIMIT else torch.int64

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
        """``(start, end, k)`` of each selection: the whole bucket, or with ``per_tensor`` each
        non-empty tensor."""
        if self.per_tensor and layout is not None and len(layout.slots) > 1:
            return [(s.offset, s.end, self.k_for(s.numel)) for s in layout.slots if s.numel]
        return [(0, None, k)]

    def compressed(self, flat, layout, state, comm: Comm):
        numel = flat.numel()                     # == layout.numel: callers pass the bucket's flat
        k = self.k_of(layout)
        if k == 0:
            return
        x = state.compensate(flat)
        residual = state.residual if state.enabled else None
        values, indices, updated = self._select(x, k, layout, residual)
        state.last_sent = indices    # which entries this step sent (MomentumCorrection's masking)
        native = _native_for(flat)
        index_dtype = self._index_dtype(numel)
        words = 1 if index_dtype == torch.int32 else 2          # int32 words per index
        record = torch.empty(k * (1 + words), dtype=torch.int32, device=flat.device)
        record[:k] = values.view(torch.int32)
        record[k:] = indices.to(index_dtype).view(torch.int32)
        if not updated:                            # (the native selection fuses update_sparse)
            _keep_residual(state, native, indices, values)
        gathered = torch.empty(comm.size * record.numel(), dtype=torch.int32, device=flat.device)
        yield comm.all_gather(gathered, record)
        nonfinite = _sum_into(flat, gathered.view(comm.size, -1), k, index_dtype, native)
        if nonfinite:
            state.reset()  # NaN/Inf reached the output (visible to AMP); don't carry it on


def _joined(parts, cuts=None):
    """The cuts' picks as one tensor; with ``cuts``, indices shifted to bucket positions."""
    if cuts is not None:
        parts = [p + a if a else p for p, (a, _, _) in zip(parts, cuts)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _keep_residual(state, native, indices, values) -> None:
    """Error feedback's sparse update: the sent entries leave the residual."""
    if native is not None and state.enabled:
        native.scatter(state.residual, indices, values, subtract=True)
    else:
        state.update_sparse(indices, values)


def _sum_into(flat, gathered, k: int, index_dtype, native) -> bool:
    """Average every rank's (values, indices) record into ``flat``, in rank order (bitwise the
    same on every rank); returns whether any rank sent NaN/Inf.

    Sums into the bucket itself when it is fp32 (its values were read before the all-gather):
    the same zeros-then-adds as a separate dense buffer, without a bucket-sized allocation."""
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
