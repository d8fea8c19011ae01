"""The all-gather FSDP2 calls for one parameter group, sent in low bit (qwZ or SDP4Bit qWD).
``input_tensor`` is slot ``rank`` of ``output_tensor`` (FSDP's padded shards in parameter order);
every slot, this rank's included, gets the decoded values, so every rank computes alike.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch

from .. import runtime
from ..comm import Rounds
from ..lowbit.codec import Codec
from ..lowbit.seeds import key_id, mix_seed
from ..lowbit.weight_delta import add_delta, encode_delta
from .weight_settings import WeightConfig
from .weight_state import GatherCount, WeightState

__all__ = ["LowBitAllGather", "WeightGathers", "Segment", "segments", "row_layout"]


class Segment(NamedTuple):
    """One parameter's shard in a rank's slot; quantized when floating, large enough and smaller so."""

    offset: int
    numel: int
    dtype: torch.dtype
    quantized: bool

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def segments(fsdp_params, cfg: WeightConfig) -> List[Segment]:
    """The layout of one rank's all-gather input: each parameter's padded shard, in FSDP's order."""
    out, offset, codec = [], 0, cfg.codec()
    for fp in fsdp_params:
        try:
            dtype = fp.param_dtype or fp.orig_dtype
            n = fp.padded_sharded_param_size.numel()
        except AttributeError as err:    # FSDP2 internals of another torch
            raise RuntimeError(f"bitscom.fsdp weights reads FSDPParam.param_dtype / orig_dtype / "
                               f"padded_sharded_param_size, which torch {torch.__version__} does not have "
                               f"({err}); use torch 2.13 (tested) or pass weights=None") from err
        small = n < cfg.min_numel or codec.row_bytes(n) >= n * _itemsize(dtype)
        out.append(Segment(offset, n, dtype, dtype.is_floating_point and not small))
        offset += n * _itemsize(dtype)
    return out


def row_layout(segs: List[Segment], codec: Optional[Codec]) -> List[int]:
    """Bytes of each segment in a rank's row: the codec's row when quantized, else exact."""
    return [codec.row_bytes(s.numel) if codec is not None and s.quantized else s.nbytes for s in segs]


