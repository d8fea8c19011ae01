"""DistributedOptimizer: Horovod's one-line data parallelism, with compressed, fused buckets.

Data path of one step:

1. ``loss.backward()`` accumulates into ``p.grad``; a post-accumulate-grad hook counts the
   pass (up to ``backward_passes_per_step``) and, on the last one, copies the gradient into
   its bucket's flat buffer.
2. When every gradient of the next bucket (in plan order) is in, its first communication
   round starts asynchronously while backward goes on; later rounds chain as earlier work
   completes (see :mod:`bitscom.engine`).
3. ``synchronize()`` (called by ``step()``) fills in parameters that got no gradient this
   step (they count as zeros), launches what is left, waits for every bucket and writes the
   reduced gradients back into ``p.grad``.
4. ``step()`` runs the wrapped optimizer.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List

import torch
import torch.distributed as dist

from . import runtime
from .agreement import check_agreement
from .buckets import FlatBucket, plan_buckets
from .compressors import Compression, Compressor, get as get_compressor
from .engine import Reducer
from .ops import Average, ReduceOp, Sum

__all__ = ["DistributedOptimizer"]


def _named_params(optimizer: torch.optim.Optimizer, named_parameters) -> List[tuple]:
    """Validated (name, parameter) pairs in registration order."""
    opt_params, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                opt_params.append(p)
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(opt_params)]
    named = list(named_parameters)
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("named_parameters must be (name, tensor) pairs, e.g. "
                            f"model.named_parameters(); got an item {type(item).__name__}")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters contains duplicate names {dups}; names must be unique")
    by_id = {id(p): n for n, p in named}
    missing_from_opt = [n for n, p in named if id(p) not in seen and p.requires_grad]
    if missing_from_opt:
        raise ValueError(f"parameters {missing_from_opt[:5]} are in named_parameters but not in the "
                         "optimizer's param_groups; pass the optimizer every trainable parameter")
    unnamed = [i for i, p in enumerate(opt_params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameter(s) (e.g. index {unnamed[0]}) are missing "
                         "from named_parameters; pass model.named_parameters() of the same model")
    return [(n, p) for n, p in named if id(p) in seen]


def _forward_hook(ref, param) -> None:
    opt = ref()
    if opt is not None:
        opt._hook(param)


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so ``step()`` uses gradients reduced (and compressed) across ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; bitscom delegates ``param_groups``,
            ``state`` and ``step`` to it, so LR schedulers and clipping work unchanged.
        named_parameters: ``model.named_parameters()``; names make error messages and the
            cross-rank agreement check readable. Without it, parameters are numbered.
        compression: a compressor instance (``bitscom.Compression.fp16``,
            ``bitscom.compressors.get("acpsgd", rank=4)``) or a registry name.
        backward_passes_per_step: local accumulation: gradients of this many backward
            passes are summed locally and reduced once (Horovod semantics).
        op: ``bitscom.Average`` (default) or ``bitscom.Sum``.
        gradient_predivide_factor: with ``Average``, gradients are scaled by
            ``1/f`` before the reduction and by ``f/size`` after it (Horovod's definition);
            >1 keeps low-precision sums away from overflow.
        fusion_threshold_mb: bucket size cap; larger buckets mean fewer, more efficient
            collectives, smaller ones start communicating earlier. 0 = one tensor per bucket.
        process_group: the group to reduce over (default: the world group).

    Example::

        bitscom.init()
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * bitscom.size(), momentum=0.9)
        opt = bitscom.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=bitscom.Compression.fp16)
        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
        bitscom.broadcast_optimizer_state(opt, root_rank=0)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0, fusion_threshold_mb: float = 25,
                 process_group=None):
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a bitscom.DistributedOptimizer; wrap it only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(compression, str):
            compression = get_compressor(compression)
        if not isinstance(compression, Compressor):
            raise TypeError(f"compression must be a bitscom compressor or a registry name, got {compression!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        if op not in (Average, Sum):
            raise ValueError(f"op must be bitscom.Average or bitscom.Sum, got {op!r}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
        if op is Sum and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor applies to op=Average only; "
                             f"got {gradient_predivide_factor} with op=Sum")
        if not fusion_threshold_mb >= 0:
            raise ValueError(f"fusion_threshold_mb must be >= 0, got {fusion_threshold_mb!r}")

        self.optimizer = optimizer
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

        named = _named_params(optimizer, named_parameters)
        for name, p in named:
            if p.requires_grad and not (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                                "parameters can be trained")
            if p.requires_grad and p.is_complex():
                raise TypeError(f"parameter {name!r} is complex ({p.dtype}); bitscom reduces real "
                                "tensors only (view it with torch.view_as_real)")
        self._trainable = [(n, p) for n, p in named if p.requires_grad]

        if process_group is None and runtime.is_initialized():
            process_group = runtime.world_group()
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        self._size = dist.get_world_size(process_group) if process_group is not None else 1

        threshold = int(fusion_threshold_mb * 2 ** 20)
        self._layouts = plan_buckets(self._trainable, threshold)
        by_name = dict(self._trainable)
        self._buckets = [FlatBucket(l, [by_name[s.name] for s in l.slots]) for l in self._layouts]
        self._slot: Dict[int, tuple] = {}
        for b, bucket in enumerate(self._buckets):
            for s, p in enumerate(bucket.params):
                self._slot[id(p)] = (b, s)
        self._passes: Dict[int, int] = {id(p): 0 for _, p in self._trainable}
        self._filled = [[False] * len(b.params) for b in self._buckets]
        self._next_launch = 0
        self._agreed = False
        self._should_sync = True
        self._synchronized = False
        self._stats = {"bytes_sent": 0, "dense_bytes": 0, "buckets": len(self._buckets)}
        self._hooks = []
        later = None
        if self._size > 1:
            ranks = dist.get_process_group_ranks(process_group)
            later = dist.new_group(ranks, use_local_synchronization=True)
        self._reducer = Reducer(compression, self._layouts, process_group, later)
        if self._size > 1:
            # The hooks hold the optimizer weakly and are removed when it is collected, so a
            # replaced optimizer (a new one built for the same model) stops reducing gradients.
            this = weakref.ref(self)
            for _, p in self._trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, this=this: _forward_hook(this, param)))
            weakref.finalize(self, _remove_hooks, list(self._hooks))

    # -- delegation so schedulers, clipping helpers and AMP see a normal optimizer --------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group):
        raise RuntimeError("bitscom plans its buckets once; add every parameter group to the "
                           "optimizer before wrapping it in DistributedOptimizer")

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r}, compression={self.compression.fingerprint()})"

    # -- the backward hook -------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if p.grad is not None and p.grad.is_sparse:
            b, s = self._slot[key]
            raise TypeError(f"parameter {self._buckets[b].layout.slots[s].name!r} has a sparse "
                            "gradient; bitscom reduces dense gradients only (use a dense embedding)")
        count = self._passes[key] + 1
        if count > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradients were computed {count} times before optimizer.step() with "
                f"backward_passes_per_step={self.backward_passes_per_step}; raise "
                "backward_passes_per_step to accumulate more passes locally, or call step()")
        self._passes[key] = count
        self._synchronized = False
        if count == self.backward_passes_per_step:
            b, s = self._slot[key]
            self._fill(b, s, p.grad)
            self._launch_ready()
        self._reducer.poll()

    def _fill(self, b: int, s: int, grad) -> None:
        self._buckets[b].fill(s, grad)
        if not self._filled[b][s]:
            self._filled[b][s] = True
            self._buckets[b].pending -= 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        if not self._agreed:
            check_agreement(self._description(), self.process_group)
            self._agreed = True
        flat = self._buckets[b].flat
        if self.op is Average and self.gradient_predivide_factor != 1.0:
            flat.div_(self.gradient_predivide_factor)
        self._reducer.launch(b, flat)

    def _description(self) -> dict:
        return {
            "world size": self._size,
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._trainable],
            "buckets": [l.describe() for l in self._layouts],
            "compressor": self.compression.fingerprint(),
            "backward_passes_per_step": self.backward_passes_per_step,
            "op": self.op.value,
            "gradient_predivide_factor": self.gradient_predivide_factor,
        }

    # -- the public step API -----------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the reduction of every gradient and write the results into ``p.grad``.

        Call it yourself to clip or inspect reduced gradients, then step under
        :meth:`skip_synchronize`. Example::

            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        if self._size == 1:
            self._synchronized = True
            return
        for b in range(self._next_launch, len(self._buckets)):
            for s, p in enumerate(self._buckets[b].params):
                if not self._filled[b][s]:
                    self._fill(b, s, p.grad)
        self._launch_ready()
        try:
            sent = self._reducer.wait_all()
        finally:
            self._reset_step()
        post = 1.0
        if self.op is Average and self.gradient_predivide_factor != 1.0:
            post = self.gradient_predivide_factor
        elif self.op is Sum:
            post = float(self._size)
        dense = 0
        for bucket in self._buckets:
            if post != 1.0:
                bucket.flat.mul_(post)
            bucket.write_back()
            dense += bucket.layout.numel * 4
        self._stats = {"bytes_sent": sent, "dense_bytes": dense, "buckets": len(self._buckets)}
        self._synchronized = True

    def _reset_step(self) -> None:
        self._next_launch = 0
        for key in self._passes:
            self._passes[key] = 0
        for b, bucket in enumerate(self._buckets):
            bucket.reset()
            self._filled[b] = [False] * len(bucket.params)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` use ``p.grad`` as it is, after an explicit :meth:`synchronize`."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize` or already done), then step."""
        if self._should_sync and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero ``p.grad``; refuses while gradients are still being reduced."""
        if self._reducer.in_flight or self._next_launch > 0:
            raise RuntimeError("zero_grad() was called while gradients are being reduced "
                               "(after backward, before step()/synchronize()); call step() or "
                               "synchronize() first")
        self._reset_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def comm_stats(self) -> dict:
        """Bytes of the last synchronized step: ``bytes_sent`` (payload this rank handed to
        the network) and ``dense_bytes`` (what fp32 gradients would have cost)."""
        stats = dict(self._stats)
        stats["compression_ratio"] = (stats["dense_bytes"] / stats["bytes_sent"]
                                      if stats["bytes_sent"] else float("nan"))
        return stats

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus this rank's compressor state."""
        return {"optimizer": self.optimizer.state_dict(),
                "bitscom": {"reducer": self._reducer.state_dict()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` saved (a plain optimizer state dict is accepted too)."""
        if "bitscom" in state_dict and "optimizer" in state_dict:
            self._reducer.load_state_dict(state_dict["bitscom"]["reducer"])
            self.optimizer.load_state_dict(state_dict["optimizer"])
        else:
            self.optimizer.load_state_dict(state_dict)

    @property
    def bucket_layouts(self):
        """The planned buckets (read-only), for inspection and tests."""
        return list(self._layouts)

    @property
    def compressor_states(self):
        """Per-bucket compressor state objects (index = bucket index)."""
        return list(self._reducer.states)
