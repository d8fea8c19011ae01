"""Sign compression: EF-SignSGD (Karimireddy et al. 2019) with blockwise scales (Zheng et al. 2019), and signSGD
with majority vote (Bernstein et al. 2018/2019).

Why a scale per block: ``s · sign(x)`` with ``s = ‖x‖₁ / d`` is the best scaled-sign approximation and keeps
S-SGD's learning rates usable; the finer the blocks, the less each message distorts (docs/compressors.md).
Signs cannot be summed on the wire: one ``all_gather``. EF-SignSGD: 1. ``x = g + e``; 2. ``s_k = ‖x_k‖₁ / d_k``
per block; 3. all-gather (bits, s); 4. ``(1/N) Σ_r s_r · sign_r`` in rank order; 5. ``e = x − s · sign(x)``.
Majority vote: steps 1–3, then ``sign(Σ_r sign_r) · mean_r s_r`` (a tie gives 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..lowbit.error_feedback import SteppedErrorFeedback
from ..lowbit.format import pack_signs, unpack_signs
from .base import BucketLayout, Comm, Compressor
from ..validate import flag, number
from .warmup import StartIter, check_start_iter

__all__ = ["SignSGD", "pack_signs", "unpack_signs"]


@functools.lru_cache(maxsize=1024)     # called every step; a bucket can hold 10⁵ blocks
def _blocks(sizes: tuple, block: int) -> tuple:
    """Each of ``sizes`` cut into runs of ``block`` (the last run of each may be shorter)."""
    out = []
    for n in sizes:
        out += [block] * (n // block) + ([n % block] if n % block else [])
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _segments(sizes: tuple, device: str):
    """``(counts, ids)`` on ``device``: each segment's element count, and each element's segment
    index (``scales[ids]`` expands scales to elements). Cached: a host-to-device copy."""
    counts = torch.tensor(sizes, device=device)
    return counts, torch.repeat_interleave(torch.arange(len(sizes), device=device), counts,
                                           output_size=sum(sizes))


@functools.lru_cache(maxsize=256)
def _counts(sizes: tuple) -> torch.Tensor:
    """Each segment's element count as a CPU int64 tensor, for the native kernels."""
    return torch.tensor(sizes, dtype=torch.int64)


