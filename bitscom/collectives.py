"""Low-bit collectives, written once as round generators.

Every algorithm here is a generator that issues asynchronous collectives through one or more
``comm`` objects (anything with ``size``, ``rank``, ``all_to_all``, ``all_gather``,
``all_reduce``, ``broadcast`` — :class:`bitscom.compressors.base.Comm` or the backend's
wrapper), yields their work handles and continues once they completed. The same generator is
driven by the optimizer's engine (:class:`bitscom.compressors.LowBit`), by
:class:`bitscom.LowBitGroup` and by the ``lowbit`` torch.distributed backend, so the three
cannot drift apart.

Two-stage all-reduce, for P ranks (``all_reduce_rounds``):

1. pad the flat tensor to ``N = P * m`` (``m`` a multiple of ``block_size``), optionally
   rotate it by a Hadamard transform, apply error feedback;
2. quantize shard ``j`` (``bits``) into row ``j`` of a send buffer and all-to-all it: rank
   ``r`` receives shard ``r`` of every rank;
3. dequantize the P rows and sum them in float32, in rank order (scale by ``1/P`` to average);
4. requantize the reduced shard at ``stage2_bits`` (its own setting: see :data:`DEFAULT_STAGE2_BITS`)
   and all-gather the bytes;
5. every rank dequantizes *the gathered bytes*, its own shard included, so every rank ends
   with bitwise-identical values.

Hierarchical variants stack the same steps over an intra-node and an inter-node group (see
:class:`LowBitConfig.hierarchy`); ``chunk_size`` cuts the tensor into chunks run in lockstep,
so chunk ``k``'s inter-node round is in flight together with chunk ``k+1``'s intra-node round.

Stochastic-rounding seeds are derived from (config seed, key, step, rank, stage) by a 64-bit
mixer: different for every rank, stage and step, and reproducible from a checkpoint.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from . import kernels
from .quantization import SUPPORTED_BITS, hadamard as _hadamard

__all__ = ["FULL_PRECISION", "EF_MODES", "HIERARCHIES", "DEFAULT_STAGE2_BITS", "LowBitConfig",
           "LowBitState", "Codec", "all_reduce_rounds", "reduce_scatter_rounds",
           "all_gather_rounds", "pipeline", "stage_seed", "key_id", "wire_bytes_all_reduce"]

FULL_PRECISION = 32
"""A width of 32 means "send raw float32" (allowed for every stage)."""

EF_MODES = ("none", "ef", "ef21")
HIERARCHIES = ("none", "leader", "two_level")

DEFAULT_STAGE2_BITS = {1: 4, 2: 4, 4: 4, 8: 8, 12: 12, 16: 16, 32: 32}
"""Default width of the requantized reduced shard, per first-stage width: never below 4.

