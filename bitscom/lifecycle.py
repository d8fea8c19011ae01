"""What every optimizer face shares: its group, its setup checks and the life of one step.

Why one module. ``DistributedOptimizer`` and ``ShardedOptimizer`` differ in what they do with
a gradient (copy it into a bucket and hand back the average; move it into a bucket and keep
only this rank's shard) but not in when: a post-accumulate-grad hook per parameter, passes
counted to ``backward_passes_per_step``, the reduction completed when the backward pass that
completes a step ends (the autograd engine's end-of-backward callback, as DDP does), a plan
that every rank must agree on, ``requires_grad`` frozen at construction, a step counter that
must agree after a resume, hooks and groups released by ``close()``. Each of these used to be
written twice and drifted (a sharded optimizer that trained each rank alone before ``init()``,
ignored ``requires_grad`` flips, resumed from stale files silently and leaked its groups); here
it exists once, and a face only says what a gradient and the end of a step mean to it.

The face implements three methods, called by :class:`StepLifecycle`:

* ``_on_gradient(p, last_pass)``: ``p.grad`` was accumulated on this backward pass;
  ``last_pass`` is True on the pass that completes the step;
* ``_finish()``: complete the step's reduction (the end of the completing pass, or an early
  ``synchronize()``);
* ``_description()``: what every rank must agree on (a dict; compared across ranks).

Example::

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

log = logging.getLogger("bitscom")
"""bitscom's diagnostics: the plan and compressor of every optimizer at DEBUG (enable with
``logging.getLogger("bitscom").setLevel(logging.DEBUG)`` and a handler)."""


def _hook(ref, param) -> None:
    life = ref()
    if life is not None:
        life.on_hook(param)


def _end_of_backward(ref) -> None:
    life = ref()
    if life is not None:
        life.on_backward_end()


def _release(handles) -> None:
    """Remove the hooks (close() or garbage collection); groups belong to runtime's channels."""
    for handle in handles:
        handle.remove()


class StepLifecycle:
    """The life of one face's steps: hooks, pass counting, end-of-backward completion, the
    cross-rank agreement, ``requires_grad`` and step-counter checks, ``close()``.

    State it keeps (read by the face, reset by :meth:`reset_step`): ``passes_done`` (backward
    passes of this step), ``completed`` (the step's reduced gradients are in place),
    ``began`` (the step's first collective — the join notice — was issued), ``steps`` (optimizer
    steps taken; checkpointed and agreed on after a load).

    Example::

        life = StepLifecycle(face, "DistributedOptimizer", group, passes=2)
        life.agree()
        life.attach(params)
        ...
        life.close()
    """

    def __init__(self, face, name: str, group, passes: int):
        self._face = weakref.ref(face)
        self.name = name
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.passes = passes
        self.passes_done = 0
        self.callback_queued = False
        self.completed = False
        self.began = False
        self.notice = None
        self.closed = False
        self.steps = 0
        self.agreed = False
        self.check_state = False     # after a load: agree on step counters / compressor state
        self._handles: List[Any] = []
        self._finalizer = weakref.finalize(face, _release, self._handles)
        self._finalizer.atexit = False

    # -- setup ---------------------------------------------------------------------------------
    def attach(self, params: Sequence[torch.Tensor], solo: bool = False, joinable: bool = True) -> None:
        """Register the post-accumulate-grad hooks (held weakly: a face that is closed or
        collected stops reducing) and make the face shadowable by :func:`bitscom.join`
        (unless ``joinable=False``: a face that cannot take part in a step without data).
        ``solo``: hook even in a single process (a face whose gradients live elsewhere)."""
        if self.size == 1 and not solo:
            return
        this = weakref.ref(self)
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda param, this=this: _hook(this, param)))
        if self.size > 1 and joinable:
            uneven.register(self._face())

    def description(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """What the ranks compare: the face's kind first, its own description, and after a
        load the step counter (a stale checkpoint on one rank is an error, not drift)."""
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
        """Every rank checks that every other rank built the same face with the same plan and
        (after a load) resumed from the same step; the same RuntimeError everywhere if not."""
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

    # -- one step --------------------------------------------------------------------------------
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
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_of_backward(this))
        face._on_gradient(p, self.passes_done + 1 == self.passes)

    def on_backward_end(self) -> None:
        self.callback_queued = False
        self.passes_done += 1
        face = self._face()
        if face is not None and self.passes_done >= self.passes and not self.completed \
                and not self.closed:
            face._finish()

    def begin(self, notify: bool, state_description: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        """The collectives every step starts with, in the same order on every rank: the join
        notice (see :func:`bitscom.join`), then the agreement when a load or a setting change
        asked for it."""
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
        face = self._face()
        if face is not None:
            face._check_requires_grad()

    def check_open(self) -> None:
        """A clear error if the face was closed or its world is gone (see :class:`bitscom.face.Face`)."""
        face = self._face()
        if face is not None:
            face._check_live()

    def release(self) -> None:
        """The world is gone: forget its groups (they were destroyed with it) and the join
        registration; nothing here may keep the old world's store alive."""
        self.group = None
        self.notice = None
        face = self._face()
        if face is not None:
            uneven.unregister(face)

    @property
    def in_step(self) -> bool:
        """Whether a step has started (a backward pass ran or a collective was issued)."""
        return bool(self.passes_done or self.began)

    def reset_collectives(self) -> None:
        """Forget this step's first collectives (the buckets were reset)."""
        self.began = False
        self.notice = None

    def reset_step(self) -> None:
        self.passes_done = 0
        self.completed = False
        self.began = False
        self.notice = None
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
    """What the hook-driven optimizer faces do alike around their :class:`StepLifecycle`
    (``self._life``), their reducer (``self._reducer``: ``in_flight``, ``abort()``) and their
    bucket cursor (``self._next_launch``, ``self._reset_buckets()``); the rest of a face's
    duties come from :class:`~bitscom.face.Face`.

    Example::

        class MyFace(StepFace, torch.optim.Optimizer): ...
    """

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
        """Forget this step: in-flight work (after a failure), bucket fills, passes."""
        if self._reducer.in_flight:
            self._reducer.abort()
        self._reset_buckets()
        self._life.reset_step()

    def _mid_step(self) -> bool:
        """Whether a step is under way (bitscom.join() refuses to start in one)."""
        return bool(self._life.in_step or self._next_launch or self._reducer.in_flight)