def _native_for(x: torch.Tensor):
    """The native CPU kernels when they apply to ``x`` (contiguous fp32 on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    from ..kernels import cpu_native
    return cpu_native if cpu_native.available() else None


@dataclass(frozen=True)
class SignSGD(StartIter, Compressor[SteppedErrorFeedback]):
    """One bit per gradient entry plus one fp32 scale per 16-entry block, with error feedback.

    Args:
        error_feedback: keep ``x − s·sign(x)`` (scaled sign is biased without); ``None``: on unless majority vote.
        majority_vote: majority of the signs times the mean scale: robust to a few bad ranks, less accurate.
        block_size: entries per scale (16: 10.7× fewer bytes than fp32); ``None``: one per tensor (~32×, some
            seeds diverged).
        start_iter: plain all-reduce steps first (with Adam: ``FrozenVarianceAdamW(freeze_step=start_iter)``).

    Example::

        opt = bitscom.DistributedOptimizer(opt, compression=bitscom.compressors.SignSGD())
    """

    error_feedback: Optional[bool] = None
    majority_vote: bool = False
    start_iter: int = 0
    block_size: Optional[int] = 16

    name = "signsgd"

    def __post_init__(self):
        flag("SignSGD majority_vote", self.majority_vote)
        if self.error_feedback is not None:         # None: on without majority vote
            flag("SignSGD error_feedback", self.error_feedback)
        check_start_iter("SignSGD", self.start_iter)
        if self.block_size is not None:             # None: one scale per tensor
            number("SignSGD block_size", self.block_size, minimum=1, integer=True)

    @property
    def uses_error_feedback(self) -> bool:
        """The effective setting: ``error_feedback`` with ``None`` resolved."""
        return not self.majority_vote if self.error_feedback is None else self.error_feedback

    def init_state(self, layout: BucketLayout) -> SteppedErrorFeedback:
        return SteppedErrorFeedback.for_layout(layout, enabled=self.uses_error_feedback)

    @staticmethod
    def encode(x: torch.Tensor, sizes) -> torch.Tensor:
        """The wire record of ``x`` (uint8): packed signs, then one fp32 scale ``‖x_t‖₁/d_t`` per
        segment of ``sizes`` (element counts summing to ``x.numel()``)."""
        counts, ids = _segments(tuple(sizes), str(x.device))
        sums = torch.zeros(len(sizes), dtype=torch.float32, device=x.device)
        sums.index_add_(0, ids, x.abs().float())
        scales = sums / counts.clamp(min=1)
        return torch.cat([pack_signs(x), scales.view(torch.uint8)])

    @staticmethod
    def decode(record: torch.Tensor, sizes, numel: Optional[int] = None):
        """``(signs ±1 fp32, per-segment scales fp32)`` of one wire record (``numel``: ``sum(sizes)``)."""
        numel = sum(sizes) if numel is None else numel
        nbytes = -(-numel // 8)
        scales = record[nbytes:].clone().view(torch.float32)     # clone: 4-byte aligned
        return unpack_signs(record[:nbytes], numel), scales

    def _sizes(self, layout: BucketLayout, numel: int) -> tuple:
        """Element counts of the scale segments: each tensor, cut into ``block_size`` runs if set."""
        sizes = tuple(s.numel for s in layout.slots)
        if not sizes or sum(sizes) != numel:
            sizes = (numel,)
        return sizes if self.block_size is None else _blocks(sizes, self.block_size)

    def compressed(self, flat, layout, state, comm: Comm):
        numel = flat.numel()
        if numel == 0:
            return
        sizes = self._sizes(layout, numel)
        native = None if self.majority_vote else _native_for(flat)
        if native is not None:
            yield from self._reduce_native(native, flat, sizes, state, comm)
            return
        x = state.compensate(flat)
        _, ids = _segments(sizes, str(flat.device))
        record = self.encode(x, sizes)
        signs, scales = self.decode(record, sizes)
        state.update(signs * scales[ids])
        gathered = torch.empty(comm.size * record.numel(), dtype=torch.uint8, device=flat.device)
        yield comm.all_gather(gathered, record)
        if flat.is_meta:        # the cost model's shape-only run: the decode issues no collective
            return
        gathered = gathered.view(comm.size, -1)
        acc = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        scale_sum = torch.zeros(len(sizes), dtype=torch.float32, device=flat.device)
        gathered_scales = []
        for r in range(comm.size):                              # fixed order: bitwise identical
            signs, scales = self.decode(gathered[r], sizes, numel)
            gathered_scales.append(scales)
            if self.majority_vote:
                acc += signs
                scale_sum += scales
            else:
                acc.add_(signs * scales[ids])
        flat.copy_(acc.sign_().mul_((scale_sum / comm.size)[ids]) if self.majority_vote else acc.div_(comm.size))
        if not bool(torch.isfinite(torch.stack(gathered_scales)).all()):
            state.reset()  # NaN/Inf reached the output (visible to AMP); don't carry it on

    def _reduce_native(self, native, flat, sizes, state, comm: Comm):
        """EF-SignSGD's steps in two fused passes of the native CPU kernels (compensate, encode
        and residual update; then the rank-order decode-sum into ``flat``): the same bytes,
        results and residual as the torch path, without its ~12 passes and temporaries."""
        numel = flat.numel()
        if state.enabled:
            if state.residual is not None and state.residual.numel() != numel:
                state.compensate(flat)          # raises: the bucket layout changed
            x, grad = state.ensure(numel, flat.device), flat      # x = e, and the kernel adds g into it
        else:
            x, grad = flat, None
        counts = _counts(sizes)
        nbytes = -(-numel // 8)
        record = state.scratch("record", (nbytes + 4 * len(sizes),), torch.uint8, "cpu")
        record[:nbytes].zero_()
        native.sign_encode(x, counts, record[:nbytes], record[nbytes:], update=state.enabled, grad=grad)
        gathered = state.scratch("gathered", (comm.size * record.numel(),), torch.uint8, "cpu")
        yield comm.all_gather(gathered, record)
        if native.sign_decode_sum(gathered.view(comm.size, -1), numel, nbytes, counts, flat, divide=comm.size):
            state.reset()  # NaN/Inf reached the output (visible to AMP); don't carry it on