def _values(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` values stored in the uint8 ``raw`` (copied: ``raw`` may be misaligned)."""
    out = torch.empty(raw.numel() // _itemsize(dtype), dtype=dtype, device=raw.device)
    out.view(torch.uint8).copy_(raw)
    return out


def _gather(comm, out: torch.Tensor, row: torch.Tensor):
    yield comm.all_gather(out, row)


class LowBitAllGather:
    """FSDP's ``AllGather`` for one FSDP module's parameter group (see the module docstring).

    ``fsdp_params`` returns the group's ``FSDPParam`` list at each gather (FSDP builds it lazily).

    Example::

        fsdp_module.set_custom_all_gather(LowBitAllGather(WeightConfig(), "0", WeightState(),
                                                          GatherCount(), lambda: group.fsdp_params))
    """

    def __init__(self, cfg: WeightConfig, key: str, state: WeightState, counter: GatherCount,
                 fsdp_params: Callable[[], list], before: Optional[Callable[[], None]] = None):
        self.cfg, self.key, self.state, self.counter = cfg, key, state, counter
        self.fsdp_params, self.before = fsdp_params, before
        self.codec = cfg.codec()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's output buffer: plain ``torch.empty``."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False) -> None:
        """Fill every slot of ``output_tensor`` with the decoded shards (synchronous)."""
        if self.before is not None:
            self.before()
        world, rank = group.size(), group.rank()
        out = output_tensor.view(torch.uint8)
        mine = input_tensor.view(torch.uint8)
        segs = self._layout(mine.numel(), out.numel(), world, out.device)
        codec = self._codec()
        sizes = row_layout(segs, codec)
        row = torch.empty(sum(sizes), dtype=torch.uint8, device=out.device)
        self._encode(segs, sizes, codec, mine, row, rank)
        rows = torch.empty(world * row.numel(), dtype=torch.uint8, device=out.device)
        channel = runtime.channel(group)          # one order with every face on the group
        comm = channel.comm()
        channel.wait(channel.submit(Rounds(_gather(comm, rows, row), [comm])))
        for j in range(world):
            self._decode(segs, sizes, codec, rows[j * row.numel():(j + 1) * row.numel()], out, j, mine.numel())
        if self.cfg.difference:          # the replica every rank now computes with
            if self.state.reference is None:
                self.state.reference = out.clone()
            else:
                self.state.reference.copy_(out)
        self.state.gathers += 1
        self.counter.bytes_sent += comm.bytes_sent
        self.counter.dense_bytes += mine.numel()
        self.counter.calls += 1

    def _layout(self, slot_bytes: int, out_bytes: int, world: int, device: torch.device) -> List[Segment]:
        segs = segments(self.fsdp_params(), self.cfg)
        total = sum(s.nbytes for s in segs)
        if total != slot_bytes or out_bytes != world * slot_bytes:
            raise ValueError(
                f"bitscom.fsdp weights: FSDP module {self.key!r} all-gathers {slot_bytes} bytes per rank, "
                f"but its parameters' padded shards make {total}: the low-bit all-gather supports plain "
                "parameters sharded on FSDP's mesh (not reshard_after_forward=<int> nor tensor subclasses "
                "with their own fsdp_pre_all_gather)")
        ref = self.state.reference
        if ref is not None and ref.device != device:     # loaded from a checkpoint (CPU)
            self.state.reference = ref = ref.to(device)
        if ref is not None and ref.numel() != out_bytes:
            raise ValueError(f"bitscom.fsdp weights: module {self.key!r} kept a {ref.numel()}-byte copy of its "
                             f"parameters but FSDP now gathers {out_bytes} bytes; the model or its "
                             "sharding changed since the copy was taken (or the checkpoint is another model's)")
        return segs

    def _codec(self) -> Optional[Codec]:
        """The codec of this gather; ``None`` (all exact) for the first gather of ``"difference"``."""
        return None if self.cfg.difference and self.state.reference is None else self.codec

    def _encode(self, segs, sizes, codec, mine, row, rank) -> None:
        pos, ref = 0, self.state.reference
        for i, (s, size) in enumerate(zip(segs, sizes)):
            src, dst = mine[s.offset:s.offset + s.nbytes], row[pos:pos + size]
            pos += size
            if codec is None or not s.quantized:
                dst.copy_(src)
                continue
            x = _values(src, s.dtype)
            if ref is None:
                codec.encode(x.to(torch.float32), dst, 0)
            else:
                at = rank * mine.numel() + s.offset
                seed = mix_seed(self.cfg.seed, key_id(self.key), self.state.gathers, rank, i)
                encode_delta(codec, x, _values(ref[at:at + s.nbytes], s.dtype), dst, seed)

    def _decode(self, segs, sizes, codec, row, out, j, slot_bytes) -> None:
        pos, ref = 0, self.state.reference
        for s, size in zip(segs, sizes):
            src = row[pos:pos + size]
            pos += size
            at = j * slot_bytes + s.offset
            dst = out[at:at + s.nbytes]
            if codec is None or not s.quantized:
                dst.copy_(src)
                continue
            value = codec.decode(src, s.numel)
            if ref is not None:
                value = add_delta(_values(ref[at:at + s.nbytes], s.dtype), value)
            dst.copy_(value.to(s.dtype).view(torch.uint8))


class WeightGathers:
    """What the handle keeps for the parameter all-gathers: settings, one :class:`WeightState`
    per FSDP module and the byte count.

    Example::

        wg = WeightGathers(WeightConfig(), ["0", "1", ""])
        wg.stats()["all_gather_bytes_sent"]
    """

    def __init__(self, cfg: WeightConfig, names: List[str]):
        self.cfg = cfg
        self.states = {name: WeightState() for name in names}
        self.counter = GatherCount()

    def install(self, name: str, module, fsdp_params: Callable[[], list], before) -> LowBitAllGather:
        """Put module ``name``'s :class:`LowBitAllGather` on the FSDP module ``module``."""
        ag = LowBitAllGather(self.cfg, name, self.states[name], self.counter, fsdp_params, before)
        module.set_custom_all_gather(ag)
        return ag

    def stats(self) -> dict:
        """``all_gather_bytes_sent``, ``all_gather_dense_bytes``, their ratio and ``all_gathers``."""
        c = self.counter
        ratio = c.dense_bytes / c.bytes_sent if c.bytes_sent else float("nan")
        return {"all_gather_bytes_sent": c.bytes_sent, "all_gather_dense_bytes": c.dense_bytes,
                "all_gather_compression_ratio": ratio, "all_gathers": c.calls}

    def reset_stats(self) -> None:
        self.counter.bytes_sent = self.counter.dense_bytes = self.counter.calls = 0

    def describe(self) -> dict:
        return {name: s.describe() for name, s in sorted(self.states.items())}

    def state_dict(self) -> dict:
        return {"config": repr(self.cfg), "states": {k: s.state_dict() for k, s in self.states.items()},
                "calls": self.counter.calls}

    def check(self, state) -> None:
        """A ``ValueError`` unless ``state`` is this model's and these settings' weight state."""
        if not isinstance(state, dict) or state.get("config") != repr(self.cfg):
            got = state.get("config") if isinstance(state, dict) else None
            raise ValueError(f"checkpoint's parameter all-gather settings are {got}, this model's {self.cfg!r}")
        if set(state.get("states", {})) != set(self.states):
            raise ValueError(f"checkpoint has weight states of FSDP modules {sorted(state.get('states', {}))}, "
                             f"this model {sorted(self.states)}")

    def load_state_dict(self, state: dict) -> None:
        for name, s in self.states.items():
            s.load_state_dict(state["states"][name])
        self.counter.calls = int(state.get("calls", self.counter.calls))
