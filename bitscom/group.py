"""LowBitGroup: low-bit collectives for users who call collectives themselves (docs/lowbit.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from . import runtime
from .lowbit import LowBitConfig, LowBitState, all_gather_rounds, all_reduce_rounds, reduce_scatter_rounds
from .comm import Comm, Rounds, is_sum_or_avg
from .call_header import Call, agree_rounds
from .face import ByteLedger, Face, dense_bytes, load_all_or_nothing
from .lowbit import FULL_PRECISION, Quantized, dequantize, quantize
from .validate import instance

__all__ = ["LowBitGroup", "LowBitWork"]

_LABEL = "LowBitGroup"


class LowBitWork(Rounds):
    """An asynchronous low-bit collective; waits drive the group's works in call order up to it. Example::

        wa = lb.all_reduce(a, async_op=True, key="a"); wb = lb.all_reduce(b, async_op=True, key="b")
        wb.wait(); wa.wait()          # any order, on any rank
    """

    def __init__(self, rounds, comms=(), channel=None):
        super().__init__(rounds, comms, keep_going=True)   # a header error is raised on every rank
        self._channel = channel

    def poll(self, block: bool = False) -> bool:
        if not self.done:
            if block:
                self._channel.wait(self)
            else:
                self._channel.poll()
        if self.done and self.error is not None:
            raise self.error
        return self.done


def _handed(work, async_op: bool):
    """``work`` for an asynchronous call, else wait for it and return ``None``."""
    if async_op:
        return work
    work.wait()
    return None


def _chain(*gens):
    result = None
    for g in gens:
        result = yield from g
    return result


class LowBitGroup(Face):
    """Low-bit all_reduce / reduce_scatter / all_gather over a process group (a Face).

    Args:
        bitwidth: first-stage width (1, 2, 4, 8, 12, 16; 32 = float32). The seed's first argument.
        config: a :class:`~bitscom.collectives.LowBitConfig`; keyword settings (its field
            names) override it. State is kept per ``key=`` of each call (else per storage
            address, which is only stable for persistent buffers).
        intra_group, inter_group: groups of the hierarchy (default: ``bitscom.intra_group()``
            and ``bitscom.inter_group()``); ``local_group`` is the seed's name of ``intra_group``.

    Example::

        bitscom.init()
        lb = bitscom.LowBitGroup(bitwidth=4, error_feedback=True)
        lb.all_reduce(grad, op=dist.ReduceOp.AVG, key="layer1.weight")
        work = lb.all_reduce(other, async_op=True, key="other")   # first round in flight
        ...                                                        # overlap compute
        work.wait()
    """

    def __init__(self, bitwidth: Optional[int] = None, process_group=None, *,
                 config: Optional[LowBitConfig] = None, intra_group=None, inter_group=None,
                 local_group=None, **settings):
        if bitwidth is not None:
            settings["bitwidth"] = bitwidth
        self._face_init("LowBitGroup", process_group, warn_single=False)
        error: Optional[BaseException] = None
        try:
            self.config = LowBitConfig.build(config, **settings)
            if local_group is not None and intra_group is not None and local_group is not intra_group:
                raise ValueError("pass intra_group or its seed name local_group, not both")
        except (TypeError, ValueError) as err:
            error = err
        # different settings would exchange bytes of different formats: one error on every rank
        self._face_agree({} if error else {"settings": repr(self.config)}, error, what="LowBitGroup settings")
        self.intra_group = intra_group if intra_group is not None else local_group
        self.inter_group = inter_group
        self._states: Dict[Any, LowBitState] = {}
        self._calls = 0
        self._open: list = []                   # (work, dense bytes) not yet counted
        self._bytes = ByteLedger()              # a step: one finished call
        self._channel = runtime.channel(self.process_group, later=True)

    bitwidth = property(lambda self: self.config.bitwidth)
    simulate_quantization = property(lambda self: self.config.simulate_quantization)
    rank = property(lambda self: dist.get_rank(self.process_group))
    world_size = property(lambda self: dist.get_world_size(self.process_group))

    def _state(self, op: str, key, tensor: torch.Tensor, cfg: LowBitConfig) -> tuple:
        keyed = cfg.error_feedback or cfg.stage2_error_feedback
        if key is None and not keyed:
            st = LowBitState()        # stateless: only the seeds need a fresh step per call
            st.step = self._calls
            self._calls += 1
            return st, ("call", op)
        if key is None:
            key = ("ptr", tensor.data_ptr(), tensor.numel())
        full = (op, key)
        if full not in self._states:
            self._states[full] = LowBitState()
        return self._states[full], full

    def state_dict(self) -> dict:
        """Per-key error-feedback state and the call counter, in the checkpoint envelope."""
        return {"calls": self._calls, "states": {k: s.state_dict() for k, s in self._states.items()},
                "envelope": self._envelope(self._calls)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (all or nothing; checked across ranks at the next call)."""
        if not self._check_envelope(state.get("envelope", {}), per_rank_state=bool(state["states"])):
            self._mark_loaded()
            return

        def load():
            self._calls = int(state["calls"])
            self._states = {}
            for k, s in state["states"].items():
                st = LowBitState()
                st.load_state_dict(s)
                self._states[k] = st

        load_all_or_nothing(lambda: (self._calls, self._states), load, self._restore)
        self._mark_loaded()

    def _restore(self, saved: tuple) -> None:
        self._calls, self._states = saved

    def _before_call(self) -> None:
        """Every call: a clear error if the group is dead; after a load, the ranks compare."""
        self._check_live()
        self._agree_if_resumed(lambda: {"calls": self._calls,
                                        "state steps": sorted(s.step for s in self._states.values())},
                               "LowBitGroup checkpoint")

    def _release_groups(self) -> None:
        self._channel = runtime.channel(None)          # private and empty: holds no group
        self.intra_group = self.inter_group = None

    def close(self) -> None:
        """Forget the group's channel and state; calls afterwards raise."""
        self._face_close()
        self._release_groups()

    def comm_stats(self) -> dict:
        """This rank's bytes (:func:`bitscom.face.report`; a step is one finished call). Example::

            lb.all_reduce(t); lb.comm_stats()["compression_ratio"]
        """
        still = []
        for work, dense in self._open:
            if not work.done:
                still.append((work, dense))
            elif work.error is None:
                self._bytes.add(work.bytes_sent, dense)
                self._bytes.end_step()
        self._open = still
        return self._bytes.report()

    def _start(self, call: Call, device, rounds, comms: list, async_op: bool, numel: int = 0):
        """``rounds`` after the call header, submitted; ``numel``: fp32 elements to count."""
        check = self._channel.comm()
        work = LowBitWork(_chain(agree_rounds(check, call, 0, device, _LABEL), rounds), [check] + comms,
                          self._channel)
        self._channel.submit(work)
        if numel:
            self._open.append((work, dense_bytes(numel)))
        return _handed(work, async_op)

    def _exact(self, call: Call, device, issue, async_op: bool, error: Optional[Exception] = None):
        """The call header, then ``issue(comm)`` exactly (or ``error``, raised on every rank)."""
        comm = self._channel.comm()

        def body():
            if error is not None:
                raise error
            yield issue(comm)

        return self._start(call, device, body(), [comm], async_op)

    def _call_config(self, hierarchical: bool, chunk_size: Optional[int], local_quantize: Optional[bool]):
        cfg = self.config
        given = (("chunk_size", chunk_size), ("local_quantize", local_quantize))
        changes: Dict[str, Any] = {name: value for name, value in given if value is not None}
        if hierarchical and cfg.hierarchy == "none":
            changes["hierarchy"] = "leader"
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   local_group=None, inter_group=None, chunk_size: Optional[int] = None,
                   local_quantize: Optional[bool] = None, key=None):
        """Low-bit two-stage all-reduce of ``tensor`` in place (bitwise identical on every rank).

        ``local_group``/``inter_group`` make it hierarchical (``"leader"`` unless the settings
        name a hierarchy); ``chunk_size``/``local_quantize`` override the settings for this call.
        Integer tensors take the exact collective (AVG of one is an error). Example::

            work = lb.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True, key="t")
            work.wait()
        """
        instance("tensor", tensor, torch.Tensor, "a torch.Tensor")
        self._before_call()
        call = Call.of("all_reduce", op, tensor.dtype, tensor.numel())
        if not tensor.is_floating_point() or not is_sum_or_avg(op):
            error = None
            if op == dist.ReduceOp.AVG:       # raised on every rank, after the header
                error = TypeError(f"LowBitGroup.all_reduce with op=AVG needs a floating tensor, got "
                                  f"{tensor.dtype}; use op=SUM and divide, or pass a float tensor")
            return self._exact(call, tensor.device, lambda comm: comm.all_reduce(tensor, op), async_op, error)
        cfg = self._call_config(local_group is not None or inter_group is not None, chunk_size, local_quantize)
        average = op == dist.ReduceOp.AVG
        st, full_key = self._state("all_reduce", key, tensor, cfg)
        if cfg.hierarchy == "none":
            comms = [self._channel.comm()]
            rounds = all_reduce_rounds(tensor, comms[0], cfg, st, average=average, key=full_key)
        else:
            intra = local_group or self.intra_group or runtime.intra_group()
            inter = inter_group or self.inter_group or runtime.inter_group()
            comms = [Comm(intra), Comm(inter)]
            rounds = all_reduce_rounds(tensor, None, cfg, st, average=average, key=full_key,
                                       intra=comms[0], inter=comms[1])
        return self._start(call, tensor.device, rounds, comms, async_op, tensor.numel())

    def reduce_scatter(self, output: torch.Tensor, input, op=dist.ReduceOp.SUM,
                       async_op: bool = False, key=None):
        """``output`` = this rank's shard of the low-bit sum of ``input`` (P·k, or P tensors). Example::

            lb.reduce_scatter(out, torch.cat(shards), op=dist.ReduceOp.SUM)
        """
        self._before_call()
        if isinstance(input, (list, tuple)):
            input = torch.cat([t.reshape(-1) for t in input])
        call = Call.of("reduce_scatter", op, input.dtype, output.numel())
        if not (input.is_floating_point() and output.is_floating_point()) \
                or not is_sum_or_avg(op):
            return self._exact(call, output.device, lambda comm: comm.reduce_scatter(output, input, op), async_op)
        st, full_key = self._state("reduce_scatter", key, input, self.config)
        comm = self._channel.comm()
        average = op == dist.ReduceOp.AVG
        rounds = reduce_scatter_rounds(output, input, comm, self.config, st, average=average,
                                       key=full_key)
        return self._start(call, output.device, rounds, [comm], async_op, input.numel())

    def all_gather(self, output, input: torch.Tensor, async_op: bool = False, key=None):
        """``output`` (P·k, or P tensors) receives every rank's ``input`` (k), sent in low bit. Example::

            lb.all_gather(out, shard)
        """
        self._before_call()
        if isinstance(output, (list, tuple)):
            outs = list(output)
            flat = torch.empty(len(outs) * input.numel(), dtype=input.dtype, device=input.device)
            work = self.all_gather(flat, input, async_op=True, key=key)
            parts = flat.view(len(outs), -1)

            def scatter():
                yield work
                for o, p in zip(outs, parts):
                    o.copy_(p.view(o.shape))

            return _handed(Rounds(scatter()).start(), async_op)
        call = Call.of("all_gather", dist.ReduceOp.SUM, input.dtype, input.numel())
        if not (input.is_floating_point() and output.is_floating_point()):
            return self._exact(call, input.device, lambda comm: comm.all_gather(output, input), async_op)
        st, full_key = self._state("all_gather", key, input, self.config)
        comm = self._channel.comm()
        rounds = all_gather_rounds(output, input, comm, self.config, st, key=full_key)
        return self._start(call, input.device, rounds, [comm], async_op, output.numel())

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Exact broadcast from global rank ``src`` (the seed's API; nothing to compress)."""
        self._before_call()
        root = dist.get_group_rank(self.process_group, src) if self.process_group is not None else src
        call = Call.of("broadcast", dist.ReduceOp.SUM, tensor.dtype, tensor.numel())
        return self._exact(call, tensor.device, lambda comm: comm.broadcast(tensor, root), async_op)

    def compress(self, tensor: torch.Tensor, seed: int = 0) -> Quantized:
        """Quantize ``tensor`` with this group's format (what one rank would send). Example::

            c = lb.compress(t); t2 = lb.decompress(c)
        """
        cfg = self.config
        if cfg.bitwidth == FULL_PRECISION:
            raise ValueError("bitwidth=32 sends float32; there is nothing to compress")
        return quantize(tensor, cfg.bitwidth, cfg.block_size, stochastic_rounding=cfg.stochastic_rounding,
                        seed=seed, hadamard=cfg.hadamard)

    def decompress(self, c: Quantized) -> torch.Tensor:
        """Inverse of :meth:`compress` (original shape and dtype)."""
        return dequantize(c)
