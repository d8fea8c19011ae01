"""Shared machinery of the low-rank compressors (PowerSGD, ACP-SGD): each gradient of a bucket is a matrix M of
shape (shape[0], -1), sent as factors P (n × r) and Q (m × r), M ≈ P Qᵀ. The plan (a pure function of the layout)
and the initial factors (a state-owned CPU generator) are identical on ranks; factors travel in fp32 whatever the
gradient dtype (the residual is fp32, and orthogonalizing half-precision factors underflows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple, TypeVar

import torch

from ..validate import choice, flag, number
from .base import BucketLayout, Compressor, State
from .warmup import StartIter
from .error_feedback import ErrorFeedback

__all__ = ["ORTHOGONALIZATIONS", "LowRankCompressor", "MatrixGroup", "LowRankPlan", "LowRankState", "orthogonalize",
           "project", "random_factors", "bucket_generator", "check_low_rank_settings", "forget_if_nonfinite"]

ORTHOGONALIZATIONS = ("auto", "gram_schmidt", "qr")
_HALF = (torch.float16, torch.bfloat16)


def check_low_rank_settings(settings) -> None:
    """Constructor validation shared by the low-rank compressors (naming the bad value)."""
    for name, low in (("rank", 1), ("seed", 0), ("start_iter", 0)):
        number(name, getattr(settings, name), minimum=low, integer=True)
    number("min_compression_rate", settings.min_compression_rate, minimum=0, inclusive=False)
    for name in ("error_feedback", "warm_start", "batch_same_shape"):
        flag(name, getattr(settings, name))
    choice("orthogonalization", settings.orthogonalization, ORTHOGONALIZATIONS)


LowRankStateT = TypeVar("LowRankStateT", bound="LowRankState")


@dataclass(frozen=True)
class LowRankCompressor(StartIter, Compressor[LowRankStateT]):
    """Settings both low-rank compressors share (each redeclares ``rank`` and ``start_iter``)."""

    #: Approximation rank r: bytes grow linearly with r, and so does fidelity (try 1, 2, 4…).
    rank: int = 1
    #: Plain all-reduce steps first: protects the sensitive early phase, costs full bytes.
    start_iter: int = 0
    #: Send a matrix uncompressed unless its factors are this many times smaller (saves compute).
    min_compression_rate: float = 2
    #: Carry what was not sent into the next step: needed for accuracy; one bucket-sized buffer.
    error_feedback: bool = True
    #: Reuse the last reduced factor (a power iteration spread over steps); no extra bytes.
    warm_start: bool = True
    #: Gram–Schmidt ("gram_schmidt": fast for thin r, half-safe), "qr" (larger r) or "auto".
    orthogonalization: str = "auto"
    #: One bmm per group of same-shaped matrices: fewer kernel launches; may copy to batch.
    batch_same_shape: bool = True
    #: Seed of the initial factors (with the bucket index); must match on ranks (checked).
    seed: int = 0

    #: The cost model's shape-less bucket is the most nearly square matrix (the best case).
    matrix_buckets = True

    def __post_init__(self):
        check_low_rank_settings(self)

    def plan(self, layout: BucketLayout) -> "LowRankPlan":
        """Which slots of ``layout`` are compressed, and the fused buffer sizes."""
        return LowRankPlan(layout, self.rank, self.min_compression_rate, self.batch_same_shape)


@dataclass(frozen=True)
class MatrixGroup:
    """Same-shaped matrices of one bucket, processed as one (B, n, m) batch: ``offsets`` in the
    flat bucket; ``p_offset``/``q_offset`` where its factors start in the fused buffers."""

    n: int
    m: int
    r: int
    offsets: Tuple[int, ...]
    p_offset: int
    q_offset: int

    @property
    def batch(self) -> int:
        return len(self.offsets)

    @property
    def _stride(self) -> Optional[int]:
        """Distance between consecutive slots when evenly spaced (a zero-copy batch view)."""
        return self._runs[0][2] if len(self._runs) == 1 else None

    @cached_property
    def _runs(self) -> Tuple[Tuple[int, int, int], ...]:
        """``(first, count, stride)``: the group cut into runs of evenly spaced slots."""
        runs: List[Tuple[int, int, int]] = []
        i = 0
        while i < self.batch:
            stride = self.offsets[i + 1] - self.offsets[i] if i + 1 < self.batch else self.n * self.m
            count = 1
            while i + count < self.batch and self.offsets[i + count] - self.offsets[i + count - 1] == stride:
                count += 1
            runs.append((i, count, stride))
            i += count
        return tuple(runs)

    def views(self, flat: torch.Tensor) -> List[Tuple[slice, torch.Tensor]]:
        """Zero-copy (count, n, m) views of this group's matrices in ``flat``, one per run, each
        with the slice of the batch it covers (no stacked copy as :meth:`load` makes)."""
        base = flat.storage_offset()
        return [(slice(i, i + count),
                 flat.as_strided((count, self.n, self.m), (stride, self.m, 1),
                                 base + self.offsets[i]))
                for i, count, stride in self._runs]

    def load(self, flat: torch.Tensor) -> torch.Tensor:
        """The (B, n, m) batch in ``flat``: a view when evenly spaced, else a stacked copy."""
        if self._stride is not None:
            return self.views(flat)[0][1]
        return torch.stack([flat[o:o + self.n * self.m].view(self.n, self.m) for o in self.offsets])

    def store(self, flat: torch.Tensor, value: torch.Tensor) -> None:
        """Write a (B, n, m) batch back into this group's slots of ``flat``."""
        for cut, view in self.views(flat):
            view.copy_(value[cut])

    def _native(self, flat: torch.Tensor, *factors: torch.Tensor):
        """The native kernels when they apply (contiguous fp32 CPU bucket and factors, rank <= 64)."""
        if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in (flat, *factors)):
            return None
        from ..kernels import cpu_native
        if self.r > cpu_native.LOWRANK_MAX_RANK or not cpu_native.has_lowrank():
            return None
        return cpu_native

    def _addresses(self, flat: torch.Tensor) -> List[int]:
        base, size = flat.data_ptr(), flat.element_size()
        return [base + o * size for o in self.offsets]

    def _add(self, flat: torch.Tensor, grad: torch.Tensor) -> None:
        size = self.n * self.m
        for o in self.offsets:
            flat[o:o + size].add_(grad[o:o + size])

    def project(self, flat: torch.Tensor, factor: torch.Tensor, out: torch.Tensor, transpose: bool,
                grad: Optional[torch.Tensor] = None, subtract: bool = False) -> None:
        """:func:`project` of this group's matrices in ``flat`` into ``out``; with ``grad``, ``flat[group] +=
        grad[group]`` first (the compensate); with ``subtract``, then ``flat[group] -= P Qᵀ`` (error feedback's update);
        both fused into the native pass. CPUs go matrix by matrix (the bits of a stacked copy); GPUs keep one batched
        call (cuBLAS may pick another kernel per batch count)."""
        native = self._native(flat, factor, out)
        if grad is not None and (native is None or self._native(grad) is None):
            self._add(flat, grad)
            grad = None
        if native is not None:              # one pass per matrix, no temporary (native kernel)
            grads = self._addresses(grad) if grad is not None else [None] * self.batch
            for b, (ptr, g) in enumerate(zip(self._addresses(flat), grads)):
                native.lowrank_project(ptr, self.n, self.m, factor[b], out[b], transpose, subtract, g)
            return
        if flat.device.type != "cpu":
            project(self.load(flat), factor, out, transpose)
        else:
            for cut, mat in self.views(flat):
                project(mat, factor[cut], out[cut], transpose)
        if subtract:
            p, q = (factor, out) if transpose else (out, factor)
            self.sub_product(flat, p, q)

    def set_product(self, flat: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``flat[group] = P Qᵀ``: the native kernel, else ``bmm(out=...)`` into each run's row-major view (no
        temporary), else through a temporary (another dtype than the fp32 factors, uneven GPU slots)."""
        native = self._native(flat, p, q)
        if native is not None:      # same bits on every CPU (no FMA, fixed order): native kernel
            for b, ptr in enumerate(self._addresses(flat)):
                native.lowrank_product(ptr, self.n, self.m, p[b], q[b])
        elif flat.dtype == p.dtype and flat.device.type == "cpu":
            for cut, view in self.views(flat):
                torch.bmm(p[cut], q[cut].transpose(1, 2), out=view)
        elif flat.dtype == p.dtype and self._stride is not None and self.load(flat).is_contiguous():
            torch.bmm(p, q.transpose(1, 2), out=self.load(flat))
        else:
            self.store(flat, torch.bmm(p, q.transpose(1, 2)))

    def sub_product(self, flat: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``flat[group] -= P Qᵀ`` (the error-feedback update)."""
        if self._stride is not None:
            self.load(flat).baddbmm_(p, q.transpose(1, 2), alpha=-1)
        else:
            size = self.n * self.m
            for o, pi, qi in zip(self.offsets, p, q):
                flat[o:o + size].view(self.n, self.m).addmm_(pi, qi.t(), alpha=-1)

    def p(self, buf: torch.Tensor) -> torch.Tensor:
        """This group's P factors, a (B, n, r) view into the fused P buffer."""
        return buf[self.p_offset:self.p_offset + self.batch * self.n * self.r].view(
            self.batch, self.n, self.r)

    def q(self, buf: torch.Tensor) -> torch.Tensor:
        """This group's Q factors, a (B, m, r) view into the fused Q buffer."""
        return buf[self.q_offset:self.q_offset + self.batch * self.m * self.r].view(
            self.batch, self.m, self.r)