Measured (README, "Low-bit collectives"; ``scripts/collective_compare.py``): requantizing a reduced
shard at 1 or 2 bits has a relative error of 0.6-1.1 *by itself* (a ternary or sign code
keeps little of a near-Gaussian sum, and stochastic rounding at 2 bits is worse than sending
nothing), while 4 bits costs ~0.12 and 8 bits ~0.007. Stage 2 is not averaged over ranks,
so a 1- or 2-bit first stage is paired with a 4-bit second stage; pass ``stage2_bits=8``
when accuracy matters more than the all-gather's bytes.
"""

_M64 = (1 << 64) - 1
_WIDTHS = tuple(SUPPORTED_BITS) + (FULL_PRECISION,)


def _check_width(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in _WIDTHS:
        raise ValueError(f"{name}={value!r} is not supported; allowed widths are {_WIDTHS} "
                         f"({FULL_PRECISION} = full-precision float32)")


@dataclass(frozen=True)
class LowBitConfig:
    """Settings of the low-bit collectives; every rank must use equal settings.

    Attributes:
        bits: first-stage width (what each rank sends in the all-to-all; in ``two_level`` the
            inter-node all-to-all). Fewer bits = fewer bytes, more error; 1 = scaled sign.
        stage2_bits: width of the requantized reduced shard that is all-gathered. It costs as
            many bytes as stage 1 on a ring, but its error is not averaged over ranks; ``None``
            takes :data:`DEFAULT_STAGE2_BITS` (max(bits, 4)).
        block_size: elements per scale (power of two, 32..65536). Small blocks track magnitudes
            better, each block costs 16 bits of scale.
        stochastic_rounding: unbiased rounding (errors average out over ranks and steps) at about
            twice the per-element variance of round-to-nearest.
        hadamard: rotate 32-element runs by an orthonormal Hadamard transform before quantizing
            (SDP4Bit): spreads outliers so a block's scale fits its typical value; costs two
            extra passes over memory.
        error_feedback: ``"none"``; ``"ef"`` keeps the residual of the first-stage quantization and
            adds it to the next input (unbiased over time, one extra buffer); ``"ef21"`` keeps an
            estimate ``g_i`` per rank, sends ``C(x - g_i)`` and maintains the aggregate estimate
            (two extra buffers; the output is the estimate, not the raw average).
        stage2_error_feedback: keep the residual of the stage-2 requantization of this rank's
            reduced shard and add it back next step (the seed's ``ef21_plus``); one buffer of n/P.
        hierarchy: ``"none"`` (flat over one group), ``"leader"`` (local reduce -> low-bit
            all-reduce among one leader per node -> local broadcast: fewer inter-node flows, the
            local stage in full precision unless ``local_quantize``) or ``"two_level"``
            (SDP4Bit: intra-node all-to-all at ``intra_bits`` -> inter-node all-to-all at ``bits``
            -> all-gathers: every rank uses the inter-node links, 1/L of the data each).
        intra_bits: width of the intra-node stage (``two_level``; ``leader`` with
            ``local_quantize``). Intra-node links are fast, so 8 bits or 32 (full) is typical.
        local_quantize: ``leader`` only: quantize the local reduce at ``intra_bits``.
        chunk_size: elements per pipelined chunk (``None`` = one chunk). Smaller chunks overlap
            the stages better but launch more, smaller collectives.
        seed: base of the stochastic-rounding seeds.

    Example::

        cfg = LowBitConfig(bits=4, stochastic_rounding=True, error_feedback="ef")
    """

    bits: int = 4
    stage2_bits: Optional[int] = None
    block_size: int = 128
    stochastic_rounding: bool = False
    hadamard: bool = False
    error_feedback: str = "none"
    stage2_error_feedback: bool = False
    hierarchy: str = "none"
    intra_bits: int = 8
    local_quantize: bool = False
    chunk_size: Optional[int] = None
    seed: int = 0

    def __post_init__(self):
        _check_width("bits", self.bits)
        _check_width("stage2_bits", self.stage2_bits, allow_none=True)
        _check_width("intra_bits", self.intra_bits)
        kernels.format.check_block_size(self.block_size)
        if self.error_feedback not in EF_MODES:
            raise ValueError(f"error_feedback={self.error_feedback!r} is not one of {EF_MODES}")
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"hierarchy={self.hierarchy!r} is not one of {HIERARCHIES}")
        if self.local_quantize and self.hierarchy != "leader":
            raise ValueError("local_quantize=True applies to hierarchy='leader' only, "
                             f"got hierarchy={self.hierarchy!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool)
                                            or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size={self.chunk_size!r} must be None or an int >= 1")
        kernels.format.check_seed(self.seed)
        for name in ("stochastic_rounding", "hadamard", "stage2_error_feedback", "local_quantize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def resolved_stage2_bits(self) -> int:
        return DEFAULT_STAGE2_BITS[self.bits] if self.stage2_bits is None else self.stage2_bits

    @property
    def needs_state(self) -> bool:
        return self.error_feedback != "none" or self.stage2_error_feedback or self.stochastic_rounding


class LowBitState:
    """Mutable state of one stream of reductions (one bucket, or one user key).

    ``step`` advances once per reduction and keys the stochastic-rounding seeds; the tensors
    are created on first use: ``residual`` (``"ef"``), ``local_estimate`` / ``global_estimate``
    (``"ef21"``, g_i and the aggregate g), ``stage2_residual`` (``stage2_error_feedback``).
    They live in the transformed domain when ``hadamard`` is on.
    """

    _TENSORS = ("residual", "local_estimate", "global_estimate", "stage2_residual")

    def __init__(self):
        self.step = 0
        self.numel = None
        self.residual = None
        self.local_estimate = None
        self.global_estimate = None
        self.stage2_residual = None
        self._workspace = None  # the padded send buffer, reused every step (not checkpointed)

    def workspace(self, numel: int, device) -> torch.Tensor:
        """A float32 scratch buffer of ``numel`` elements kept between steps: allocating a
        bucket-sized buffer each step costs a page-faulting pass over it."""
        t = self._workspace
        if t is None or t.numel() != numel or t.device != torch.device(device):
            t = self._workspace = torch.empty(numel, dtype=torch.float32, device=device)
        return t

    def _buffer(self, name: str, numel: int, device) -> torch.Tensor:
        t = getattr(self, name)
        if t is None or t.numel() != numel or t.device != torch.device(device):
            t = torch.zeros(numel, dtype=torch.float32, device=device)
            setattr(self, name, t)
        return t

    def _bind(self, numel: int) -> None:
        if self.numel is not None and self.numel != numel:
            raise ValueError(f"this low-bit state was used for tensors of {self.numel} elements and "
                             f"now gets {numel}; use a different key per tensor")
        self.numel = numel

    def state_dict(self) -> dict:
        out = {"step": self.step, "numel": self.numel}
        for name in self._TENSORS:
            t = getattr(self, name)
            out[name] = None if t is None else t.detach().clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.numel = state.get("numel")
        for name in self._TENSORS:
            t = state.get(name)
            setattr(self, name, None if t is None else t.detach().clone().to(torch.float32))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def stage_seed(seed: int, key: int, step: int, rank: int, stage: int) -> int:
    """The stochastic-rounding seed of one (key, step, rank, stage): distinct and reproducible.

    Example::

        stage_seed(0, key=3, step=10, rank=1, stage=0) != stage_seed(0, 3, 10, 1, 1)   # True
    """
    h = seed & _M64
    for part in (key, step, rank, stage):
        h = _splitmix64(h ^ _splitmix64(part & _M64))
    return h


def key_id(key) -> int:
    """A stable integer for a user key (ints as they are, anything else via CRC32 of its repr)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key & _M64
    return zlib.crc32(repr(key).encode())


@dataclass(frozen=True)
class Codec:
    """How one stage puts a shard of ``m`` float32 values into a byte row and back.

    ``bits=32`` sends raw float32; otherwise the row is the low-bit payload followed by the
    bfloat16 scales (``kernels.wire_bytes(m, bits, block_size)`` bytes). Rows are views into
    one uint8 send/receive buffer, so each stage is a single collective.
    """

    bits: int
    block_size: int = 128
    stochastic: bool = False

    def row_bytes(self, m: int) -> int:
        if self.bits == FULL_PRECISION:
            return 4 * m
        return kernels.wire_bytes(m, self.bits, self.block_size)

    def _split(self, rows: torch.Tensor, m: int):
        pb = kernels.payload_bytes(m, self.bits, self.block_size)
        return rows[..., :pb], rows[..., pb:].view(torch.bfloat16)

    def encode(self, x: torch.Tensor, row: torch.Tensor, seed: int, offset: int) -> None:
        if self.bits == FULL_PRECISION:
            row.view(torch.float32).copy_(x)
            return
        payload, scales = self._split(row, x.numel())
        kernels.quantize_pack(x, self.bits, self.block_size, stochastic=self.stochastic,
                              seed=seed, index_offset=offset, payload=payload, scales=scales)

    def decode(self, row: torch.Tensor, m: int, out: torch.Tensor) -> None:
        if self.bits == FULL_PRECISION:
            out.copy_(row.view(torch.float32))
            return
        payload, scales = self._split(row, m)
        kernels.unpack_dequantize(payload, scales, m, self.bits, self.block_size, out=out)

    def decode_sum(self, rows: torch.Tensor, m: int, out: torch.Tensor) -> None:
        """``out = row_0 + row_1 + ...`` decoded, summed left to right (same bits everywhere)."""
        if self.bits == FULL_PRECISION:
            vals = rows.view(torch.float32)
            out.copy_(vals[0])
            for j in range(1, vals.shape[0]):
                out.add_(vals[j])
            return
        payloads, scales = self._split(rows, m)
        kernels.unpack_dequantize_accumulate(payloads, scales, m, self.bits, self.block_size, out=out)


def _finite_(t: torch.Tensor) -> torch.Tensor:
    """Residuals must not keep a NaN/Inf forever (AMP skips that step; the state must survive)."""
    return torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)


