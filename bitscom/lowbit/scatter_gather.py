"""Low-bit reduce-scatter (the first half of the two-stage all-reduce) and all-gather, as round
generators (the ``lowbit`` backend's and :class:`bitscom.LowBitGroup`'s tensor collectives)."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .config import LowBitConfig
from .hadamard import hadamard
from .rounds import encode_with_feedback, pad, scatter_reduce, world_rank
from .seeds import key_id, stage_seed
from .state import LowBitState

__all__ = ["reduce_scatter_rounds", "all_gather_rounds"]


def _begin(kind: str, full, full_name: str, part, part_name: str, comm, cfg: LowBitConfig,
           state: Optional[LowBitState], key, rows: int):
    """The checks both collectives share; ``(state advanced one step, padded part size, seed)``."""
    P, k = comm.size, part.numel()
    if full.numel() != P * k:
        raise ValueError(f"{kind} {full_name} has {full.numel()} elements; it needs world size "
                         f"{P} x {part_name} numel {k} = {P * k}")
    if not (full.is_floating_point() and part.is_floating_point()):
        raise TypeError(f"low-bit {kind} needs floating tensors")
    if cfg.ef21:
        raise ValueError(f"error_feedback_mode={cfg.error_feedback_mode!r} is defined for all_reduce "
                         "only; use 'residual' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    state.bind(rows * m)
    step = state.step
    state.step += 1
    return state, m, stage_seed(cfg.seed, key_id(key), step, world_rank(comm), 0)


def reduce_scatter_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                          state: Optional[LowBitState] = None, *, average: bool = False,
                          key=0) -> Iterator:
    """Round generator: ``output`` (k elements) = this rank's shard of the low-bit sum of ``input`` (P shards of k
    elements, shard j going to rank j), not requantized. Mode ``"residual"`` keeps the input residual.

    Example::

        drive(reduce_scatter_rounds(out, inp, Comm(group), LowBitConfig(bitwidth=4)))
    """
    P, k = comm.size, output.numel()
    state, m, seed = _begin("reduce_scatter", input, "input", output, "output", comm, cfg, state, key, P)
    x = torch.zeros(P, m, dtype=torch.float32, device=input.device)
    x[:, :k].copy_(input.reshape(P, k))
    x = x.view(-1)
    if cfg.hadamard:
        x = hadamard(x)
    sent = None
    if cfg.residual:
        state.residual.ensure(P * m, x.device)
        x = state.residual.compensate(x)
        sent = torch.empty_like(x)
    acc = yield from scatter_reduce(x, comm, cfg.codec(cfg.bitwidth), seed, 0, sent)
    if sent is not None:
        state.residual.update(sent)
        state.residual.drop_nonfinite()
    if average:
        acc.mul_(1.0 / P)
    if cfg.hadamard:
        acc = hadamard(acc)
    output.copy_(acc[:k].view(output.shape))


def all_gather_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                      state: Optional[LowBitState] = None, *, key=0) -> Iterator:
    """Round generator: ``output`` (P x k) receives every rank's ``input`` (k), quantized once by
    its sender and decoded from the gathered bytes by every rank, so all outputs are bitwise
    identical. Mode ``"residual"`` adds the previous quantization residual to the input (driven as
    :func:`reduce_scatter_rounds`)."""
    P, k = comm.size, input.numel()
    state, m, seed = _begin("all_gather", output, "output", input, "input", comm, cfg, state, key, 1)
    x = pad(input, m, cfg, state)
    codec = cfg.codec(cfg.bitwidth)
    R = codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    ef = state.residual if cfg.residual else None
    if ef is not None:
        ef.ensure(m, x.device)
    encode_with_feedback(x, codec, buf, seed, 0, ef)
    gathered = torch.empty(P * R, dtype=torch.uint8, device=x.device)
    yield comm.all_gather(gathered, buf)
    rows = gathered.view(P, R)
    vals = torch.empty(P, m, dtype=torch.float32, device=x.device)
    for j in range(P):
        codec.decode(rows[j], m, vals[j])
    if cfg.hadamard:
        vals = hadamard(vals.view(-1)).view(P, m)
    output.copy_(vals[:, :k].reshape(output.shape))