class LowRankPlan:
    """How one bucket is split into compressed matrix groups and uncompressed runs.

    A slot is compressed when it has at least 2 dimensions and
    ``(n + m) * r * min_compression_rate < n * m`` with ``r = min(n, m, rank)`` (PyTorch's
    ``_should_compress``); everything else is averaged exactly, in the fused buffer's tail.
    """

    def __init__(self, layout: BucketLayout, rank: int, min_compression_rate: float,
                 batch_same_shape: bool = True):
        by_shape: dict = {}
        runs: List[List[int]] = []
        for slot in layout.slots:
            n = slot.shape[0] if len(slot.shape) >= 2 else 0
            m = slot.numel // n if n else 0
            r = min(n, m, rank)
            if n and m and (n + m) * r * min_compression_rate < n * m:
                key = (n, m) if batch_same_shape else (n, m, slot.offset)
                by_shape.setdefault(key, []).append(slot.offset)
            elif slot.numel:
                if runs and runs[-1][0] + runs[-1][1] == slot.offset:
                    runs[-1][1] += slot.numel
                else:
                    runs.append([slot.offset, slot.numel])
        groups, p_off, q_off = [], 0, 0
        for (n, m, *_), offsets in by_shape.items():
            r = min(n, m, rank)
            groups.append(MatrixGroup(n, m, r, tuple(offsets), p_off, q_off))
            p_off += len(offsets) * n * r
            q_off += len(offsets) * m * r
        self.groups: Tuple[MatrixGroup, ...] = tuple(groups)
        self.runs: Tuple[Tuple[int, int], ...] = tuple((o, k) for o, k in runs)
        self.p_numel, self.q_numel = p_off, q_off
        self.uncompressed_numel = sum(k for _, k in self.runs)
        self.compressed_numel = sum(g.batch * g.n * g.m for g in self.groups)
        self.numel = layout.numel

    @cached_property
    def _outside_groups(self) -> Tuple[Tuple[int, int], ...]:
        """``(offset, numel)`` of everything of the bucket no matrix group covers."""
        covered = sorted((o, o + g.n * g.m) for g in self.groups for o in g.offsets)
        out, at = [], 0
        for start, end in covered:
            if start > at:
                out.append((at, start - at))
            at = max(at, end)
        if at < self.numel:
            out.append((at, self.numel - at))
        return tuple(out)

    def native_compensate(self, ef: ErrorFeedback, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """When every group runs the native kernels on ``grad``: add ``grad`` into the residual
        everywhere *but* the matrices (the kernels add those on their pass) and return the
        residual; else None. Together the same bits as ``ef.compensate(grad)``."""
        if not ef.enabled or not self.groups or not all(g._native(grad) is not None for g in self.groups):
            return None
        x = ef.ensure(grad.numel(), grad.device)
        for offset, numel in self._outside_groups:
            x[offset:offset + numel].add_(grad[offset:offset + numel])
        return x

    def gather_uncompressed(self, flat: torch.Tensor, tail: torch.Tensor) -> None:
        """Copy the uncompressed slots of ``flat`` into ``tail`` (length uncompressed_numel)."""
        if self.runs:
            torch.cat([flat[offset:offset + numel] for offset, numel in self.runs], out=tail)

    def zero_uncompressed(self, flat: torch.Tensor) -> None:
        """Zero the uncompressed slots (their error-feedback residual: they are sent exactly)."""
        for offset, numel in self.runs:
            flat[offset:offset + numel].zero_()

    def scatter_uncompressed(self, tail: torch.Tensor, flat: torch.Tensor) -> None:
        """Inverse of :meth:`gather_uncompressed`."""
        for (offset, numel), part in zip(self.runs, tail.split([numel for _, numel in self.runs])):
            flat[offset:offset + numel].copy_(part)


def project(mat: torch.Tensor, factor: torch.Tensor, out: torch.Tensor, transpose: bool) -> None:
    """``out = M @ factor`` (``transpose=False``: P = M Q) or ``out = Mᵀ @ factor`` (Q = Mᵀ P),
    computed as ``(factorᵀ Mᵀ)ᵀ`` / ``(factorᵀ M)ᵀ``: 3–7× faster on CPU BLAS with a skinny
    factor (the big matrix is streamed along its rows once)."""
    if transpose:
        out.copy_(torch.bmm(factor.transpose(1, 2), mat).transpose(1, 2))
    else:
        out.copy_(torch.bmm(factor.transpose(1, 2), mat.transpose(1, 2)).transpose(1, 2))


def _gram_schmidt(x: torch.Tensor) -> None:
    """Modified Gram–Schmidt over the columns of each (n × r) matrix of ``x``, in place; an
    all-zero column (an unused parameter) stays zero instead of NaN (the norm is clamped)."""
    tiny = torch.finfo(x.dtype).tiny
    cols = x.shape[2]
    for i in range(cols):
        col = x[:, :, i:i + 1]
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).clamp_min_(tiny))
        if i + 1 < cols:
            rest = x[:, :, i + 1:]
            rest.sub_(torch.sum(col * rest, dim=1, keepdim=True) * col)


