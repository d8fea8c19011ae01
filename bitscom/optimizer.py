"""DistributedOptimizer: Horovod's one-line data parallelism, with compressed, fused buckets
(how a step runs: docs/api.md, reliability.md; why it subclasses the wrapped class: design.md)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import zlib
from typing import Any, Dict

import torch
from torch.nn.parallel import DistributedDataParallel

from . import runtime
from .agreement import check_agreement, describe_state
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .checkpointing.distributed import load_distributed, save_distributed
from .face import ByteLedger, dense_bytes, has_tensor, live_objects
from .lifecycle import StepFace, StepLifecycle
from .buckets import FlatBucket, plan_buckets, plan_groups
from .compressors import Compression, resolve as resolve_compressor
from .densified import DensifiedGradients, hand_back_sparse
from .engine import Reducer
from .horovod.sparse import SparseGradients
from .ops import Adasum, Average, ReduceOp, Sum
from .params import named_parameters_of
from .validate import choice, instance, number, real

__all__ = ["DistributedOptimizer"]


def _check_momentum_free(optimizer, compression) -> None:
    """MomentumCorrection needs an SGD without momentum (twice would train another model)."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(f"compression={compression.fingerprint()} applies SGD momentum before "
                        f"compressing and needs torch.optim.SGD with momentum=0; got "
                        f"{type(optimizer).__name__}")
    for i, group in enumerate(optimizer.param_groups):
        for key, bad in (("momentum", group.get("momentum", 0) != 0),
                         ("nesterov", bool(group.get("nesterov", False))),
                         ("maximize", bool(group.get("maximize", False))),
                         ("dampening", group.get("dampening", 0) != 0)):
            if bad:
                raise ValueError(
                    f"compression=MomentumCorrection(momentum={compression.momentum}) applies the "
                    f"momentum before compressing, so the SGD must have momentum=0, nesterov=False, "
                    f"maximize=False, dampening=0; param group {i} has {key}={group.get(key)!r}. "
                    f"Build torch.optim.SGD(..., momentum=0) (and weight_decay=λ/(1-m) to keep "
                    f"SGD(momentum=m, weight_decay=λ)'s regularization)")


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type) -> type:
    class _Distributed(DistributedOptimizer, base):
        __doc__ = DistributedOptimizer.__doc__
    _Distributed.__name__ = base.__name__
    _Distributed.__qualname__ = base.__qualname__
    return _Distributed


