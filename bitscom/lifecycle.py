"""What every hook-driven optimizer face shares: the life of one step.

The optimizer faces differ in what they do with a gradient, not in when (hooks, passes, the
end of backward, agreement, close); written twice, these drifted. The face implements
``_on_gradient(p, last_pass)``, ``_finish()`` and ``_description()``. Example::

    class MyFace(StepFace, torch.optim.Optimizer):
        def __init__(self, optimizer, named, process_group=None):
            self._face_init("MyFace", process_group, named)
            self._life = StepLifecycle(self, "MyFace", self.process_group, passes=1)
            self._life.agree()                      # every rank, at construction
            self._life.attach([p for _, p in named])
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import uneven
from .agreement import check_agreement
from .face import Face, raise_problem

__all__ = ["StepLifecycle", "StepFace"]

log = logging.getLogger("bitscom")     # at DEBUG: each optimizer's plan and compressor (docs/api.md)


def _weakly(ref, method: str, *args) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)(*args)


def _release(handles) -> None:
    for handle in handles:
        handle.remove()


class StepLifecycle:
    """The life of one face's steps (see the module docstring)."""

    def __init__(self, face, name: str, group, passes: int):
        self._face = weakref.ref(face)
        self.name = name
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.passes = passes
        self.passes_done = 0          # backward passes of this step
        self.callback_queued = False
        self.completed = False        # the step's reduced gradients are in place
        self.began = False            # the step's first collective (the join notice) was issued
        self.notice = None
        self.closed = False
        self.steps = 0                # optimizer steps taken (checkpointed, agreed after a load)
        self.agreed = False
        self.check_state = False     # after a load: agree on step counters / compressor state
        self._handles: List[Any] = []
        self._finalizer = weakref.finalize(face, _release, self._handles)
        self._finalizer.atexit = False

    def attach(self, params: Sequence[torch.Tensor], solo: bool = False, joinable: bool = True) -> None:
        """Register the hooks (held weakly); ``solo``: even in a single process."""
        if self.size == 1 and not solo:
            return
        this = weakref.ref(self)
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda param, this=this: _weakly(this, "on_hook", param)))
        if self.size > 1 and joinable:
            uneven.register(self._face())

    def description(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """What the ranks compare; after a load also the step counter."""
        face = self._face()
        assert face is not None, "the face owns its lifecycle"
        desc: Dict[str, Any] = {"optimizer": self.name, "world size": self.size}
        desc.update(face._description())
        if self.check_state:
            desc.update(extra or {})
            desc["optimizer steps taken"] = self.steps
            desc.update(face._deferred_problem())
        return desc

    def agree(self, extra: Optional[Dict[str, Any]] = None) -> None:
        """Every rank checks that every rank built the same face and plan (and step, after a load)."""
        description = self.description(extra)
        if log.isEnabledFor(logging.DEBUG):
            rank = dist.get_rank(self.group) if self.group is not None else 0
            log.debug("%s on rank %d of %d: %s", self.name, rank, self.size,
                      "; ".join(f"{k}={v}" for k, v in description.items() if k != "param_groups"))
        if self.size > 1:
            check_agreement(description, self.group, what="optimizer plan")
        self.agreed, self.check_state = True, False
        raise_problem(description)

    def loaded(self, steps: Optional[int]) -> None:
        """A checkpoint was loaded: the next step first re-checks the agreement."""
        if steps is not None:
            self.steps = int(steps)
        self.agreed, self.check_state = False, True

    def on_hook(self, p: torch.Tensor) -> None:
        if self.closed:
            return
        face = self._face()
        if face is None:
            return
        if self.completed:
            raise RuntimeError(
                f"gradients were computed again after the step's reduction (backward_passes_per_step="
                f"{self.passes}): call step() or zero_grad() before the next backward, or raise "
                "backward_passes_per_step to accumulate more passes locally")
        if not self.callback_queued:
            face._check_live()           # the step's first gradient: once per backward pass
            self.callback_queued = True
            this = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _weakly(this, "on_backward_end"))
        face._on_gradient(p, self.passes_done + 1 == self.passes)

    def on_backward_end(self) -> None:
        self.callback_queued = False
        self.passes_done += 1
        face = self._face()
        if face is not None and self.passes_done >= self.passes and not self.completed \
                and not self.closed:
            face._finish()

    def begin(self, notify: bool, state_description: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        """The collectives every step starts with: the join notice, then any pending agreement."""
        if self.began:
            return
        self.began = True
        if notify and self.size > 1:
            self.notice = uneven.notify(self._face())
        if not self.agreed:
            self.agree(state_description() if (state_description and self.check_state) else None)

    def end(self) -> None:
        """Wait for this step's join notice."""
        if self.notice is not None:
            self.notice.wait()
            self.notice = None

    def check_requires_grad(self) -> None:
        """Buckets are planned once: a parameter frozen or unfrozen since is an error."""
        _weakly(self._face, "_check_requires_grad")

    def check_open(self) -> None:
        """A clear error if the face was closed or its world is gone."""
        _weakly(self._face, "_check_live")

    def release(self) -> None:
        """The world is gone: forget its groups and the join registration."""
        self.group = None
        self.notice = None
        face = self._face()
        if face is not None:
            uneven.unregister(face)

    in_step = property(lambda self: bool(self.passes_done or self.began), doc="Whether a step has started.")

    def reset_collectives(self) -> None:
        """Forget this step's first collectives (the buckets were reset)."""
        self.began = False
        self.notice = None

    def reset_step(self) -> None:
        self.reset_collectives()
        self.passes_done = 0
        self.completed = False
        self.callback_queued = False   # also after a backward that raised before its end

    def stepped(self) -> None:
        self.steps += 1

    def close(self) -> None:
        """Remove the hooks, forget the face in :func:`bitscom.join`, destroy owned groups."""
        self.closed = True
        face = self._face()
        if face is not None:
            uneven.unregister(face)
        self._finalizer()


class StepFace(Face):
    """What the hook-driven optimizer faces do alike around ``_life`` and ``_reducer``."""

    _life: StepLifecycle
    _reducer: Any
    _next_launch: int

    def _release_groups(self) -> None:
        life = getattr(self, "_life", None)      # None: construction failed before it
        if life is not None:
            life.release()
        reducer = getattr(self, "_reducer", None)
        if reducer is not None:
            reducer.abort()
            if hasattr(reducer, "release"):
                reducer.release()

    def _reset_buckets(self) -> None:
        raise NotImplementedError

    def _reset_step(self) -> None:
        if self._reducer.in_flight:
            self._reducer.abort()
        self._reset_buckets()
        self._life.reset_step()

    def _mid_step(self) -> bool:
        return bool(self._life.in_step or self._next_launch or self._reducer.in_flight)