def orthogonalize(x: torch.Tensor, method: str = "auto") -> None:
    """Orthonormalize the columns of each matrix in the (B, n, r) batch ``x``, in place.
    ``auto``: Gram–Schmidt for r ≤ 2 or half precision (QR has no half kernels), else QR."""
    if x.numel() == 0:
        return
    if choice("orthogonalization", method, ORTHOGONALIZATIONS) == "auto":
        method = "gram_schmidt" if x.shape[2] <= 2 or x.dtype in _HALF else "qr"
    if method == "gram_schmidt":
        _gram_schmidt(x)
    else:
        x.copy_(torch.linalg.qr(x.float() if x.dtype in _HALF else x).Q)


def bucket_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for bucket ``index``, seeded identically on every rank."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + index) % (2 ** 63))


def random_factors(buf: torch.Tensor, groups: Sequence[MatrixGroup], which: str,
                   generator: torch.Generator, method: str) -> None:
    """Fill the ``which`` ("p" or "q") factors of ``groups`` in ``buf`` with orthonormalized
    normal draws from ``generator`` (on the CPU in fp32: the same numbers on every device)."""
    buf.copy_(torch.randn(buf.numel(), generator=generator, dtype=torch.float32))
    for g in groups:
        orthogonalize(getattr(g, which)(buf), method)


