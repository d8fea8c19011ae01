"""Low-bit collectives, written once as round generators.

Every algorithm here is a generator that issues asynchronous collectives through one or more
:class:`bitscom.comm.Comm` objects (over a torch.distributed group, or the backend's inner
backends), yields their work handles and continues once they completed. The same generator is
driven by the optimizer's engine (:class:`bitscom.compressors.LowBit`), by
:class:`bitscom.LowBitGroup` and by the ``lowbit`` torch.distributed backend, so the three
cannot drift apart.

Two-stage all-reduce, for P ranks (``all_reduce_rounds``):

1. pad the flat tensor to ``N = P * m`` (``m`` a multiple of ``block_size``), optionally
   rotate it by a Hadamard transform, apply error feedback;
2. quantize shard ``j`` (``bitwidth``; wire format: ``docs/format.md``, :class:`~bitscom.quantization.Codec`) into row ``j`` of a send buffer and all-to-all it: rank
   ``r`` receives shard ``r`` of every rank;
3. dequantize the P rows and sum them in float32, in rank order (scale by ``1/P`` to average);
4. requantize the reduced shard at ``stage2_bitwidth`` (its own setting: see :data:`DEFAULT_STAGE2_BITS`)
   and all-gather the bytes;
5. every rank dequantizes *the gathered bytes*, its own shard included, so every rank ends
   with bitwise-identical values.

Hierarchical variants stack the same steps over an intra-node and an inter-node group (see
:class:`LowBitConfig.hierarchy`); ``chunk_size`` cuts the tensor into chunks run in lockstep,
so chunk ``k``'s inter-node round is in flight together with chunk ``k+1``'s intra-node round.

Stochastic-rounding seeds are derived from (config seed, key, step, rank, stage) by
:func:`~bitscom.quantization.stage_seed`: different for every rank, stage and step, and
reproducible from a checkpoint. Error feedback is :class:`~bitscom.error_feedback.ErrorFeedback`,
the same object every compressor uses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from .error_feedback import ErrorFeedback
from .quantization import FULL_PRECISION, SUPPORTED_BITS, Codec, hadamard as _hadamard, key_id, stage_seed

__all__ = ["FULL_PRECISION", "EF_MODES", "HIERARCHIES", "BACKEND_OPS", "ALIASES", "DEFAULT_STAGE2_BITS",
           "LowBitConfig", "LowBitState", "Codec", "all_reduce_rounds", "reduce_scatter_rounds",
           "all_gather_rounds", "same_size_rounds", "pipeline", "stage_seed", "key_id",
           "wire_bytes_all_reduce"]

EF_MODES = ("none", "legacy", "ef21", "ef21_plus")
"""Error-feedback modes, by the seed's names (see :class:`LowBitConfig`)."""
HIERARCHIES = ("none", "leader", "two_level")
BACKEND_OPS = ("all_reduce", "reduce_scatter", "all_gather")
"""Collectives the ``lowbit`` backend can send in low bit (:attr:`LowBitConfig.backend_ops`)."""
ALIASES = {"bits": "bitwidth", "stage2_bits": "stage2_bitwidth", "intra_bits": "intra_bitwidth",
           "hierarchical": "hierarchy"}
"""Exact aliases :meth:`LowBitConfig.build` accepts for a setting (older bitscom names)."""

DEFAULT_STAGE2_BITS = {1: 4, 2: 4, 4: 4, 8: 8, 12: 12, 16: 16, 32: 32}
"""Default width of the requantized reduced shard, per first-stage width: never below 4.

Measured (docs/lowbit.md; ``scripts/collective_compare.py``): requantizing a reduced
shard at 1 or 2 bits has a relative error of 0.6-1.1 *by itself* (a ternary or sign code
keeps little of a near-Gaussian sum, and stochastic rounding at 2 bits is worse than sending
nothing), while 4 bits costs ~0.12 and 8 bits ~0.007. Stage 2 is not averaged over ranks,
so a 1- or 2-bit first stage is paired with a 4-bit second stage; pass ``stage2_bitwidth=8``
when accuracy matters more than the all-gather's bytes.
"""

_WIDTHS = tuple(SUPPORTED_BITS) + (FULL_PRECISION,)


