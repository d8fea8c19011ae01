"""Low-bit reduce-scatter and all-gather, as round generators (the ``lowbit`` backend's and
:class:`bitscom.LowBitGroup`'s tensor collectives).

reduce-scatter is the first half of the two-stage all-reduce (quantize shards -> all-to-all ->
dequantize and sum in float32); all-gather sends each rank's tensor quantized once and every
rank, the sender included, decodes the gathered bytes, so outputs are bitwise identical.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .config import LowBitConfig
from .hadamard import hadamard
from .rounds import encode_with_feedback, pad, scatter_reduce, world_rank
from .seeds import key_id, stage_seed
from .state import LowBitState

__all__ = ["reduce_scatter_rounds", "all_gather_rounds"]


def reduce_scatter_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                          state: Optional[LowBitState] = None, *, average: bool = False,
                          key=0) -> Iterator:
    """Round generator: ``output`` (k elements) = this rank's shard of the low-bit sum of ``input``.

    ``input`` holds P shards of k elements (shard j goes to rank j). This is the first half of
    the two-stage all-reduce (quantize shards -> all-to-all -> dequantize and sum in float32);
    the result is not requantized. Mode ``"residual"`` keeps the input residual.

    Example::

        drive(reduce_scatter_rounds(out, inp, Comm(group), LowBitConfig(bitwidth=4)))
    """
    P = comm.size
    k = output.numel()
    if input.numel() != P * k:
        raise ValueError(f"reduce_scatter input has {input.numel()} elements; it needs world size "
                         f"{P} x output numel {k} = {P * k}")
    if not (input.is_floating_point() and output.is_floating_point()):
        raise TypeError("low-bit reduce_scatter needs floating tensors")
    if cfg.ef21:
        raise ValueError(f"error_feedback_mode={cfg.error_feedback_mode!r} is defined for all_reduce "
                         "only; use 'residual' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = torch.zeros(P, m, dtype=torch.float32, device=input.device)
    x[:, :k].copy_(input.reshape(P, k))
    x = x.view(-1)
    if cfg.hadamard:
        x = hadamard(x)
    state.bind(P * m)
    step = state.step
    state.step += 1
    sent = None
    if cfg.residual:
        state.residual.ensure(P * m, x.device)
        x = state.residual.compensate(x)
        sent = torch.empty_like(x)
    seed = stage_seed(cfg.seed, key_id(key), step, world_rank(comm), 0)
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
    """Round generator: ``output`` (P x k) receives every rank's ``input`` (k), sent in low bit.

    Each rank quantizes its input once; every rank, the sender included, dequantizes the
    gathered bytes, so all ranks hold bitwise-identical outputs. Mode ``"residual"`` adds the
    previous quantization residual to the input before sending.

    Example::

        drive(all_gather_rounds(out, inp, Comm(group), LowBitConfig(bitwidth=8)))
    """
    P = comm.size
    k = input.numel()
    if output.numel() != P * k:
        raise ValueError(f"all_gather output has {output.numel()} elements; it needs world size "
                         f"{P} x input numel {k} = {P * k}")
    if not (input.is_floating_point() and output.is_floating_point()):
        raise TypeError("low-bit all_gather needs floating tensors")
    if cfg.ef21:
        raise ValueError(f"error_feedback_mode={cfg.error_feedback_mode!r} is defined for all_reduce "
                         "only; use 'residual' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = pad(input, m, cfg, state)
    state.bind(m)
    step = state.step
    state.step += 1
    codec = cfg.codec(cfg.bitwidth)
    R = codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    ef = None
    if cfg.residual:
        state.residual.ensure(m, x.device)
        ef = state.residual
    encode_with_feedback(x, codec, buf, stage_seed(cfg.seed, key_id(key), step, world_rank(comm), 0),
                          0, ef)
    gathered = torch.empty(P * R, dtype=torch.uint8, device=x.device)
    yield comm.all_gather(gathered, buf)
    rows = gathered.view(P, R)
    vals = torch.empty(P, m, dtype=torch.float32, device=x.device)
    for j in range(P):
        codec.decode(rows[j], m, vals[j])
    if cfg.hadamard:
        vals = hadamard(vals.view(-1)).view(P, m)
    output.copy_(vals[:, :k].reshape(output.shape))