def forget_if_nonfinite(reduced: torch.Tensor, state: "LowRankState") -> None:
    """After a step whose reduced factors hold NaN/Inf (AMP's GradScaler sees them in the output), forget the
    residual and the warm start; ``reduced`` is the same on every rank, so every rank decides alike."""
    if not reduced.is_meta and not bool(torch.isfinite(reduced).all()):   # meta: the cost model's run
        state.ef.reset()
        state.ready = False


class LowRankState(State):
    """Per-bucket memory of a low-rank compressor, checkpointable: ``step`` (warm-up steps
    included), ``ready`` (the factors hold a warm start), ``p`` (P factors, then the
    uncompressed tail), ``q`` (Q factors, with a tail too when ``q_tail``), ``generator``, ``ef``."""

    q_tail = False

    def __init__(self, layout: BucketLayout, plan: LowRankPlan, seed: int, error_feedback: bool):
        self._plan = plan
        self.step = 0
        self.ready = False
        tail = plan.uncompressed_numel
        self.p = torch.zeros(plan.p_numel + tail, dtype=torch.float32, device=layout.device)
        self.q = torch.zeros(plan.q_numel + (tail if self.q_tail else 0), dtype=torch.float32,
                             device=layout.device)
        self.generator = bucket_generator(seed, layout.index)
        self.ef = ErrorFeedback.for_layout(layout, enabled=error_feedback)

    @property
    def plan(self) -> LowRankPlan:
        return self._plan

    def state_dict(self) -> dict:
        out = {k: v for k, v in super().state_dict().items() if k != "ef"}
        out["ef"] = self.ef.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.ef.load_state_dict(state.pop("ef"))
        for key in ("p", "q"):
            if state[key].numel() != getattr(self, key).numel():
                raise ValueError(f"checkpoint factor buffer {key!r} has {state[key].numel()} "
                                 f"elements, this bucket {getattr(self, key).numel()}; load it "
                                 "into the same bucket plan and rank")
        super().load_state_dict(state)
