"""The reduction engine: each bucket's compressor rounds, submitted in bucket order to the
face's :class:`~bitscom.channel.Channel`, without blocking backward."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import runtime
from .channel import Channel
from .comm import Rounds
from .compressors.base import BucketLayout, Compressor, State
from .lowbit.config import canonical_fingerprint

__all__ = ["Reducer"]


class Reducer:
    """Runs one compressor over bucket layouts: ``launch(i, flat)`` in order, ``wait_all()``."""

    def __init__(self, compressor: Compressor, layouts: Sequence[BucketLayout], channel=None):
        self.compressor = compressor
        self.layouts: List[Any] = list(layouts)       # None where DDP has not defined one yet
        self.channel = channel if isinstance(channel, Channel) else runtime.channel(channel)
        self.states: List[Any] = [compressor.init_state(l) for l in self.layouts]
        self._flights: List[Tuple[int, Rounds]] = []

    later_group = property(lambda self: self.channel.later_group, doc="The channel's later-round group.")

    def set_bucket(self, index: int, layout: BucketLayout, state: Optional[State] = None) -> State:
        """Define (or redefine) bucket ``index`` for adapters that learn buckets lazily (DDP)."""
        while len(self.layouts) <= index:
            self.layouts.append(None)
            self.states.append(None)
        self.layouts[index] = layout
        self.states[index] = self.compressor.init_state(layout) if state is None else state
        return self.states[index]

    def abort(self) -> None:
        """Forget every launched bucket (after a failure); their work is not waited for."""
        self.channel.abort([r for _, r in self._flights])
        self._flights = []

    def release(self) -> None:
        """The world is gone: drop the work in flight."""
        self._flights = []

    in_flight = property(lambda self: any(not r.done for _, r in self._flights))

    def launch(self, index: int, flat: torch.Tensor) -> None:
        """Start bucket ``index``'s reduction: runs it up to (and issuing) its first round."""
        if self._flights and self._flights[-1][0] >= index:
            raise RuntimeError(f"bucket {index} launched out of order after bucket "
                               f"{self._flights[-1][0]}")
        comm = self.channel.comm()
        rounds = Rounds(self.compressor.reduce(flat, self.layouts[index], self.states[index], comm),
                        [comm])
        self._flights.append((index, rounds))
        self.channel.submit(rounds)

    def poll(self, block: bool = False) -> None:
        """Advance buckets whose current work completed (all of them with ``block=True``)."""
        if block and self._flights:
            self.channel.wait(self._flights[-1][1])
        else:
            self.channel.poll()

    def wait_all(self) -> int:
        """Finish every launched bucket; return the bytes sent (a failed bucket's error raised)."""
        failed: Optional[BaseException] = None
        try:
            self.poll(block=True)
        except BaseException as err:  # noqa: BLE001 — re-raised below, the first bucket's first
            failed = err
        errors = [r.error for _, r in self._flights if r.error is not None]
        if failed is not None:
            errors.append(failed)
        if errors:
            self.abort()
            raise errors[0]
        sent = sum(r.bytes_sent for _, r in self._flights)
        self._flights = []
        return sent

    def state_dict(self) -> dict:
        return {"states": [s.state_dict() for s in self.states],
                "compressor": self.compressor.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        saved = state["states"]
        if len(saved) != len(self.states):
            raise ValueError(f"checkpoint holds compressor state for {len(saved)} buckets, "
                             f"this plan has {len(self.states)}")
        fingerprint = state.get("compressor")
        if fingerprint is not None and canonical_fingerprint(fingerprint) != self.compressor.fingerprint():
            raise ValueError(f"checkpoint compressor {state['compressor']} differs from "
                             f"{self.compressor.fingerprint()}")
        for s, d in zip(self.states, saved):
            s.load_state_dict(d)