def _scatter_reduce(x, comm, codec, seed, offset, sent=None):
    """Round: x [P*m] -> this rank's shard summed over the group (float32 [m]).

    ``sent`` (optional, [P*m]) receives D(C(x)), what the wire actually carried (for EF).
    """
    P = comm.size
    m = x.numel() // P
    R = codec.row_bytes(m)
    send = torch.empty(P, R, dtype=torch.uint8, device=x.device)
    for j in range(P):
        codec.encode(x[j * m:(j + 1) * m], send[j], seed, offset + j * m)
    if sent is not None:
        for j in range(P):
            codec.decode(send[j], m, sent[j * m:(j + 1) * m])
    recv = torch.empty_like(send)
    yield comm.all_to_all(recv.view(-1), send.view(-1))
    acc = torch.empty(m, dtype=torch.float32, device=x.device)
    codec.decode_sum(recv, m, acc)
    return acc


def _levels_rounds(x, levels, out_codec, alpha, seeds, offset, sent=None, stage2_residual=None):
    """Reduce ``x`` through ``levels`` [(comm, codec), ...] (outermost first), then gather back.

    After the last level this rank holds one fully reduced shard; it is scaled by ``alpha``,
    requantized with ``out_codec`` and its bytes travel back through the levels by all-gathers
    (intermediate ranks forward bytes, never re-encode), so every rank decodes identical bytes.
    """
    shard, off = x, offset
    for k, (comm, codec) in enumerate(levels):
        m = shard.numel() // comm.size
        shard = yield from _scatter_reduce(shard, comm, codec, seeds(k), off, sent if k == 0 else None)
        off += comm.rank * m
    if alpha != 1.0:
        shard.mul_(alpha)
    if stage2_residual is not None:
        shard.add_(stage2_residual)
    m = shard.numel()
    R = out_codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    out_codec.encode(shard, buf, seeds(len(levels)), off)
    if stage2_residual is not None:
        out_codec.decode(buf, m, stage2_residual)
        _finite_(torch.sub(shard, stage2_residual, out=stage2_residual))
    for comm, _ in reversed(levels):
        gathered = torch.empty(comm.size * buf.numel(), dtype=torch.uint8, device=x.device)
        yield comm.all_gather(gathered, buf)
        buf = gathered
    rows = buf.view(-1, R)
    out = torch.empty(rows.shape[0] * m, dtype=torch.float32, device=x.device)
    for i in range(rows.shape[0]):
        out_codec.decode(rows[i], m, out[i * m:(i + 1) * m])
    return out


