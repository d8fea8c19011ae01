"""Streaming DiLoCo's overlap (``delay > 0``): a :class:`~bitscom.engine.Reducer` per fragment on
the face's one channel, each waited for on its own, checkpointed as one Reducer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import torch

from ..engine import Reducer

__all__ = ["Flight", "FragmentReducers", "saved_flights"]


@dataclass
class Flight:
    """One fragment's reduction, launched after inner step ``start``; ``arrived``: its result is in."""

    fragment: int
    start: int
    arrived: bool = False
    bytes_sent: int = 0


class FragmentReducers:
    """A :class:`~bitscom.engine.Reducer` per fragment on one channel, checkpointed as one."""

    def __init__(self, compressor, layouts: Sequence[Any], members: Sequence[Sequence[int]], channel):
        self.compressor = compressor
        self.members = [list(m) for m in members]
        self.reducers = [Reducer(compressor, [layouts[b] for b in m], channel) for m in self.members]

    @property
    def states(self) -> List[Any]:
        """Every bucket's compressor state, in global bucket order."""
        return [s for r in self.reducers for s in r.states]

    def launch(self, fragment: int, flats: Sequence[torch.Tensor]) -> None:
        """Start the reduction of ``fragment``'s buckets (in place on ``flats``); returns at once."""
        for i, flat in enumerate(flats):
            self.reducers[fragment].launch(i, flat)

    def wait(self, fragment: int) -> int:
        """Finish ``fragment``'s reduction (and what was submitted before it); the bytes it sent."""
        return self.reducers[fragment].wait_all()      # which aborts the fragment's buckets on failure

    def poll(self) -> None:
        """Advance every reduction whose current round completed (issue its next round)."""
        self.reducers[0].poll()

    def release(self) -> None:
        for r in self.reducers:
            r.release()

    def state_dict(self) -> dict:
        return {"states": [s.state_dict() for s in self.states], "compressor": self.compressor.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        saved = state["states"]
        total = sum(len(m) for m in self.members)
        if len(saved) != total:
            raise ValueError(f"checkpoint holds compressor state for {len(saved)} buckets, "
                             f"this plan has {total}")
        for r, m in zip(self.reducers, self.members):
            r.load_state_dict(dict(state, states=[saved[b] for b in m]))


def saved_flights(extra: dict, members: Sequence[Sequence[int]], flats: Sequence[torch.Tensor]) -> Dict[int, tuple]:
    """The checkpoint's reductions in flight, checked against this plan: fragment -> (Flight, buckets)."""
    out: Dict[int, tuple] = {}
    for item in extra.get("flights", []):
        f = item["fragment"]
        if not 0 <= f < len(members) or f in out:
            raise ValueError(f"checkpoint holds a reduction in flight for fragment {f}; this plan "
                             f"has fragments 0..{len(members) - 1}")
        reduced = list(item["reduced"])
        want = [flats[b] for b in members[f]]
        if len(reduced) != len(want) or any(r.shape != w.shape or r.dtype != w.dtype
                                            for r, w in zip(reduced, want)):
            raise ValueError(f"checkpoint's reduction in flight for fragment {f} has buckets "
                             f"{[tuple(r.shape) for r in reduced]}, this plan has "
                             f"{[tuple(w.shape) for w in want]}; was the model changed?")
        out[f] = (Flight(f, int(item["start"]), True, int(item["bytes_sent"])), reduced)
    return out
