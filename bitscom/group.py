"""LowBitGroup: low-bit collectives for users who call collectives themselves.

A thin adapter over :mod:`bitscom.collectives`: it holds the settings, one
:class:`~bitscom.collectives.LowBitState` per key (error feedback, seeds) and drives the
round generators, synchronously or through a :class:`LowBitWork` whose ``wait()`` drives
the rounds still to come. Non-float tensors and reductions other than SUM/AVG take the exact
``torch.distributed`` collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from . import runtime
from .agreement import check_agreement
from .collectives import (LowBitConfig, LowBitState, all_gather_rounds, all_reduce_rounds,
                          reduce_scatter_rounds)
from .compressors.base import Comm, _all_gather_flat, _reduce_scatter_flat, _wait
from .quantization import Quantized, dequantize, quantize

__all__ = ["LowBitGroup", "LowBitWork"]


class LowBitWork:
    """Handle of an asynchronous low-bit collective.

    On return from the collective its first round is already in flight; ``wait()`` waits for
    it and drives the remaining rounds (issuing them in the order ``wait()`` calls happen, the
    same on every rank as long as every rank waits in the same order).
    """

    def __init__(self, rounds, comms):
        self._rounds = rounds
        self._comms = comms
        self._done = False
        self._work = None
        self._advance()

    def _advance(self) -> None:
        try:
            self._work = next(self._rounds)
        except StopIteration:
            self._work, self._done = None, True
        for c in self._comms:
            c.mark_yield()

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout=None) -> bool:
        while not self._done:
            if self._work is not None:
                _wait(self._work)
            self._advance()
        return True

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self._comms)


class _ExactWork:
    """Wraps a torch Work (or None) plus a step to run after it (e.g. AVG's division)."""

    def __init__(self, work, after=None):
        self._work, self._after, self._done = work, after, False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._after is not None:
                self._after()
            self._done = True
        return True


def _is_sum(op) -> bool:
    return op == dist.ReduceOp.SUM


def _is_avg(op) -> bool:
    return op == dist.ReduceOp.AVG


class LowBitGroup:
    """Low-bit all_reduce / reduce_scatter / all_gather over a process group.

    Args:
        bitwidth: first-stage width (1, 2, 4, 8, 12, 16; 32 = float32).
        process_group: the group (default: bitscom's world group, else torch's default group).
        block_size, stochastic_rounding, stage2_bits, stage2_error_feedback, hadamard,
        hierarchy, intra_bits, local_quantize, chunk_size, seed: see
            :class:`~bitscom.collectives.LowBitConfig` (each with its trade-off).
        error_feedback: "none" | "ef" | "ef21". State is kept per key: pass ``key=`` to each
            call (any hashable, e.g. a parameter name); without it the key is the tensor's
            storage address, which is only stable for persistent buffers.
        simulate_quantization: quantize-dequantize locally, then run the exact collective:
            the accuracy of the low-bit format without its machinery.
        intra_group, inter_group: groups of the hierarchy (default: ``bitscom.intra_group()``
            and ``bitscom.inter_group()``).

    Example::

        bitscom.init()
        lb = bitscom.LowBitGroup(bitwidth=4, error_feedback="ef")
        lb.all_reduce(grad, op=dist.ReduceOp.AVG, key="layer1.weight")
        work = lb.all_reduce(other, async_op=True, key="other")   # first round in flight
        ...                                                        # overlap compute
        work.wait()
    """

    def __init__(self, bitwidth: int = 4, process_group=None, block_size: int = 128,
                 stochastic_rounding: bool = False, error_feedback: str = "none",
                 simulate_quantization: bool = False, stage2_bits: Optional[int] = None,
                 stage2_error_feedback: bool = False, hadamard: bool = False,
                 hierarchy: str = "none", intra_bits: int = 8, local_quantize: bool = False,
                 chunk_size: Optional[int] = None, seed: int = 0, intra_group=None,
                 inter_group=None):
        self.config = LowBitConfig(bits=bitwidth, stage2_bits=stage2_bits, block_size=block_size,
                                   stochastic_rounding=stochastic_rounding, hadamard=hadamard,
                                   error_feedback=error_feedback,
                                   stage2_error_feedback=stage2_error_feedback, hierarchy=hierarchy,
                                   intra_bits=intra_bits, local_quantize=local_quantize,
                                   chunk_size=chunk_size, seed=seed)
        if not isinstance(simulate_quantization, bool):
            raise TypeError(f"simulate_quantization must be a bool, got {simulate_quantization!r}")
        self.simulate_quantization = simulate_quantization
        if process_group is None and runtime.is_initialized():
            process_group = runtime.world_group()
        self.process_group = process_group
        self.intra_group = intra_group
        self.inter_group = inter_group
        self._states: Dict[Any, LowBitState] = {}
        self._calls = 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            # Ranks with different settings would exchange bytes of different formats: fail
            # here, on every rank, with what differs.
            check_agreement({"settings": repr(self.config), "simulate": simulate_quantization},
                            process_group, "LowBitGroup settings")

    @property
    def bitwidth(self) -> int:
        return self.config.bits

    # -- state --------------------------------------------------------------------------------
    def _state(self, op: str, key, tensor: torch.Tensor, cfg: LowBitConfig) -> tuple:
        keyed = cfg.error_feedback != "none" or cfg.stage2_error_feedback
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
        """Per-key error-feedback state and the call counter (keys as given)."""
        return {"calls": self._calls, "states": {k: s.state_dict() for k, s in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state["calls"])
        self._states = {}
        for k, s in state["states"].items():
            st = LowBitState()
            st.load_state_dict(s)
            self._states[k] = st

    # -- helpers ------------------------------------------------------------------------------
    def _size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _start(self, rounds, comms, async_op: bool):
        work = LowBitWork(rounds, comms)
        if async_op:
            return work
        work.wait()
        return None

    def _exact_all_reduce(self, tensor, op, async_op):
        if _is_avg(op) and tensor.is_floating_point():
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
            w = _ExactWork(work, lambda: tensor.div_(self._size()))
        else:
            w = _ExactWork(dist.all_reduce(tensor, op=op, group=self.process_group, async_op=True))
        if async_op:
            return w
        w.wait()
        return None

    def _simulate(self, tensor, key_state, cfg):
        st, _ = key_state
        x = tensor.detach().to(torch.float32).reshape(-1)
        if cfg.error_feedback == "ef":
            x = x + st._buffer("residual", x.numel(), x.device)
        q = self.compress(x, seed=st.step)
        st.step += 1
        y = dequantize(q)
        if cfg.error_feedback == "ef":
            torch.nan_to_num_(torch.sub(x, y, out=st.residual), nan=0.0, posinf=0.0, neginf=0.0)
        tensor.copy_(y.view(tensor.shape))

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   local_group=None, inter_group=None, chunk_size: Optional[int] = None,
                   local_quantize: Optional[bool] = None, key=None):
        """Low-bit two-stage all-reduce of ``tensor`` in place (bitwise identical on every rank).

        ``local_group``/``inter_group`` make it hierarchical (``hierarchy`` from the settings,
        ``"leader"`` if that is ``"none"``); with one node it is one full-precision all-reduce.
        ``chunk_size``/``local_quantize`` override the settings for this call. Returns a
        :class:`LowBitWork` with ``async_op=True``, else ``None``.

        Example::

            work = lb.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True, key="t")
            work.wait()
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point() or not (_is_sum(op) or _is_avg(op)):
            return self._exact_all_reduce(tensor, op, async_op)
        cfg = self.config
        changes = {}
        if chunk_size is not None:
            changes["chunk_size"] = chunk_size
        hier_groups = local_group is not None or inter_group is not None
        if hier_groups or cfg.hierarchy != "none":
            changes["hierarchy"] = cfg.hierarchy if cfg.hierarchy != "none" else "leader"
        if local_quantize is not None:
            changes["local_quantize"] = local_quantize
        if changes:
            cfg = dataclasses.replace(cfg, **changes)
        key_state = self._state("all_reduce", key, tensor, cfg)
        if self.simulate_quantization:
            self._simulate(tensor, key_state, cfg)
            return self._exact_all_reduce(tensor, op, async_op)
        st, full_key = key_state
        if cfg.hierarchy == "none":
            comms = [Comm(self.process_group)]
            rounds = all_reduce_rounds(tensor, comms[0], cfg, st, average=_is_avg(op), key=full_key)
        else:
            intra = local_group or self.intra_group or runtime.intra_group()
            inter = inter_group or self.inter_group or runtime.inter_group()
            comms = [Comm(intra), Comm(inter)]
            rounds = all_reduce_rounds(tensor, None, cfg, st, average=_is_avg(op), key=full_key,
                                       intra=comms[0], inter=comms[1])
        return self._start(rounds, comms, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False, key=None):
        """``output`` = this rank's shard of the low-bit sum (or average) of ``input`` (P·k elements).

        Example::

            lb.reduce_scatter(out, torch.cat(shards), op=dist.ReduceOp.SUM)
        """
        if not (input.is_floating_point() and output.is_floating_point()) \
                or not (_is_sum(op) or _is_avg(op)):
            w = _reduce_scatter_flat(output, input, op=op, group=self.process_group,
                                     async_op=async_op)
            return w
        st, full_key = self._state("reduce_scatter", key, input, self.config)
        comm = Comm(self.process_group)
        rounds = reduce_scatter_rounds(output, input, comm, self.config, st, average=_is_avg(op),
                                       key=full_key)
        return self._start(rounds, [comm], async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, key=None):
        """``output`` (P·k elements) receives every rank's ``input`` (k), sent in low bit.

        Example::

            lb.all_gather(out, shard)
        """
        if not (input.is_floating_point() and output.is_floating_point()):
            return _all_gather_flat(output, input, group=self.process_group, async_op=async_op)
        st, full_key = self._state("all_gather", key, input, self.config)
        comm = Comm(self.process_group)
        rounds = all_gather_rounds(output, input, comm, self.config, st, key=full_key)
        return self._start(rounds, [comm], async_op)

    # -- format helpers -----------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, seed: int = 0) -> Quantized:
        """Quantize ``tensor`` with this group's format (what one rank would send).

        Example::

            c = lb.compress(t); t2 = lb.decompress(c)
        """
        cfg = self.config
        if cfg.bits == 32:
            raise ValueError("bitwidth=32 sends float32; there is nothing to compress")
        return quantize(tensor, cfg.bits, cfg.block_size, stochastic_rounding=cfg.stochastic_rounding,
                        seed=seed, hadamard=cfg.hadamard)

    def decompress(self, c: Quantized) -> torch.Tensor:
        """Inverse of :meth:`compress` (original shape and dtype).

        Example::

            t2 = lb.decompress(lb.compress(t))
        """
        return dequantize(c)