def _leader_rounds(x, intra, inter, cfg, alpha, seeds, offset, sent=None, stage2_residual=None):
    """Hierarchy (a): local reduce -> low-bit all-reduce among node leaders -> local broadcast.

    Non-leaders yield ``None`` for each leader round so every chunk takes the same number of
    rounds on every rank: the pipeline then issues collectives in the same order everywhere.
    """
    if cfg.local_quantize:
        local = Codec(cfg.intra_bits, cfg.block_size, cfg.stochastic_rounding)
        y = yield from _levels_rounds(x, [(intra, local)], local, 1.0, lambda s: seeds(10 + s), offset)
        x.copy_(y)  # in place: the caller's error feedback reads the local sum from x
    else:
        yield intra.all_reduce(x)
    codec = Codec(cfg.bits, cfg.block_size, cfg.stochastic_rounding)
    out2 = Codec(cfg.resolved_stage2_bits, cfg.block_size, cfg.stochastic_rounding)
    if intra.rank == 0:
        x = yield from _levels_rounds(x, [(inter, codec)], out2, alpha, seeds, offset, sent,
                                      stage2_residual)
    else:
        yield None
        yield None
    yield intra.broadcast(x, 0)
    return x


def pipeline(gens: Sequence[Iterator]) -> Iterator:
    """Run several round generators in lockstep, starting one more each round.

    Round t advances chunk t (its first stage) together with chunk t-1 (its second stage) and
    so on, so different stages of different chunks are in flight at once. Generators are
    advanced in list order, which is the same on every rank: per group, collectives are issued
    in the same order everywhere. Yields lists of work handles; returns the generators' results.

    Example::

        results = yield from pipeline([chunk_rounds(c) for c in chunks])
    """
    pending = list(enumerate(gens))
    results = [None] * len(pending)
    active = []
    while pending or active:
        if pending:
            active.append(pending.pop(0))
        works = []
        for item in list(active):
            i, g = item
            try:
                w = next(g)
            except StopIteration as stop:
                results[i] = stop.value
                active.remove(item)
                continue
            if w is not None:
                works.append(w)
        if works or active:
            yield works
    return results


