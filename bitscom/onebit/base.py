"""What OneBitAdam and ZeroOneAdam share: construction (settings agreed across ranks, one flat
fp32 momentum), the exact and the 1-bit all-reduce, GradScaler's inf flag agreed across ranks,
the overlapped path, byte counting and a per-rank ``state_dict``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import runtime
from ..comm import Rounds
from ..face import Face, check_trainable, dense_bytes, report
from ..lifecycle import StepFace, StepLifecycle
from ..lowbit import LowBitState, all_reduce_rounds
from ..lowbit.ranged import range_rounds
from .config import OverlapConfig, check_common
from .overlap import OverlapBuckets

__all__ = ["OneBitBase"]


def _fields(cls, args: Dict[str, Any]) -> Dict[str, Any]:
    return {f.name: args[f.name] for f in dataclasses.fields(cls)}


class OneBitBase(Face, torch.optim.Optimizer):
    """Base class: subclasses set ``_NAME`` and ``_CONFIG`` and implement ``_update``."""

    _NAME = "OneBitBase"
    _CONFIG: Any = None
    _step_supports_amp_scaling = True   # GradScaler hands over grad_scale / found_inf (see step)
    # None until overlap=True attaches them; also what a constructor that failed early leaves for
    # the world's end to release (the face registered first).
    _buckets: Optional[OverlapBuckets] = None
    _life: Optional[StepLifecycle] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if issubclass(cls, StepFace):   # DistributedOptimizer(OneBitAdam(...)) builds such a class
            raise TypeError(f"a bitscom {cls.__name__} cannot be wrapped in bitscom.DistributedOptimizer "
                            "(or ShardedOptimizer): it communicates by itself (exact gradients during "
                            "the warm-up, the 1-bit momentum after it); wrapping would all-reduce every "
                            "gradient a second time. Use it alone, with LOCAL gradients in p.grad")

    def __init__(self, params, lr: float, weight_decay: float, group, args: Dict[str, Any]):
        """``args``: the subclass's keyword arguments (named as the config dataclasses' fields)."""
        name = self._NAME
        self._face_init(name, group)
        pg = self._group = self.process_group
        # Validated on every rank, then compared: a bad value on one rank is an error on every rank.
        error: Optional[Exception] = None
        try:
            betas = check_common(name, lr, args.get("betas"), args.get("eps"), weight_decay)
            self.config = self._CONFIG(**dict(_fields(self._CONFIG, args), betas=betas))
            self.overlap_config = OverlapConfig(**_fields(OverlapConfig, args))
            torch.optim.Optimizer.__init__(self, params, dict(lr=lr, weight_decay=weight_decay))
            self._plan()
        except (TypeError, ValueError) as err:
            error = err
        description: Dict[str, Any] = {}
        ddp = None
        if error is None:
            ddp = self._ddp_wrapped(self._params)
            description = {**self._description(), "wrapped in DistributedDataParallel": ddp is not None,
                           "groups": [(g["lr"], g["weight_decay"]) for g in self.param_groups],
                           "parameters": [(tuple(p.shape), str(p.dtype)) for p in self._params]}
        self._face_agree(description, error, what=f"{name} settings")
        self._refuse_ddp(ddp)
        if self._size > 1:        # every replica starts from rank 0's weights, as DDP does
            from ..broadcast import broadcast_parameters
            broadcast_parameters(list(self._params), root_rank=dist.get_global_rank(pg, 0), process_group=pg)
        self._lowbit = LowBitState()
        self._counters = {"step": 0, "exact_steps": 0, "compressed_steps": 0, "skipped_steps": 0, "bytes_sent": 0}
        self._last_step: Tuple[int, int] = (0, 0)     # (bytes sent, dense bytes) of the last step
        self._dense_per_step = dense_bytes(self._numel) if self._size > 1 else 0
        self._sent: Optional[str] = None      # this step's 1-bit all-reduce already ran from the hooks
        overlapped = self.overlap_config.overlap and self._size > 1
        # Overlapped buckets finish at different moments per rank: their later rounds need the
        # channel's later group (see bitscom.channel), made here, on every rank at once.
        self._channel = runtime.channel(pg, later=overlapped)
        if overlapped:
            self._attach_overlap(pg)

    def _attach_overlap(self, pg) -> None:
        """``overlap=True``: buckets of whole 1-bit blocks and the gradient hooks (StepLifecycle)."""
        oc = self.overlap_config
        block = self.config.block_size
        self._buckets = OverlapBuckets([p.numel() for p in self._params], self._numel, self._size, block,
                                       oc.max_elements(block), self.exp_avg.device)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._life = StepLifecycle(self, self._NAME, pg, oc.backward_passes_per_step)
        self._life.attach([p for p in self._params if p.requires_grad], joinable=False)

    # -- construction ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_params", None):
            raise RuntimeError(f"{self._NAME}: add_param_group after construction would change the "
                               "flat momentum every rank agreed on; pass every group to the constructor")
        if isinstance(param_group, dict):
            check_common(self._NAME, param_group.get("lr", self.defaults["lr"]), (0.9, 0.999), 0.0,
                         param_group.get("weight_decay", self.defaults["weight_decay"]))
            for key in ("betas", "eps"):
                if key in param_group:
                    raise ValueError(f"{self._NAME}: {key} is one setting for the whole model (the "
                                     f"momentum is one flat buffer); a parameter group may set lr, "
                                     f"weight_decay and exp_avg_mask only, got {key}={param_group[key]!r}")
        super().add_param_group(param_group)

    def _plan(self) -> None:
        params: List[torch.Tensor] = []
        for i, g in enumerate(self.param_groups):
            for p in g["params"]:
                check_trainable([(f"param_groups[{i}]", p)], self._NAME)
                if p.dtype != torch.float32:
                    raise TypeError(f"{self._NAME} keeps its state in float32 and updates float32 "
                                    f"parameters; got a {p.dtype} parameter of shape {tuple(p.shape)} "
                                    "(keep fp32 master weights and use autocast)")
                params.append(p)
            mask = g.get("exp_avg_mask")
            if mask is not None:
                for p in g["params"]:
                    if not isinstance(mask, torch.Tensor) or torch.broadcast_shapes(mask.shape, p.shape) != p.shape:
                        raise ValueError(f"{self._NAME} exp_avg_mask of shape "
                                         f"{getattr(mask, 'shape', mask)!r} does not broadcast to its "
                                         f"group's parameter of shape {tuple(p.shape)}")
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{self._NAME}: a parameter appears twice in the parameter groups")
        if not params:
            raise ValueError(f"{self._NAME} got no parameters")
        self._params = params
        self._plan_requires_grad([(f"param {i} of shape {tuple(p.shape)}", p) for i, p in enumerate(params)])
        sizes = [p.numel() for p in params]
        self._numel = sum(sizes)
        self._offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        dev = params[0].device
        self.exp_avg = torch.zeros(self._numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(self._numel, dtype=torch.float32, device=dev)

    # -- pieces of a step --------------------------------------------------------------------
    def _views(self, *flats: torch.Tensor):
        """(param, its group, its view of each of ``flats``) for every parameter, in flat order."""
        groups = [g for g in self.param_groups for _ in g["params"]]
        for p, g, off in zip(self._params, groups, self._offsets):
            yield (p, g, *[f[off:off + p.numel()].view(p.shape) for f in flats])

    def _local_gradient(self) -> torch.Tensor:
        """This rank's gradient as one flat fp32 tensor (missing = zeros), unscaled under GradScaler."""
        flat = torch.zeros(self._numel, dtype=torch.float32, device=self.exp_avg.device)
        for p, _, view in self._views(flat):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._NAME} does not support sparse gradients "
                                       f"(parameter of shape {tuple(p.shape)})")
                view.copy_(p.grad)
        scale = getattr(self, "grad_scale", None)
        if scale is not None:         # GradScaler's scale is still in p.grad: undo it as it would
            flat.mul_(scale.double().reciprocal().float().to(flat.device))
        return flat

    def _run(self, rounds_of) -> None:
        """One collective's rounds on the group's Channel, to completion; its bytes are counted."""
        comm = self._channel.comm()
        self._channel.wait(self._channel.submit(Rounds(rounds_of(comm), [comm])))
        self._counters["bytes_sent"] += comm.bytes_sent

    def _exact_average(self, flat: torch.Tensor) -> torch.Tensor:
        if self._size > 1:
            self._run(lambda comm: iter([comm.all_reduce(flat)]))
            flat.div_(self._size)
        return flat

    def _onebit_average(self, flat: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's compressed_allreduce in place; a no-op when the hooks already reduced this step."""
        if self._size > 1 and self._sent is None:
            self._run(lambda comm: all_reduce_rounds(flat, comm, self.config.codec, self._lowbit))
        return flat

    def _mask(self, flat: torch.Tensor) -> None:
        """``exp_avg_mask``: 1-bit codes cannot say 0, so always-zero rows would collect error for ever."""
        for _, g, view in self._views(flat):
            if g.get("exp_avg_mask") is not None:
                view.mul_(g["exp_avg_mask"].to(view.device, view.dtype))

    def _apply(self, update: torch.Tensor, *also: torch.Tensor) -> None:
        """``p -= lr * (update + wd * p)`` (decoupled weight decay); each of ``also`` (0/1 Adam's u) alike."""
        for p, g, u, *rest in self._views(update, *also):
            lr, wd = g["lr"], g["weight_decay"]
            step = u + wd * p if wd > 0 else u
            step = step * lr
            for acc in rest:
                acc.sub_(step)
            p.sub_(step)

    def _denominator(self, bias_correction2: float = 1.0) -> torch.Tensor:
        """``sqrt(v / bias_correction2) + eps`` (torch's Adam order of operations)."""
        denom = self.exp_avg_sq.sqrt()
        if bias_correction2 != 1.0:
            denom.div_(math.sqrt(bias_correction2))
        return denom.add_(self.config.eps)

    def _skip_for_overflow(self) -> bool:
        """GradScaler found Inf/NaN on any rank: every rank skips the step (else the next would hang)."""
        found = getattr(self, "found_inf", None)
        return found is not None and self._max_over_ranks(float(found)) != 0.0

    def _max_over_ranks(self, value: float) -> float:
        """The largest ``value`` of the ranks (one 4-byte all-reduce)."""
        flag = torch.tensor([value], dtype=torch.float32, device=self.exp_avg.device)
        if self._size > 1:
            self._run(lambda comm: iter([comm.all_reduce(flag, dist.ReduceOp.MAX)]))
        return float(flag.item())

    # -- the overlapped path (overlap=True): hooks, buckets ----------------------------------
    def _overlap_kind(self, t: int) -> str:
        """What step ``t`` reduces from the hooks: ``"momentum"``, ``"gradient"`` or ``"none"``."""
        return "none"

    def _overlap_target(self, kind: str, start: int, stop: int) -> torch.Tensor:
        """Prepare ``[start, stop)`` of the hooks' all-reduce; the flat tensor it reduces in place."""
        assert self._buckets is not None
        work = self._buckets.reduced()
        work[start:stop].copy_(self._buckets.grad[start:stop])
        return work

    def _description(self) -> Dict[str, Any]:      # StepLifecycle's; agreed at construction
        return {"settings": repr(self.config), "overlap": repr(self.overlap_config)}

    def _on_gradient(self, p: torch.Tensor, last_pass: bool) -> None:
        """On the completing pass, copy the gradient into its bucket and launch the ready buckets."""
        b = self._buckets
        assert b is not None
        if not last_pass:
            return
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"{self._NAME} does not support sparse gradients (parameter of shape "
                               f"{tuple(p.shape)})")
        if b.kind is None:
            self._begin_overlap(b)
        if b.kind == "none":
            return
        b.fill(self._index[id(p)], p.grad)
        self._launch_ready(b)
        self._channel.poll()

    def _begin_overlap(self, b: OverlapBuckets) -> None:
        """The step's first gradient: the resume agreement, then what the hooks send this step."""
        self._agree_if_resumed(self._resume_description, f"{self._NAME} resumed state")
        b.kind = self._overlap_kind(self._counters["step"] + 1)
        if b.kind != "none":
            b.lowbit_step = self._lowbit.step
            self._lowbit.step += 1
            self._lowbit.bind(self._numel)

    def _launch_ready(self, b: OverlapBuckets) -> None:
        codec = self.config.codec
        for start, stop, owner in b.ready():
            target = self._overlap_target(b.kind or "none", start, min(stop, self._numel))
            comm = self._channel.comm()
            rounds = Rounds(range_rounds(target, start, stop, owner, comm, codec, self._lowbit, b.lowbit_step), [comm])
            b.flights.append(self._channel.submit(rounds))

    def _finish(self) -> None:
        """End of the completing backward pass: missing gradients count as zeros; every bucket launches."""
        b, life = self._buckets, self._life
        assert b is not None and life is not None
        if b.kind is None:
            self._begin_overlap(b)
        if b.kind != "none":
            for i, p in enumerate(self._params):     # fill skips those backward already filled
                b.fill(i, p.grad)
            self._launch_ready(b)
        life.completed = True

    def _collect_overlapped(self, b: OverlapBuckets) -> None:
        """Finish the hooks' buckets; every rank checks the gradient is still what was sent."""
        assert self._life is not None
        if not self._life.completed:
            self._finish()                    # fewer backward passes than configured
        try:
            for w in b.flights:
                self._channel.wait(w)
        finally:
            self._counters["bytes_sent"] += sum(w.bytes_sent for w in b.flights)
        changed = b.changed([p.grad for p in self._params])
        scaler = getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None
        code = int(self._max_over_ranks(float(bool(changed)) + 2.0 * scaler))
        if code & 2:
            raise RuntimeError(f"{self._NAME}(overlap=True) cannot step with GradScaler: its scale and "
                               "inf check arrive at step(), after this step's 1-bit all-reduce already left "
                               "from the gradient hooks with the scaled gradient (a step skipped for "
                               "overflow could not take it back). Build it with overlap=False to use AMP")
        if code:
            where = (f"parameter(s) {changed[:5]} on this rank" if changed else "another rank")
            raise RuntimeError(f"{self._NAME}(overlap=True): p.grad changed between backward() and step() "
                               f"({where}; e.g. clip_grad_norm_, GradScaler.unscale_ or an edit), but this "
                               "step's 1-bit all-reduce already left from the gradient hooks with the "
                               "gradient backward produced. Build it with overlap=False to step on "
                               "modified gradients (they are this rank's LOCAL gradients either way)")

    def _reset_overlap(self) -> None:
        if self._buckets is not None and self._life is not None:
            self._buckets.reset()
            self._life.reset_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero ``p.grad``; refused while an ``overlap=True`` all-reduce is in flight."""
        b = self._buckets
        if b is not None and b.kind not in (None, "none") and (b.flights or b.next):
            raise RuntimeError(f"{self._NAME}(overlap=True): zero_grad() after backward() and before "
                               "step(): this step's 1-bit all-reduce already left from the gradient hooks; "
                               "call step() first")
        self._reset_overlap()
        super().zero_grad(set_to_none=set_to_none)

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One step (call it every iteration on every rank)."""
        self._check_live()
        self._check_requires_grad()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._agree_if_resumed(self._resume_description, f"{self._NAME} resumed state")
        before = self._counters["bytes_sent"]
        b = self._buckets
        try:
            if b is not None and b.kind not in (None, "none"):
                self._collect_overlapped(b)
                self._sent = b.kind
                self._counters["step"] += 1
                self._update(b.reduced() if b.kind == "gradient" else b.grad, self._counters["step"])
            elif self._skip_for_overflow():
                self._counters["skipped_steps"] += 1
            else:
                grad = self._local_gradient()
                self._counters["step"] += 1
                self._update(grad, self._counters["step"])
        finally:
            self._sent = None
            self._reset_overlap()
        self._last_step = (self._counters["bytes_sent"] - before, self._dense_per_step)
        return loss

    def _update(self, grad: torch.Tensor, t: int) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def sync(self) -> None:
        """Make the replicas identical now: call it on every rank after the last ``step()``,
        before evaluating or saving (a no-op for 1-bit Adam, which synchronizes every step).

        Example::

            for x, y in loader:
                loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
            opt.sync()
        """
        self._check_live()
        self._agree_if_resumed(self._resume_description, f"{self._NAME} resumed state")

    # -- reporting, checkpoints --------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Whole-run ``bytes_sent`` against an exact fp32 gradient all-reduce per step, and counters."""
        c = dict(self._counters)
        sent = c.pop("bytes_sent")
        dense = (c["step"] + c["skipped_steps"]) * self._dense_per_step
        return report(*self._last_step, sent, dense, **c)

    def _extra_state(self) -> Dict[str, Any]:
        return {}

    def _load_extra(self, extra: Dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict:  # type: ignore[override]
        """torch's param_groups plus, under ``"onebit"``, this rank's own state (its residuals differ)."""
        if self._buckets is not None and self._buckets.flights:
            raise RuntimeError(f"{self._NAME}: state_dict() after backward() and before step() while "
                               "this step's 1-bit all-reduce is in flight (overlap=True); call it between "
                               "steps")
        out = super().state_dict()
        for g in out["param_groups"]:
            g.pop("exp_avg_mask", None)   # the user's masks stay the user's (as DeepSpeed)
        own = {"counters": dict(self._counters), "exp_avg": self.exp_avg.clone(),
               "exp_avg_sq": self.exp_avg_sq.clone(), "lowbit": self._lowbit.state_dict(),
               "extra": self._extra_state()}      # per rank (error feedback): under rank<r>
        out["onebit"] = {"optimizer": self._NAME, "settings": repr(self.config),
                         **self._envelope(self._counters["step"], own=own)}
        return out

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load this rank's own :meth:`state_dict`; resuming continues bitwise."""
        if self._buckets is not None and self._buckets.kind is not None:
            raise RuntimeError(f"{self._NAME}: load_state_dict() in the middle of a step (after "
                               "backward, before step()); call it between steps")
        extra = state_dict.get("onebit") if isinstance(state_dict, dict) else None
        if not isinstance(extra, dict) or extra.get("optimizer") != self._NAME:
            raise ValueError(f"not a {self._NAME} state dict (no matching 'onebit' entry)")
        extra = self._own_entry(extra)
        if extra.get("settings") != repr(self.config):
            raise ValueError(f"{self._NAME} state dict has settings={extra.get('settings')!r}, this "
                             f"optimizer {self.config!r}; each rank loads its own checkpoint, made with "
                             "the same settings and world size")
        if not self._check_envelope(extra, per_rank_state=True):
            self._mark_loaded()               # the next step raises the problem on every rank
            return
        if extra["exp_avg"].numel() != self._numel:
            raise ValueError(f"{self._NAME} state dict has {extra['exp_avg'].numel()} elements, this "
                             f"model {self._numel}")
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        plain = {k: v for k, v in state_dict.items() if k != "onebit"}
        super().load_state_dict(plain)
        for g, m in zip(self.param_groups, masks):
            if m is not None:
                g["exp_avg_mask"] = m
        self.exp_avg.copy_(extra["exp_avg"])
        self.exp_avg_sq.copy_(extra["exp_avg_sq"])
        self._lowbit = LowBitState()
        self._lowbit.load_state_dict(extra["lowbit"])
        self._counters = dict(extra["counters"])
        self._load_extra(extra["extra"])
        self._mark_loaded()

    def _resume_description(self) -> dict:
        """After a load, what every rank must have resumed alike: the counters and settings."""
        return {"counters": {k: v for k, v in self._counters.items() if k != "bytes_sent"},
                "extra": {k: v for k, v in self._extra_state().items() if not isinstance(v, torch.Tensor)}}

    def _release_groups(self) -> None:
        self._group = None
        self._channel = runtime.channel(None)
        if self._life is not None:
            self._life.release()
        if self._buckets is not None:
            self._buckets.flights = []

    def close(self) -> None:
        """Refuse further steps."""
        if self._life is not None:
            self._life.close()
        self._face_close()