class DistributedOptimizer(StepFace, torch.optim.Optimizer):
    """Wrap ``optimizer`` so its gradients are reduced (and compressed) across ranks.

    The result subclasses ``type(optimizer)`` and takes over its ``param_groups``, ``state`` and
    hooks; use it from then on. When the backward pass that completes a step returns, every
    ``p.grad`` holds the reduced gradient. Every argument: docs/api.md; the trade-offs:

    Args:
        named_parameters: names in errors and in the cross-rank check (else ``param.<i>``).
        backward_passes_per_step: passes summed locally, then reduced once.
        gradient_predivide_factor: with ``Average``, ``1/f`` before the sum and ``f/size``
            after (Horovod's); >1 keeps low-precision sums from overflowing.
        fusion_threshold_mb: bucket cap: bigger means fewer, more efficient collectives,
            smaller starts communicating earlier (0: one tensor per bucket; ``"auto"``: chosen
            at construction from a link probe and :mod:`bitscom.cost`, on every rank).
        sparse_as_dense: sparse gradients through the (compressed) buckets, handed back as
            ``p.grad.to_sparse()`` (:mod:`bitscom.densified`); without it they are reduced
            sparse (:mod:`bitscom.horovod.sparse`), both as Horovod does.
        groups, num_groups: Horovod's explicit fusion instead of ``fusion_threshold_mb``.

    Example::

        opt = torch.optim.SGD(model.parameters(), lr=0.1 * bitscom.size(), momentum=0.9)
        opt = bitscom.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=bitscom.Compression.fp16)
        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
        bitscom.broadcast_optimizer_state(opt, root_rank=0)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()    # p.grad now holds the reduced gradient
            opt.step()
    """

    def __new__(cls, *args, **kwargs):   # the real arguments: see __signature__ below
        if cls is not DistributedOptimizer:          # an already concrete class (copy, pickle)
            return super().__new__(cls)
        optimizer = args[0] if args else kwargs.get("optimizer")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a bitscom.DistributedOptimizer; wrap it only once")
        instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        return super().__new__(_distributed_class(type(optimizer)))

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0, fusion_threshold_mb: float = 25,
                 process_group=None, *, sparse_as_dense: bool = False, groups=None,
                 num_groups: int = 0):
        compression = _checked_compression(optimizer, compression, named_parameters)
        backward_passes_per_step = number("backward_passes_per_step", backward_passes_per_step, minimum=1,
                                          integer=True)
        gradient_predivide_factor = _checked_op(op, gradient_predivide_factor)
        auto_fusion = isinstance(fusion_threshold_mb, str) and fusion_threshold_mb.lower() == "auto"
        if not auto_fusion:
            fusion_threshold_mb = real("fusion_threshold_mb", fusion_threshold_mb, minimum=0, finite=True)
        groups = _groups(groups, num_groups)

        # Take over the wrapped optimizer; a step wrapper an LR scheduler put on it stays there.
        self.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                              if k not in ("step", "zero_grad")})
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = bool(sparse_as_dense)

        self._wrapped_name = type(optimizer).__name__
        named = named_parameters_of(optimizer, named_parameters)
        self._face_init("DistributedOptimizer", process_group, named)
        self._trainable = [(n, p) for n, p in named if p.requires_grad]

        self._layouts, fusion_threshold_mb = self._plan(groups, fusion_threshold_mb, auto_fusion, compression)
        self.fusion_threshold_mb = None if groups is not None else float(fusion_threshold_mb)
        self._build_buckets()
        # sparse_as_dense=True: one layout round per step, after the last bucket (none without one)
        self._densified = DensifiedGradients([p for _, p in self._trainable], self._layouts[0].device) \
            if (self.sparse_as_dense and self._size > 1 and self._layouts) else None
        self._scan_live_objects()
        # Names this optimizer to the other ranks (bitscom.join): the same for the same plan.
        self._uid = zlib.crc32(repr(self._description()).encode()) & 0x3FFFFFFF
        self._bytes = ByteLedger()
        self._life = StepLifecycle(self, "DistributedOptimizer", self.process_group, backward_passes_per_step)
        self._life.agree()                      # every rank, before any other collective
        self._refuse_ddp(self._ddp)
        self._reducer = Reducer(compression, self._layouts, runtime.channel(self.process_group, later=self._size > 1))
        self._life.attach([p for _, p in self._trainable])

    def _build_buckets(self) -> None:
        by_name = dict(self._trainable)
        self._buckets = [FlatBucket(l, [by_name[s.name] for s in l.slots]) for l in self._layouts]
        self._slot: Dict[int, tuple] = {id(p): (b, s) for b, bucket in enumerate(self._buckets)
                                         for s, p in enumerate(bucket.params)}
        self._next_launch = 0
        self._should_sync = True

    def _scan_live_objects(self) -> None:
        """One scan for a DDP wrapper and sparse embeddings (multi-rank only)."""
        found = live_objects((DistributedDataParallel, torch.nn.Embedding, torch.nn.EmbeddingBag)) \
            if self._size > 1 else []
        self._ddp = self._ddp_wrapped([p for _, p in self._trainable], found)
        self._sparse_grads = None if (self.sparse_as_dense or self._size == 1) \
            else SparseGradients(self._trainable, found)

    @property
    def optimizer(self):
        """This optimizer itself (it *is* the wrapped class now), for code using ``opt.optimizer``."""
        return self.__dict__.get("optimizer", self)

    @optimizer.setter
    def optimizer(self, value):       # optimizers that wrap another one (Lookahead-style)
        self.__dict__["optimizer"] = value

    def add_param_group(self, param_group):
        raise RuntimeError("bitscom plans its buckets once; add every parameter group to the "
                           "optimizer before wrapping it in DistributedOptimizer")

    def __repr__(self):
        inner = torch.optim.Optimizer.__repr__(self)
        return f"DistributedOptimizer({inner}, compression={self.compression.fingerprint()})"

    def __getstate__(self):
        raise TypeError("a bitscom.DistributedOptimizer holds process groups and hooks and cannot "
                        "be pickled or copied; save opt.state_dict() instead")

    def _on_gradient(self, p: torch.Tensor, last_pass: bool) -> None:
        """On the completing pass, copy the gradient into its bucket and launch the ready buckets."""
        grad = p.grad
        if self._densified is not None:
            if last_pass:                # earlier passes accumulate sparse, as in Horovod
                grad = self._densified.dense(p)     # handed back sparse in _finish
        elif self._sparse_grads is not None and self._sparse_grads.on_gradient(self, p, last_pass):
            grad = None                  # reduced sparse in _finish; its slot carries zeros
        if last_pass:
            b, s = self._slot[id(p)]
            self._buckets[b].fill(s, grad)
            self._launch_ready()
        self._reducer.poll()

    def _name_of(self, p) -> str:
        b, s = self._slot[id(p)]
        return self._buckets[b].layout.slots[s].name

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _state_description(self) -> dict:
        """After a load: what the ranks' restored state must agree on (never residual values)."""
        steps = sorted({int(s["step"]) for s in self.state.values() if "step" in s})
        return {"compressor state": [describe_state(s) for s in self._reducer.states],
                "wrapped optimizer steps": steps}

    def _launch(self, b: int) -> None:
        self._life.begin(True, self._state_description)
        flat = self._buckets[b].flat
        if self.gradient_predivide_factor != 1.0:     # op=Average (a Sum's factor is 1)
            flat.div_(self.gradient_predivide_factor)
        self._reducer.launch(b, flat)

    def _plan(self, groups, fusion_threshold_mb, auto_fusion: bool, compression):
        if self._size > 1:
            # "auto" probes the link here: the ranks agree that they all probe, or a rank that
            # passed a number would meet the probe's collectives with its first step's (a hang).
            check_agreement({"optimizer": "DistributedOptimizer",
                             "fusion_threshold_mb": "auto" if auto_fusion else fusion_threshold_mb,
                             "groups": groups if groups is None or isinstance(groups, int) else "explicit lists"},
                            self.process_group, "optimizer plan")
        if groups is not None:
            return plan_groups(self._trainable, groups), fusion_threshold_mb
        if auto_fusion:
            from .cost import auto_fusion_threshold_mb
            fusion_threshold_mb = auto_fusion_threshold_mb(self._trainable, self.process_group, compression)
        return plan_buckets(self._trainable, int(fusion_threshold_mb * 2 ** 20)), fusion_threshold_mb

    def _description(self) -> dict:
        return {
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._trainable],
            "buckets": [l.describe() for l in self._layouts],
            "compressor": self.compression.fingerprint(),
            "backward_passes_per_step": self.backward_passes_per_step,
            "op": self.op.value,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "wrapped in DistributedDataParallel": self._ddp is not None,
            "sparse-gradient parameters": [] if self._sparse_grads is None else
            [n for n, _ in self._sparse_grads.params],
            "sparse_as_dense": self.sparse_as_dense,      # True adds a round to every step
            # Not param_groups: Horovod's pattern builds with per-rank hyper-parameters and
            # then calls broadcast_optimizer_state.
            "wrapped optimizer": self._wrapped_name,
        }

    def _finish(self) -> None:
        self._life.check_open()
        self._life.check_requires_grad()
        try:
            sent, sparse_back = self._reduce_all()
            self._life.end()
        except BaseException:
            self._reducer.abort()
            raise
        finally:
            self._reset_buckets()
        # the compressors average: Average multiplies the predivided f back, Sum multiplies by size
        post = self.gradient_predivide_factor if self.op is Average else float(self._size)
        for bucket in self._buckets:
            if post != 1.0:
                bucket.flat.mul_(post)
            bucket.write_back()
        hand_back_sparse(sparse_back)            # sparse_as_dense=True: agreed on every rank
        self._bytes.add(sent, sum(dense_bytes(b.layout.numel) for b in self._buckets))
        self._life.completed = True
        if self._sparse_grads is not None and self._sparse_grads.params:
            self._sparse_grads.finish(self)      # every rank, plan order: sparse p.grad
        self._bytes.end_step()

    def _reduce_all(self):
        """Launch every bucket (and the layout round) and wait: (bytes sent, sparse parameters)."""
        densified = self._densified
        if densified is not None:
            densified.dense_missing(self._buckets[self._next_launch:])
        for bucket in self._buckets[self._next_launch:]:
            bucket.fill_missing()
        self._launch_ready()
        if densified is None:
            return self._reducer.wait_all(), []
        densified.launch(self._reducer.channel)  # queued behind the last bucket, on every rank
        sent = self._reducer.wait_all()
        sparse_back, layout_sent = densified.wait(self._reducer.channel)
        return sent + layout_sent, sparse_back

    def _reset_buckets(self) -> None:
        self._next_launch = 0
        self._life.reset_collectives()
        for bucket in self._buckets:
            bucket.reset()
        densified = getattr(self, "_densified", None)
        if densified is not None:                # this step's marks and layout round go too
            densified.forget(self._reducer.channel)

    def _after_join(self, root_rank: int, group) -> None:
        """bitscom.join(): take the last joiner's parameters and state (joined ranks did not step)."""
        broadcast_parameters([p for g in self.param_groups for p in g["params"]],
                             root_rank=root_rank, process_group=group)
        broadcast_optimizer_state(self, root_rank=root_rank, process_group=group)

    def shadow_step(self) -> None:
        """Take part in one step of the other ranks with zero gradients (:func:`bitscom.join`)."""
        self._life.begin(False, self._state_description)
        try:
            for b, bucket in enumerate(self._buckets):
                bucket.flat.zero_()
                self._reducer.launch(b, bucket.flat)
            if self._densified is not None:      # the active ranks' layout round; no marks here
                self._densified.launch(self._reducer.channel)
            self._reducer.wait_all()
            if self._densified is not None:
                self._densified.wait(self._reducer.channel)
        finally:
            self._reset_buckets()

    def synchronize(self) -> None:
        """Finish this step's reduction now (Horovod's API; a no-op when backward already did it). Example::

            loss.backward()
            opt.synchronize()                      # no-op: already reduced
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        if self._size > 1 and not self._life.completed:
            self._finish()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` use ``p.grad`` as it is, even if this step was not reduced (Horovod's API). Example::

            with opt.skip_synchronize():
                opt.step()
        """
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    # Marked so torch's Optimizer._patch_step_function (run by load_state_dict) does not wrap
    # it: the wrapped optimizer's own step already runs the step hooks once.
    def step(self, closure=None, **kwargs):
        """The wrapped optimizer's step on the reduced ``p.grad`` (a ``closure``'s backwards reduced). Example::

            loss.backward()
            opt.step()
        """
        self._life.check_open()
        if closure is not None and self._size == 1 and self.compression.applies_momentum:
            raise NotImplementedError("step(closure) with a MomentumCorrection compressor on one "
                                      "process is not supported; call backward() then step()")
        if closure is not None:
            def reduced_closure():
                self._reset_step()
                return closure()
            try:
                return super().step(reduced_closure, **kwargs)
            finally:
                self._reset_step()
        if self.compression.applies_momentum:
            _check_momentum_free(self, self.compression)     # a scheduler may have changed it
            if self._size == 1:
                self._solo_momentum()
        if self._size > 1:
            if self._should_sync and not self._life.completed:
                self.synchronize()
            else:
                self._life.check_requires_grad()
        try:
            result = super().step(**kwargs)
        finally:
            self._reset_step()
        self._life.stepped()
        return result
    step.hooked = True  # type: ignore[attr-defined]

    def _solo_momentum(self) -> None:
        """One process owes MomentumCorrection's ``p.grad ← u = m·u + g`` (u in the optimizer state)."""
        m = self.compression.momentum
        for p in [p for group in self.param_groups for p in group["params"] if p.grad is not None]:
            u = self.state[p].get("bitscom_velocity")
            if u is None:
                u = self.state[p]["bitscom_velocity"] = torch.zeros_like(p.grad, dtype=torch.float32)
            u.mul_(m).add_(p.grad)
            p.grad.copy_(u)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero ``p.grad`` and forget this step's passes (also after a skipped step)."""
        self._reset_step()
        super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change local accumulation between steps (Horovod's API); every rank must call it."""
        if self._life.in_step or self._next_launch or self._life.completed:
            raise RuntimeError("set_backward_passes_per_step() was called in the middle of a step; "
                               "call it after step() or zero_grad()")
        self.backward_passes_per_step = self._life.passes = number(
            "backward_passes_per_step", passes, minimum=1, integer=True)
        self._life.agreed = False      # the ranks check the new setting together on the next step

    def close(self) -> None:
        """Remove the gradient hooks (also done by garbage collection); ``step()`` then raises."""
        self._reducer.abort()
        self._life.close()
        self._face_close()

    def comm_stats(self) -> dict:
        """Bytes this rank sent, ``buckets``, and with ``compression="auto"`` the ``auto_plan``. Example::

            print(opt.comm_stats()["compression_ratio"])
        """
        extra: Dict[str, Any] = {"buckets": len(self._buckets)}
        from .cost.auto import Auto
        if isinstance(self.compression, Auto):
            extra["auto_plan"] = Auto.plan(self._reducer.states)
        return self._bytes.report(**extra)

    def state_dict(self) -> dict:
        """torch's state dict plus this rank's compressor state under ``["bitscom"]["rank<r>"]``. Example::

            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        """
        out = super().state_dict()
        out["bitscom"] = self._envelope(self._life.steps, own={"reducer": self._reducer.state_dict()})
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s output (older forms and plain ones too), all or nothing. Example::

            opt.load_state_dict(torch.load(path)["opt"])
        """
        inner, extra = _split_state_dict(state_dict)
        extra = self._own_entry(extra) if extra is not None else None
        if self._life.in_step or self._next_launch:
            raise RuntimeError("load_state_dict() was called in the middle of a step; call it "
                               "between steps")
        if extra is not None and not self._check_envelope(extra, has_tensor(extra["reducer"]["states"])):
            self._life.loaded(None)             # the next step raises the problem on every rank
            return
        backup = self._reducer.state_dict() if extra is not None else None
        try:
            if extra is not None:
                self._reducer.load_state_dict(extra["reducer"])
            super().load_state_dict(inner)
        except BaseException:
            if backup is not None:
                self._reducer.load_state_dict(backup)
            raise
        self._life.loaded(extra.get("steps") if extra is not None else None)

    bucket_layouts = property(lambda self: list(self._layouts), doc="The planned buckets (a copy).")
    compressor_states = property(lambda self: list(self._reducer.states), doc="Each bucket's compressor state.")

    def save_dcp(self, path, *, extra=None) -> None:
        """Save through ``torch.distributed.checkpoint``; see :func:`bitscom.checkpointing.save`. Example::

            opt.save_dcp("ckpt/step100", extra={"model": model.state_dict()})
        """
        save_distributed(self, path, extra)

    def load_dcp(self, path, *, extra=None, reset_compressor_state: bool = False) -> None:
        """Load a :meth:`save_dcp` checkpoint; see :func:`bitscom.checkpointing.load`. Example::

            opt.load_dcp("ckpt/step100", extra={"model": model.state_dict()})
        """
        load_distributed(self, path, extra, reset_compressor_state)


# help() and inspect show __init__'s arguments, not __new__'s (*args, **kwargs).
_INIT = inspect.signature(DistributedOptimizer.__init__)
DistributedOptimizer.__signature__ = _INIT.replace(  # type: ignore[attr-defined]
    parameters=list(_INIT.parameters.values())[1:])


def _checked_compression(optimizer, compression, named_parameters):
    if isinstance(compression, str) and compression.lower() == "auto":
        from .cost.auto import Auto, candidates_for
        compression = Auto(candidates=candidates_for(optimizer))   # safe for this optimizer
    compression = resolve_compressor(compression, "compression")
    if compression.uses_names and named_parameters is None:
        raise ValueError(f"compression={compression!r} matches parameter names; pass "
                         "named_parameters=model.named_parameters() (without it the "
                         "parameters are numbered param.0, param.1, …)")
    if compression.applies_momentum:
        _check_momentum_free(optimizer, compression)
    return compression


def _checked_op(op, gradient_predivide_factor) -> float:
    if op is Adasum:
        raise NotImplementedError("op=Adasum is not supported by bitscom (Horovod's Adasum has no "
                                  "compressed counterpart here); use bitscom.Average or bitscom.Sum")
    choice("op", op, (Average, Sum))
    gradient_predivide_factor = real("gradient_predivide_factor", gradient_predivide_factor, minimum=0,
                                     inclusive=False, finite=True)
    if op is Sum and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor applies to op=Average only; "
                         f"got {gradient_predivide_factor} with op=Sum")
    return gradient_predivide_factor


def _split_state_dict(state_dict):
    """(the wrapped optimizer's state dict, bitscom's part or None) of any accepted form."""
    instance("state_dict", state_dict, dict, "a dict (an optimizer's state_dict())")
    if "optimizer" in state_dict and "bitscom" in state_dict and "state" not in state_dict:
        return state_dict["optimizer"], state_dict["bitscom"]
    if "state" in state_dict and "param_groups" in state_dict:
        return {k: v for k, v in state_dict.items() if k != "bitscom"}, state_dict.get("bitscom")
    raise ValueError("not an optimizer state dict: expected the keys 'state' and "
                     f"'param_groups', got {sorted(map(str, state_dict))}")


def _groups(groups, num_groups):
    if num_groups:
        if groups is not None:
            raise ValueError("pass groups= or num_groups=, not both")
        groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool):
        raise TypeError(f"groups must be an int or a list of lists of parameters, got {groups!r}")
    if isinstance(groups, int):
        return number("groups", groups, minimum=0, integer=True) or None
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups):
        raise TypeError("groups must be an int or a list of lists of parameters, got "
                        f"{type(groups).__name__}")
    return [list(g) for g in groups]