def _unit(sizes: Sequence[int], cfg: LowBitConfig) -> int:
    return math.prod(sizes) * cfg.block_size


def _pad(flat: torch.Tensor, unit: int, cfg: LowBitConfig, state: "LowBitState") -> torch.Tensor:
    n = flat.numel()
    N = max(unit, -(-n // unit) * unit)
    x = state.workspace(N, flat.device)
    x[:n].copy_(flat.reshape(-1))
    x[n:].zero_()
    if cfg.hadamard:
        x = _hadamard(x)
    return x


def _chunks(N: int, unit: int, chunk_size: Optional[int]):
    if chunk_size is None:
        return [(0, N)]
    c = max(unit, -(-chunk_size // unit) * unit)
    return [(s, min(N, s + c)) for s in range(0, N, c)]


def _world_rank(comm) -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else comm.rank


def all_reduce_rounds(flat: torch.Tensor, comm, cfg: LowBitConfig, state: Optional[LowBitState] = None,
                      *, average: bool = True, key=0, intra=None, inter=None) -> Iterator:
    """Round generator: replace ``flat`` by the low-bit sum (or average) over ranks, in place.

    ``comm`` is the flat group; the hierarchies use ``intra`` and ``inter`` instead (with a
    single node, ``inter.size == 1``, they take one full-precision all-reduce over ``intra``).
    On exit ``flat`` is bitwise identical on every rank. ``state`` is required for error
    feedback and reproducible stochastic rounding; it advances one step per call.

    Example::

        state = LowBitState()
        drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(bits=4), state), None)
    """
    if not flat.is_floating_point():
        raise TypeError(f"low-bit all_reduce needs a floating tensor, got {flat.dtype}")
    if state is None:
        if cfg.error_feedback != "none" or cfg.stage2_error_feedback:
            raise ValueError("error feedback needs a LowBitState (pass state=...)")
        state = LowBitState()
    n = flat.numel()
    hier = cfg.hierarchy
    if hier != "none" and (intra is None or inter is None):
        raise ValueError(f"hierarchy={hier!r} needs intra and inter groups")
    world = comm.size if hier == "none" else intra.size * inter.size
    if n == 0 or world == 1:
        return
    alpha = 1.0 / world if average else 1.0
    if hier != "none" and inter.size == 1:
        # Single node: one full-precision all-reduce (intra-node links are not the bottleneck).
        yield intra.all_reduce(flat)
        if average:
            flat.div_(world)
        return
    if hier == "two_level" and intra.size == 1:
        hier, comm = "none", inter
    sizes = [comm.size] if hier == "none" else [intra.size, inter.size]
    state._bind(n)
    unit = _unit(sizes, cfg)
    x = _pad(flat, unit, cfg, state)
    N = x.numel()
    rank = _world_rank(comm if hier == "none" else intra)
    step, kid = state.step, key_id(key)
    state.step += 1

    def seeds(stage):
        return stage_seed(cfg.seed, kid, step, rank, stage)

    ef = cfg.error_feedback
    send, sent = x, None
    if ef == "ef":
        e = state._buffer("residual", N, x.device)
        send = x.add_(e)
        sent = e  # receives D(C(send)); residual = send - sent below
    elif ef == "ef21":
        g_i = state._buffer("local_estimate", N, x.device)
        send = x.sub_(g_i)
        sent = torch.empty_like(send)
    div = inter.size if hier == "leader" else math.prod(sizes)  # elements per final shard: N/div
    e2 = None
    if cfg.stage2_error_feedback:
        e2 = state._buffer("stage2_residual", N // div, x.device)

    c1 = Codec(cfg.bits, cfg.block_size, cfg.stochastic_rounding)
    c2 = Codec(cfg.resolved_stage2_bits, cfg.block_size, cfg.stochastic_rounding)
    gens = []
    for s, t in _chunks(N, unit, cfg.chunk_size):
        sv = None if sent is None else sent[s:t]
        ev = None if e2 is None else e2[s // div:t // div]
        if hier == "none":
            gens.append(_levels_rounds(send[s:t], [(comm, c1)], c2, alpha, seeds, s, sv, ev))
        elif hier == "two_level":
            ci = Codec(cfg.intra_bits, cfg.block_size, cfg.stochastic_rounding)
            gens.append(_levels_rounds(send[s:t], [(intra, ci), (inter, c1)], c2, alpha, seeds, s, sv, ev))
        else:
            gens.append(_leader_rounds(send[s:t], intra, inter, cfg, alpha, seeds, s, sv, ev))
    parts = yield from pipeline(gens)
    out = torch.cat(parts) if len(parts) > 1 else parts[0]

    if ef == "ef":
        if hier == "leader" and intra.rank != 0:
            pass  # non-leaders send nothing across nodes: no residual
        else:
            _finite_(torch.sub(send, sent, out=sent))
    elif ef == "ef21":
        g = state._buffer("global_estimate", N, x.device)
        # ``out`` is identical on every rank, so all ranks agree whether this step was finite.
        # A step with NaN/Inf (an overflow AMP will skip) shows in the result but moves neither
        # estimate, keeping g the mean of the g_i and later steps finite.
        if bool(torch.isfinite(out).all()):
            if not (hier == "leader" and intra.rank != 0):
                state.local_estimate.add_(sent)
            out = g.add_(out)
        else:
            out = g + out
    if cfg.hadamard:
        out = _hadamard(out)
    flat.copy_(out[:n].view(flat.shape))


def reduce_scatter_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                          state: Optional[LowBitState] = None, *, average: bool = False,
                          key=0) -> Iterator:
    """Round generator: ``output`` (k elements) = this rank's shard of the low-bit sum of ``input``.

    ``input`` holds P shards of k elements (shard j goes to rank j). This is the first half of
    the two-stage all-reduce (quantize shards -> all-to-all -> dequantize and sum in float32);
    the result is not requantized. ``error_feedback="ef"`` keeps the input residual.

    Example::

        drive(reduce_scatter_rounds(out, inp, Comm(group), LowBitConfig(bits=4)))
    """
    P = comm.size
    k = output.numel()
    if input.numel() != P * k:
        raise ValueError(f"reduce_scatter input has {input.numel()} elements; it needs world size "
                         f"{P} x output numel {k} = {P * k}")
    if not (input.is_floating_point() and output.is_floating_point()):
        raise TypeError("low-bit reduce_scatter needs floating tensors")
    if cfg.error_feedback == "ef21":
        raise ValueError("error_feedback='ef21' is defined for all_reduce only; use 'ef' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = torch.zeros(P, m, dtype=torch.float32, device=input.device)
    x[:, :k].copy_(input.reshape(P, k))
    x = x.view(-1)
    if cfg.hadamard:
        x = _hadamard(x)
    state._bind(P * m)
    step = state.step
    state.step += 1
    sent = None
    if cfg.error_feedback == "ef":
        sent = state._buffer("residual", P * m, x.device)
        x.add_(sent)
    seed = stage_seed(cfg.seed, key_id(key), step, _world_rank(comm), 0)
    acc = yield from _scatter_reduce(x, comm, Codec(cfg.bits, cfg.block_size, cfg.stochastic_rounding),
                                     seed, 0, sent)
    if sent is not None:
        _finite_(torch.sub(x, sent, out=sent))
    if average:
        acc.mul_(1.0 / P)
    if cfg.hadamard:
        acc = _hadamard(acc)
    output.copy_(acc[:k].view(output.shape))


def all_gather_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                      state: Optional[LowBitState] = None, *, key=0) -> Iterator:
    """Round generator: ``output`` (P x k) receives every rank's ``input`` (k), sent in low bit.

    Each rank quantizes its input once; every rank, the sender included, dequantizes the
    gathered bytes, so all ranks hold bitwise-identical outputs. ``error_feedback="ef"`` adds
    the previous quantization residual to the input before sending.

    Example::

        drive(all_gather_rounds(out, inp, Comm(group), LowBitConfig(bits=8)))
    """
    P = comm.size
    k = input.numel()
    if output.numel() != P * k:
        raise ValueError(f"all_gather output has {output.numel()} elements; it needs world size "
                         f"{P} x input numel {k} = {P * k}")
    if not (input.is_floating_point() and output.is_floating_point()):
        raise TypeError("low-bit all_gather needs floating tensors")
    if cfg.error_feedback == "ef21":
        raise ValueError("error_feedback='ef21' is defined for all_reduce only; use 'ef' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = _pad(input, m, cfg, state)
    state._bind(m)
    step = state.step
    state.step += 1
    codec = Codec(cfg.bits, cfg.block_size, cfg.stochastic_rounding)
    if cfg.error_feedback == "ef":
        x.add_(state._buffer("residual", m, x.device))
    R = codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    codec.encode(x, buf, stage_seed(cfg.seed, key_id(key), step, _world_rank(comm), 0), 0)
    if cfg.error_feedback == "ef":
        codec.decode(buf, m, state.residual)
        _finite_(torch.sub(x, state.residual, out=state.residual))
    gathered = torch.empty(P * R, dtype=torch.uint8, device=x.device)
    yield comm.all_gather(gathered, buf)
    rows = gathered.view(P, R)
    vals = torch.empty(P, m, dtype=torch.float32, device=x.device)
    for j in range(P):
        codec.decode(rows[j], m, vals[j])
    if cfg.hadamard:
        vals = _hadamard(vals.view(-1)).view(P, m)
    output.copy_(vals[:, :k].reshape(output.shape))


def wire_bytes_all_reduce(numel: int, world: int, cfg: LowBitConfig) -> int:
    """Bytes one rank hands to the network for a flat low-bit all_reduce of ``numel`` elements.

    All-to-all of P rows at ``bits`` plus the all-gather of one row at ``stage2_bits``
    (what :class:`~bitscom.compressors.base.Comm` counts: each collective's input buffer).

    Example::

        wire_bytes_all_reduce(1 << 20, 4, LowBitConfig(bits=4))
    """
    unit = world * cfg.block_size
    N = max(unit, -(-numel // unit) * unit)
    m = N // world
    return world * Codec(cfg.bits, cfg.block_size).row_bytes(m) + \
        Codec(cfg.resolved_stage2_bits, cfg.block_size).row_bytes(m)