def _check_width(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in _WIDTHS:
        raise ValueError(f"{name}={value!r} is not supported; allowed widths are {_WIDTHS} "
                         f"({FULL_PRECISION} = full-precision float32)")


@dataclass(frozen=True)
class LowBitConfig:
    """Settings of the low-bit collectives, one object for every face; every rank must use equal
    settings (checked).

    The same settings, by the same names, configure :class:`bitscom.compressors.LowBit`,
    :class:`bitscom.LowBitGroup`, :func:`bitscom.register_lowbit_backend` and
    ``bitscom.init(bitwidth=...)``: each takes ``config=`` or these names as keywords
    (:meth:`build`).

    Attributes:
        bitwidth: first-stage width (what each rank sends in the all-to-all; in ``two_level`` the
            inter-node all-to-all): 1, 2, 4, 8, 12, 16, or 32 (float32). Fewer bits = fewer bytes,
            more error; 1 = scaled sign.
        stage2_bitwidth: width of the requantized reduced shard that is all-gathered. It costs
            as many bytes as stage 1 on a ring, but its error is not averaged over ranks; ``None``
            takes :data:`DEFAULT_STAGE2_BITS` (max(bitwidth, 4)).
        block_size: elements per scale (power of two, 32..65536). Small blocks track magnitudes
            better, each block costs 16 bits of scale.
        stochastic_rounding: unbiased rounding (errors average out over ranks and steps) at about
            twice the per-element variance of round-to-nearest.
        hadamard: rotate 32-element runs by an orthonormal Hadamard transform before quantizing
            (SDP4Bit): spreads outliers so a block's scale fits its typical value; costs two
            extra passes over memory.
        error_feedback: the seed's switch: ``True`` means ``error_feedback_mode="legacy"``.
            After construction it reads ``error_feedback_mode != "none"``.
        error_feedback_mode: ``"none"``; ``"legacy"`` keeps the residual of the first-stage
            quantization and adds it to the next input (unbiased over time, one extra buffer);
            ``"ef21"`` keeps an estimate ``g_i`` per rank, sends ``C(x - g_i)`` and maintains the
            aggregate estimate (two extra buffers; the output is the estimate, not the raw
            average); ``"ef21_plus"`` is ``"ef21"`` plus ``stage2_error_feedback``. ``None``
            (default) follows ``error_feedback``.
        stage2_error_feedback: keep the residual of the stage-2 requantization of this rank's
            reduced shard and add it back next step; one buffer of n/P. Implied by ``ef21_plus``.
        hierarchy: ``"none"`` (flat over one group), ``"leader"`` (the seed's pipeline A: local
            reduce to the node leader -> low-bit all-reduce among the leaders -> local broadcast:
            fewer inter-node flows, the local stage in full precision unless ``local_quantize``)
            or ``"two_level"`` (SDP4Bit: intra-node all-to-all at ``intra_bitwidth`` ->
            inter-node all-to-all at ``bitwidth`` -> all-gathers: every rank uses the inter-node
            links, 1/L of the data each).
        intra_bitwidth: width of the intra-node stage (``two_level``; ``leader`` with
            ``local_quantize``). Intra-node links are fast, so 8 bits or 32 (full) is typical.
        local_quantize: ``leader`` only: quantize the local stage at ``intra_bitwidth``.
        chunk_size: elements per pipelined chunk (``None`` = one chunk). Smaller chunks overlap
            the stages better but launch more, smaller collectives.
        seed: base of the stochastic-rounding seeds.
        simulate_quantization: compute exactly what the low-bit wire would give (every setting
            above honoured) but send the dequantized values as float32: the accuracy of a
            setting without its bandwidth saving, for validation.
        backend_ops: which collectives the ``lowbit`` backend sends in low bit: any of
            :data:`BACKEND_OPS`; the others are forwarded exactly. :class:`~bitscom.LowBitGroup`
            and :class:`~bitscom.compressors.LowBit` ignore it (their methods say what they do).

    Example::

        cfg = LowBitConfig(bitwidth=4, stochastic_rounding=True, error_feedback=True)
        cfg.error_feedback_mode            # 'legacy'
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
        _check_width("bitwidth", self.bitwidth)
        _check_width("stage2_bitwidth", self.stage2_bitwidth, allow_none=True)
        _check_width("intra_bitwidth", self.intra_bitwidth)
        kernels.format.check_block_size(self.block_size)
        for name in ("stochastic_rounding", "hadamard", "error_feedback", "stage2_error_feedback",
                     "local_quantize", "simulate_quantization"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool (True or False), got {getattr(self, name)!r}"
                                + (f"; pick a mode with error_feedback_mode={EF_MODES}"
                                   if name == "error_feedback" else ""))
        mode = self.error_feedback_mode
        if mode is None:
            mode = "legacy" if self.error_feedback else "none"
        if mode not in EF_MODES:
            hint = " ('ef' is now called 'legacy')" if mode == "ef" else ""
            raise ValueError(f"error_feedback_mode={mode!r} is not one of {EF_MODES}{hint}")
        if self.error_feedback and mode == "none":
            raise ValueError("error_feedback=True contradicts error_feedback_mode='none'; pass one "
                             f"of them (error_feedback=True means 'legacy'; modes: {EF_MODES})")
        stage2_ef = self.stage2_error_feedback
        if mode == "ef21_plus":
            stage2_ef = True
        elif mode == "ef21" and stage2_ef:
            mode = "ef21_plus"          # the same algorithm under its one name
        object.__setattr__(self, "error_feedback_mode", mode)
        object.__setattr__(self, "error_feedback", mode != "none")
        object.__setattr__(self, "stage2_error_feedback", stage2_ef)
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
        ops = self.backend_ops
        if isinstance(ops, str) or not isinstance(ops, (tuple, list, set, frozenset)) \
                or any(op not in BACKEND_OPS for op in ops):
            raise ValueError(f"backend_ops={ops!r} must be a tuple of names from {BACKEND_OPS}")
        object.__setattr__(self, "backend_ops", tuple(op for op in BACKEND_OPS if op in ops))
        if self.ef21 and set(self.backend_ops) - {"all_reduce"}:
            raise ValueError(f"error_feedback_mode={mode!r} is defined for all_reduce only; "
                             f"backend_ops={self.backend_ops} also compresses reduce_scatter/all_gather "
                             "(use 'legacy' or 'none' there)")

    @classmethod
    def build(cls, config: Optional["LowBitConfig"] = None, **settings) -> "LowBitConfig":
        """``config`` (default: all defaults) with ``settings`` replaced, by their names or
        :data:`ALIASES`; an unknown name is a ``TypeError`` listing the allowed ones.

        Example::

            LowBitConfig.build(bits=2, error_feedback_mode="ef21")
        """
        if config is not None and not isinstance(config, LowBitConfig):
            raise TypeError(f"config must be a LowBitConfig, got {type(config).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for key, value in settings.items():
            name = ALIASES.get(key, key)
            if name not in names:
                raise TypeError(f"unknown low-bit setting {key!r}; the settings are {names} "
                                f"(aliases: {ALIASES})")
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
    def legacy(self) -> bool:
        """Residual error feedback on the first stage (mode ``"legacy"``)."""
        return self.error_feedback_mode == "legacy"

    @property
    def ef21(self) -> bool:
        """EF21 estimates (modes ``"ef21"`` and ``"ef21_plus"``)."""
        return self.error_feedback_mode in ("ef21", "ef21_plus")

    @property
    def needs_state(self) -> bool:
        return self.error_feedback or self.stage2_error_feedback or self.stochastic_rounding

    def codec(self, bits: int) -> Codec:
        """The :class:`~bitscom.quantization.Codec` of a stage at width ``bits``."""
        return Codec(bits, self.block_size, self.stochastic_rounding, self.simulate_quantization)


class LowBitState:
    """Mutable state of one stream of reductions (one bucket, or one user key).

    ``step`` advances once per reduction and keys the stochastic-rounding seeds; ``residual``
    (mode ``"legacy"``) and ``stage2_residual`` (``stage2_error_feedback``) are
    :class:`~bitscom.error_feedback.ErrorFeedback` residuals, ``local_estimate`` /
    ``global_estimate`` the EF21 estimates g_i and g; tensors are created on first use, in the
    transformed domain when ``hadamard`` is on.

    Example::

        state = LowBitState()
        drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(), state))
    """

    _ESTIMATES = ("local_estimate", "global_estimate", "global_shard")

    def __init__(self):
        self.step = 0
        self.numel = None
        self.residual = ErrorFeedback.lazy()
        self.stage2_residual = ErrorFeedback.lazy()
        self.local_estimate = None
        self.global_estimate = None
        self.global_shard = None    # ef21: this rank's exact shard of g (it owns that shard)
        self._workspace = None  # the padded send buffer, reused every step (not checkpointed)

    def workspace(self, numel: int, device) -> torch.Tensor:
        """A float32 scratch buffer of ``numel`` elements kept between steps: allocating a
        bucket-sized buffer each step costs a page-faulting pass over it."""
        t = self._workspace
        if t is None or t.numel() != numel or t.device != torch.device(device):
            t = self._workspace = torch.empty(numel, dtype=torch.float32, device=device)
        return t

    def estimate(self, name: str, numel: int, device) -> torch.Tensor:
        """The EF21 estimate ``name`` (zeros on first use)."""
        t = getattr(self, name)
        if t is None or t.numel() != numel or t.device != torch.device(device):
            t = torch.zeros(numel, dtype=torch.float32, device=device)
            setattr(self, name, t)
        return t

    def bind(self, numel: int) -> None:
        """Tie this state to tensors of ``numel`` elements (a different size is an error)."""
        if self.numel is not None and self.numel != numel:
            raise ValueError(f"this low-bit state was used for tensors of {self.numel} elements and "
                             f"now gets {numel}; use a different key per tensor")
        self.numel = numel

    def state_dict(self) -> dict:
        out = {"step": self.step, "numel": self.numel, "residual": self.residual.state_dict(),
               "stage2_residual": self.stage2_residual.state_dict()}
        for name in self._ESTIMATES:
            t = getattr(self, name)
            out[name] = None if t is None else t.detach().clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.numel = state.get("numel")
        for name in ("residual", "stage2_residual"):
            ef = ErrorFeedback.lazy()
            ef.load_state_dict(state[name])
            setattr(self, name, ef)
        for name in self._ESTIMATES:
            t = state.get(name)
            setattr(self, name, None if t is None else t.detach().clone().to(torch.float32))


def _scatter(x, comm, codec, seed, offset, sent=None):
    """Round: quantize x [P*m] in P shards and all-to-all them; returns the received rows
    (row j = this rank's shard from rank j).

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
    return recv


def _scatter_reduce(x, comm, codec, seed, offset, sent=None):
    """Round: x [P*m] -> this rank's shard summed over the group (float32 [m])."""
    recv = yield from _scatter(x, comm, codec, seed, offset, sent)
    m = x.numel() // comm.size
    acc = torch.empty(m, dtype=torch.float32, device=x.device)
    codec.decode_sum(recv, m, acc)
    return acc


def _encode_with_feedback(x, codec, row, seed, offset, ef: Optional[ErrorFeedback]):
    """Encode ``x`` into ``row``; with ``ef``, encode ``x + e`` and keep ``e = x + e - D(C(x + e))``
    (NaN/Inf entries of the new residual dropped: that step's output shows them)."""
    if ef is None:
        codec.encode(x, row, seed, offset)
        return
    x = ef.compensate(x)
    codec.encode(x, row, seed, offset)
    decoded = torch.empty_like(x)
    codec.decode(row, x.numel(), decoded)
    ef.update(decoded)
    ef.drop_nonfinite()


def _levels_rounds(x, levels, out_codec, alpha, seeds, offset, sent=None, stage2_ef=None,
                   anchor=None, pending=None):
    """Reduce ``x`` through ``levels`` [(comm, codec), ...] (outermost first), then gather back.

    After the last level this rank holds one fully reduced shard; it is scaled by ``alpha``,
    requantized with ``out_codec`` (with ``stage2_ef``'s error feedback) and its bytes travel
    back through the levels by all-gathers (intermediate ranks forward bytes, never re-encode),
    so every rank decodes identical bytes.

    ``anchor`` (EF21 without stage-2 feedback): this rank's exact fp32 shard of the global
    estimate g. What is requantized is then ``anchor + shard`` (the new estimate itself, not
    its increment), and ``(anchor, shard)`` is appended to ``pending`` so the caller adds the
    increment once it knows the step was finite on every rank.
    """
    shard, off = x, offset
    for k, (comm, codec) in enumerate(levels[:-1]):
        m = shard.numel() // comm.size
        shard = yield from _scatter_reduce(shard, comm, codec, seeds(k), off, sent if k == 0 else None)
        off += comm.rank * m
    comm, codec = levels[-1]
    m = shard.numel() // comm.size
    last = len(levels) - 1
    recv = yield from _scatter(shard, comm, codec, seeds(last), off, sent if last == 0 else None)
    off += comm.rank * m
    R = out_codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    if anchor is not None:
        shard = torch.empty(m, dtype=torch.float32, device=x.device)
        codec.decode_sum(recv, m, shard)
        if alpha != 1.0:
            shard.mul_(alpha)
        out_codec.encode(anchor + shard, buf, seeds(len(levels)), off)
        pending.append((anchor, shard))
    elif stage2_ef is None:   # the fused dequantize-sum-scale-requantize kernel
        codec.decode_sum_encode(recv, m, alpha, out_codec, buf, seeds(len(levels)), off)
    else:
        shard = torch.empty(m, dtype=torch.float32, device=x.device)
        codec.decode_sum(recv, m, shard)
        if alpha != 1.0:
            shard.mul_(alpha)
        _encode_with_feedback(shard, out_codec, buf, seeds(len(levels)), off, stage2_ef)
    for comm, _ in reversed(levels):
        gathered = torch.empty(comm.size * buf.numel(), dtype=torch.uint8, device=x.device)
        yield comm.all_gather(gathered, buf)
        buf = gathered
    rows = buf.view(-1, R)
    out = torch.empty(rows.shape[0] * m, dtype=torch.float32, device=x.device)
    for i in range(rows.shape[0]):
        out_codec.decode(rows[i], m, out[i * m:(i + 1) * m])
    return out


def _leader_rounds(x, intra, inter, cfg, alpha, seeds, offset, sent=None, stage2_ef=None,
                   anchor=None, pending=None):
    """Hierarchy "leader" (the seed's pipeline A): local reduce to the node leader -> low-bit
    all-reduce among the leaders -> local broadcast.

    Non-leaders yield ``None`` for each leader round so every chunk takes the same number of
    rounds on every rank: the pipeline then issues collectives in the same order everywhere.
    """
    if cfg.local_quantize:
        local = cfg.codec(cfg.intra_bitwidth)
        y = yield from _levels_rounds(x, [(intra, local)], local, 1.0, lambda s: seeds(10 + s), offset)
        x.copy_(y)  # in place: the caller's error feedback reads the local sum from x
    else:
        yield intra.reduce(x, 0)
    if intra.rank == 0:
        x = yield from _levels_rounds(x, [(inter, cfg.codec(cfg.bitwidth))],
                                      cfg.codec(cfg.resolved_stage2_bitwidth), alpha, seeds, offset,
                                      sent, stage2_ef, anchor, pending)
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
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else comm.rank


def same_size_rounds(comm, what: str, numel: int, average: bool = False, device=None) -> Iterator:
    """Round generator: fail on every rank, with the same message, unless every rank of ``comm``
    passed the same element count (and the same SUM/AVG choice).

    Ranks that pass different sizes to a low-bit collective would otherwise exchange buffers
    of different sizes (gloo aborts the process) or, when the padded sizes happen to agree,
    silently sum misaligned data. One all-gather of two integers per call buys the check;
    the optimizer's compressor does not need it (its plan is checked once, up front).

    Example::

        drive(chain(same_size_rounds(comm, "all_reduce", t.numel()), all_reduce_rounds(...)))
    """
    if comm.size == 1:
        return
    mine = torch.tensor([int(numel), int(bool(average))], dtype=torch.int64, device=device)
    seen = torch.empty(comm.size * 2, dtype=torch.int64, device=mine.device)
    yield comm.all_gather(seen, mine)
    seen = seen.view(comm.size, 2).tolist()
    sizes = [s[0] for s in seen]
    if len(set(sizes)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
        raise ValueError(f"low-bit {what}: ranks passed tensors with different element counts "
                         f"({listing}); every rank must pass the same number of elements")
    if len({s[1] for s in seen}) > 1:
        ops = ", ".join(f"rank {r}: {'AVG' if s[1] else 'SUM'}" for r, s in enumerate(seen))
        raise ValueError(f"low-bit {what}: ranks passed different reduce ops ({ops}); every rank "
                         "must pass the same op")


def all_reduce_rounds(flat: torch.Tensor, comm, cfg: LowBitConfig, state: Optional[LowBitState] = None,
                      *, average: bool = True, key=0, intra=None, inter=None) -> Iterator:
    """Round generator: replace ``flat`` by the low-bit sum (or average) over ranks, in place.

    ``comm`` is the flat group; the hierarchies use ``intra`` and ``inter`` instead (with a
    single node, ``inter.size == 1``, they take one full-precision all-reduce over ``intra``).
    On exit ``flat`` is bitwise identical on every rank. ``state`` is required for error
    feedback and reproducible stochastic rounding; it advances one step per call.

    Example::

        state = LowBitState()
        drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(bitwidth=4), state))
    """
    if not flat.is_floating_point():
        raise TypeError(f"low-bit all_reduce needs a floating tensor, got {flat.dtype}")
    if state is None:
        if cfg.error_feedback or cfg.stage2_error_feedback:
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
    state.bind(n)
    unit = _unit(sizes, cfg)
    x = _pad(flat, unit, cfg, state)
    N = x.numel()
    rank = _world_rank(comm if hier == "none" else intra)
    step, kid = state.step, key_id(key)
    state.step += 1

    def seeds(stage):
        return stage_seed(cfg.seed, kid, step, rank, stage)

    send, sent = x, None
    if cfg.legacy:
        state.residual.ensure(N, x.device)
        send = state.residual.compensate(x)     # x + e, in the residual buffer
        sent = torch.empty_like(send)           # receives D(C(send))
    elif cfg.ef21:
        g_i = state.estimate("local_estimate", N, x.device)
        send = x.sub_(g_i)
        sent = torch.empty_like(send)
    div = inter.size if hier == "leader" else math.prod(sizes)  # elements per final shard: N/div
    e2 = state.stage2_residual.ensure(N // div, x.device) if cfg.stage2_error_feedback else None
    # EF21 without stage-2 feedback: the shard owners keep g exactly and requantize g itself.
    # Adding requantized *increments* to g instead (what ef21_plus does, with stage-2 feedback
    # to pay the rounding back) lets g drift from the mean of the g_i by the sum of every
    # step's stage-2 rounding error: measured, the output error grew from 0.2 to 3.4 (relative)
    # over 400 steps and training diverged (docs/lowbit.md, "EF21").
    anchors = state.estimate("global_shard", N // div, x.device) \
        if cfg.error_feedback_mode == "ef21" else None
    pending: list = []

    c1 = cfg.codec(cfg.bitwidth)
    c2 = cfg.codec(cfg.resolved_stage2_bitwidth)
    gens = []
    for s, t in _chunks(N, unit, cfg.chunk_size):
        sv = None if sent is None else sent[s:t]
        ev = None if e2 is None else ErrorFeedback.over(e2[s // div:t // div])
        av = None if anchors is None else anchors[s // div:t // div]
        if hier == "none":
            gens.append(_levels_rounds(send[s:t], [(comm, c1)], c2, alpha, seeds, s, sv, ev, av, pending))
        elif hier == "two_level":
            ci = cfg.codec(cfg.intra_bitwidth)
            gens.append(_levels_rounds(send[s:t], [(intra, ci), (inter, c1)], c2, alpha, seeds, s, sv, ev,
                                       av, pending))
        else:
            gens.append(_leader_rounds(send[s:t], intra, inter, cfg, alpha, seeds, s, sv, ev, av, pending))
    parts = yield from pipeline(gens)
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if hier == "leader" and len(parts) == 1:
        out = out.clone()   # a follower's result is the broadcast into ``send``, which EF reuses

    leader_follower = hier == "leader" and intra.rank != 0   # sends nothing across nodes
    if cfg.legacy:
        if leader_follower:
            state.residual.reset()
        else:
            state.residual.update(sent)
            state.residual.drop_nonfinite()
    elif cfg.ef21:
        # ``out`` is identical on every rank, so all ranks agree whether this step was finite.
        # A step with NaN/Inf (an overflow AMP will skip) shows in the result but moves no
        # estimate, keeping g the mean of the g_i and later steps finite.
        finite = bool(torch.isfinite(out).all())
        if finite and not leader_follower:
            state.local_estimate.add_(sent)
        if anchors is not None:          # ef21: ``out`` already is the (requantized) estimate g
            if finite:
                for anchor, shard in pending:
                    anchor.add_(shard)
        else:                            # ef21_plus: g += requantized increment
            g = state.estimate("global_estimate", N, x.device)
            out = g.add_(out) if finite else g + out
    if cfg.hadamard:
        out = _hadamard(out)
    flat.copy_(out[:n].view(flat.shape))


def reduce_scatter_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                          state: Optional[LowBitState] = None, *, average: bool = False,
                          key=0) -> Iterator:
    """Round generator: ``output`` (k elements) = this rank's shard of the low-bit sum of ``input``.

    ``input`` holds P shards of k elements (shard j goes to rank j). This is the first half of
    the two-stage all-reduce (quantize shards -> all-to-all -> dequantize and sum in float32);
    the result is not requantized. Mode ``"legacy"`` keeps the input residual.

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
                         "only; use 'legacy' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = torch.zeros(P, m, dtype=torch.float32, device=input.device)
    x[:, :k].copy_(input.reshape(P, k))
    x = x.view(-1)
    if cfg.hadamard:
        x = _hadamard(x)
    state.bind(P * m)
    step = state.step
    state.step += 1
    sent = None
    if cfg.legacy:
        state.residual.ensure(P * m, x.device)
        x = state.residual.compensate(x)
        sent = torch.empty_like(x)
    seed = stage_seed(cfg.seed, key_id(key), step, _world_rank(comm), 0)
    acc = yield from _scatter_reduce(x, comm, cfg.codec(cfg.bitwidth), seed, 0, sent)
    if sent is not None:
        state.residual.update(sent)
        state.residual.drop_nonfinite()
    if average:
        acc.mul_(1.0 / P)
    if cfg.hadamard:
        acc = _hadamard(acc)
    output.copy_(acc[:k].view(output.shape))


def all_gather_rounds(output: torch.Tensor, input: torch.Tensor, comm, cfg: LowBitConfig,
                      state: Optional[LowBitState] = None, *, key=0) -> Iterator:
    """Round generator: ``output`` (P x k) receives every rank's ``input`` (k), sent in low bit.

    Each rank quantizes its input once; every rank, the sender included, dequantizes the
    gathered bytes, so all ranks hold bitwise-identical outputs. Mode ``"legacy"`` adds the
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
                         "only; use 'legacy' or 'none'")
    state = state if state is not None else LowBitState()
    m = max(cfg.block_size, -(-k // cfg.block_size) * cfg.block_size)
    x = _pad(input, m, cfg, state)
    state.bind(m)
    step = state.step
    state.step += 1
    codec = cfg.codec(cfg.bitwidth)
    R = codec.row_bytes(m)
    buf = torch.empty(R, dtype=torch.uint8, device=x.device)
    ef = None
    if cfg.legacy:
        state.residual.ensure(m, x.device)
        ef = state.residual
    _encode_with_feedback(x, codec, buf, stage_seed(cfg.seed, key_id(key), step, _world_rank(comm), 0),
                          0, ef)
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

    All-to-all of P rows at ``bitwidth`` plus the all-gather of one row at ``stage2_bitwidth``
    (what :class:`~bitscom.compressors.base.Comm` counts: each collective's input buffer).

    Example::

        wire_bytes_all_reduce(1 << 20, 4, LowBitConfig(bitwidth=4))
    """
    unit = world * cfg.block_size
    N = max(unit, -(-numel // unit) * unit)
    m = N // world
    return world * cfg.codec(cfg.bitwidth).row_bytes(m) + cfg.codec(cfg.resolved_stage2_bitwidth).row_bytes(m)
