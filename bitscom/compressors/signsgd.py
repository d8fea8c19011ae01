"""Sign compression: EF-SignSGD (Karimireddy et al. 2019) and signSGD with majority vote
(Bernstein et al. 2018/2019).

Why a scale: a bare sign throws away the gradient's magnitude, so SGD's learning rate would
have to be retuned. Sending one fp32 scale per tensor, ``s = ‖x‖₁ / d`` (its mean absolute
value), makes ``s · sign(x)`` the best scaled-sign approximation of ``x`` in the ℓ2 sense
given the signs, and keeps dense-SGD learning rates usable. Per tensor (layer), as
Karimireddy et al. do, not per bucket: a bucket mixes layers and biases whose magnitudes
differ by orders, and one shared scale measurably hurts accuracy (docs/compressors.md, "SignSGD").

Wire format, per rank and bucket of d elements in T tensors: the d sign bits as the low-bit
format's 1-bit codes (:func:`bitscom.quantization.pack_signs`: bit ``i % 8`` of byte
``i // 8`` is element i, a set bit means negative, so ``+0`` and ``-0`` both read as +),
followed by the T fp32 scales: ``ceil(d / 8) + 4·T`` bytes, sent with one ``all_gather``
(signs cannot be summed on the wire). fp32 all-reduce costs ``4·d``: about 32× more.

EF-SignSGD (``majority_vote=False``), per bucket and step:

1. ``x = g + e``; 2. ``s_t = ‖x_t‖₁ / d_t`` for each tensor t; 3. all-gather (bits, s);
4. average: ``(1/N) Σ_r s_r · sign_r``, summed in rank order on every rank (bitwise
   identical); 5. ``e = x − s · sign(x)``.

Majority vote (``majority_vote=True``): steps 1–3 as above; then
``result = sign(Σ_r sign_r) · (1/N) Σ_r s_r`` — the elementwise vote times the ranks' mean
scale of the tensor (a tie, possible for even N, gives 0). Bernstein et al. use
``lr · sign(vote)``; the mean scale makes the update's size match the gradient's, so
learning rates tuned for S-SGD carry over. Error feedback in this mode is worker-side only:
``e = x − s · sign(x)`` compensates what this rank's message lost, not what the vote lost
(the worker half of the double error feedback of Zheng et al. 2019 / 1-bit Adam). It is off by default there
(``error_feedback=None`` means on for EF-SignSGD, off for majority vote) because the vote
already rounds and the paper's convergence argument is for plain signs.

The default is the majority vote: EF-SignSGD's residual carries whole stale steps that
momentum SGD and Adam amplify, and measured it diverged on some seeds (digits MLP 81% ± 14
over 12 seeds against 94.8% for the vote; docs/convergence.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..error_feedback import SteppedErrorFeedback
from ..quantization import pack_signs, unpack_signs
from .base import BucketLayout, Comm, Compressor, check_start_iter

__all__ = ["SignSGD", "pack_signs", "unpack_signs"]

@dataclass(frozen=True)
class SignSGD(Compressor):
    """One bit per gradient entry plus one fp32 scale per tensor, with error feedback.

    Args:
        error_feedback: keep ``x − s·sign(x)`` and add it to the next gradient. Needed for
            EF-SignSGD to converge like SGD (plain scaled sign is biased). ``None`` (the
            default) means on without majority vote and off with it.
        majority_vote: ``True`` (default): the elementwise majority of the signs times the
            mean scale (signSGD with majority vote; stable with momentum and Adam, robust
            to a minority of bad ranks, but the update of every entry has the same size).
            ``False``: average the ranks' scaled signs (EF-SignSGD, keeps magnitude
            information across ranks; diverged on some seeds in our runs).
        start_iter: plain all-reduce of the bucket (its dtype, full bytes) for the first
            ``start_iter`` steps of the bucket. With Adam, pair it with
            :class:`bitscom.FrozenVarianceAdamW` (``freeze_step == start_iter``), the recipe
            of 1-bit Adam.

    Example::

        opt = bitscom.DistributedOptimizer(opt, compression=bitscom.compressors.SignSGD())
    """

    error_feedback: Optional[bool] = None
    majority_vote: bool = False
    start_iter: int = 0
    block_size: Optional[int] = 32

    name = "signsgd"

    def __post_init__(self):
        if not isinstance(self.majority_vote, bool):
            raise TypeError(f"SignSGD majority_vote must be a bool, got {self.majority_vote!r}")
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise TypeError(f"SignSGD error_feedback must be a bool or None, got {self.error_feedback!r}")
        check_start_iter("SignSGD", self.start_iter)
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"SignSGD block_size must be None (one scale per tensor) or an int >= 1, "
                             f"got {b!r}")

    @property
    def uses_error_feedback(self) -> bool:
        """The effective setting: ``error_feedback`` with ``None`` resolved."""
        if self.error_feedback is None:
            return not self.majority_vote
        return self.error_feedback

    def init_state(self, layout: BucketLayout) -> SteppedErrorFeedback:
        return SteppedErrorFeedback.for_layout(layout, enabled=self.uses_error_feedback)

    @staticmethod
    def encode(x: torch.Tensor, sizes) -> torch.Tensor:
        """The wire record of ``x``: packed signs, then one fp32 scale ``‖x_t‖₁/d_t`` per
        segment of ``sizes`` (element counts summing to ``x.numel()``: tensors, or blocks of
        them), as uint8. One vectorized pass: a bucket may hold tens of thousands of blocks."""
        counts = torch.tensor(sizes, device=x.device)
        ids = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), counts)
        sums = torch.zeros(len(sizes), dtype=torch.float32, device=x.device)
        sums.index_add_(0, ids, x.abs().float())
        scales = sums / counts.clamp(min=1)
        return torch.cat([pack_signs(x), scales.view(torch.uint8)])

    @staticmethod
    def decode(record: torch.Tensor, sizes):
        """``(signs ±1 fp32, per-tensor scales fp32)`` of one wire record."""
        numel = sum(sizes)
        nbytes = -(-numel // 8)
        scales = record[nbytes:].clone().view(torch.float32)     # clone: 4-byte aligned
        return unpack_signs(record[:nbytes], numel), scales

    def _sizes(self, layout: BucketLayout, numel: int) -> tuple:
        """Element counts of the scale segments: each tensor of the bucket, cut into runs of
        ``block_size`` (the last run of a tensor may be shorter) when that is set."""
        sizes = tuple(s.numel for s in layout.slots)
        if not sizes or sum(sizes) != numel:
            sizes = (numel,)
        if self.block_size is None:
            return sizes
        b, out = self.block_size, []
        for n in sizes:
            out += [b] * (n // b) + ([n % b] if n % b else [])
        return tuple(out)

    def reduce(self, flat, layout, state, comm: Comm):
        numel = flat.numel()
        if numel == 0:
            return
        step, state.step = state.step, state.step + 1
        if step < self.start_iter:
            yield comm.all_reduce(flat)
            flat.div_(comm.size)
            return
        sizes = self._sizes(layout, numel)
        counts = torch.tensor(sizes, device=flat.device)
        x = state.compensate(flat)
        record = self.encode(x, sizes)
        signs, scales = self.decode(record, sizes)
        state.update(signs * scales.repeat_interleave(counts))
        gathered = torch.empty(comm.size * record.numel(), dtype=torch.uint8, device=flat.device)
        yield comm.all_gather(gathered, record)
        gathered = gathered.view(comm.size, -1)
        acc = torch.zeros(numel, dtype=torch.float32, device=flat.device)
        scale_sum = torch.zeros(len(sizes), dtype=torch.float32, device=flat.device)
        gathered_scales = []
        for r in range(comm.size):                              # fixed order: bitwise identical
            signs, scales = self.decode(gathered[r], sizes)
            gathered_scales.append(scales)
            if self.majority_vote:
                acc += signs
                scale_sum += scales
            else:
                acc.add_(signs * scales.repeat_interleave(counts))
        if self.majority_vote:
            flat.copy_(acc.sign_().mul_((scale_sum / comm.size).repeat_interleave(counts)))
        else:
            flat.copy_(acc.div_(comm.size))
        if not bool(torch.isfinite(torch.stack(gathered_scales)).all()):
            state.reset()  # NaN/Inf reached the output (visible to AMP); don't carry it on

    def wire_bytes(self, layout: BucketLayout, world_size: int, step=None) -> int:
        """Bytes one rank sends for one step of ``layout`` (a sign step unless ``step`` <
        ``start_iter``)."""
        if step is not None and step < self.start_iter:
            return layout.numel * torch.empty((), dtype=layout.dtype).element_size()
        return -(-layout.numel // 8) + 4 * max(len(self._sizes(layout, layout.numel)), 1)
