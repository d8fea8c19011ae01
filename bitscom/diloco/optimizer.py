"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025); the algorithm: docs/diloco.md.
The pseudo-gradient goes through the same :class:`~bitscom.engine.Reducer` as
``DistributedOptimizer``, so any compressor works and its bytes are counted the same way.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import runtime
from ..agreement import describe_state
from ..buckets import FlatBucket
from ..compressors import resolve as resolve_compressor
from ..compressors.lowbit import LowBit
from ..engine import Reducer
from ..face import Face, check_trainable, dense_bytes, has_tensor, renamed, report
from ..lifecycle import StepFace
from ..params import named_parameters_of
from ..validate import instance, number
from .config import DiLoCoConfig
from .fragments import plan_fragments
from .state import load_checked
from .streaming import Flight, FragmentReducers, saved_flights

__all__ = ["DiLoCo", "DEFAULT_COMPRESSION"]

DEFAULT_COMPRESSION = LowBit(bitwidth=4, error_feedback=True)
"""4-bit low-bit all-reduce with error feedback: Streaming DiLoCo sends 4-bit pseudo-gradients,
and the residual keeps what rounding dropped for the next synchronization."""


def _inner_checked(inner) -> torch.optim.Optimizer:
    if isinstance(inner, DiLoCo):
        raise TypeError("inner_optimizer is already a bitscom.DiLoCo; wrap a plain optimizer once")
    if isinstance(inner, StepFace):
        raise TypeError(f"inner_optimizer is a bitscom DistributedOptimizer/ShardedOptimizer "
                        f"({type(inner).__name__}) that reduces gradients every step; DiLoCo's inner steps are "
                        "local by design. Pass the plain optimizer (e.g. torch.optim.AdamW(...)) to DiLoCo instead")
    instance("inner_optimizer", inner, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if callable(getattr(inner, "comm_stats", None)):
        raise TypeError(f"inner_optimizer {type(inner).__name__} communicates by itself "
                        "(it has comm_stats()); DiLoCo needs a local optimizer such as "
                        "torch.optim.AdamW")
    return inner


class DiLoCo(Face, torch.optim.Optimizer):
    """Wrap a local ``inner_optimizer`` into DiLoCo: ``sync_every`` local steps, then one
    compressed pseudo-gradient reduction and an outer Nesterov SGD step.

    Use it like any optimizer with LOCAL gradients (no ``DistributedOptimizer``, no DDP) and
    call ``step()`` on every rank every iteration: the step counter decides when the ranks
    communicate. Under ``GradScaler`` an overflowed step skips the inner update but counts.

    ``compression``: a bitscom compressor or registry name (``None`` = exact fp32);
    ``sync_every`` ... ``mix`` are :class:`~bitscom.diloco.DiLoCoConfig`'s.

    Example::

        bitscom.init()
        model = Net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        opt = bitscom.diloco.DiLoCo(inner, model.named_parameters(), sync_every=16)
        for x, y in loader:                       # this rank's shard of the data
            loss_fn(model(x), y).backward()
            opt.step()                            # every 16th step: compressed outer step
            opt.zero_grad()
        opt.sync()                                # the final model includes the last steps
        print(opt.comm_stats()["compression_ratio"])   # bytes vs per-step fp32 all-reduce
    """

    _step_supports_amp_scaling = True   # GradScaler calls step() every iteration (see _inner_step)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if issubclass(cls, StepFace):   # DistributedOptimizer(DiLoCo(...)) builds such a class
            raise TypeError("a bitscom.DiLoCo cannot be wrapped in bitscom.DistributedOptimizer "
                            "(or ShardedOptimizer): that would all-reduce every gradient on top of "
                            "DiLoCo's periodic pseudo-gradient reduction. Use DiLoCo alone with "
                            "local gradients")

    def __init__(self, inner_optimizer, named_parameters=None, *, sync_every: int = 16,
                 compression: Any = DEFAULT_COMPRESSION, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, process_group=None, fusion_threshold_mb: float = 25,
                 warmup_steps: int = 0, delay: int = 0, mix: float = 0.0, group=None):
        group = renamed(process_group, group, new="process_group", old="group", where="DiLoCo")
        self._face_init("DiLoCo", group)
        group = self._group = self.process_group
        # Validated on every rank, then compared: a bad value on one rank is an error on every rank.
        error: Optional[Exception] = None
        try:
            self._setup(inner_optimizer, named_parameters, compression,
                        DiLoCoConfig(sync_every, outer_lr, outer_momentum, nesterov, fragments,
                                     warmup_steps, delay, mix), fusion_threshold_mb)
        except (TypeError, ValueError) as err:
            error = err
        self._face_agree({} if error is not None else self._description(), error, what="DiLoCo settings")
        self._refuse_ddp(self._ddp)
        self._start()

    # -- construction --------------------------------------------------------------------
    def _setup(self, inner, named_parameters, compression, config, fusion_threshold_mb) -> None:
        self.inner = _inner_checked(inner)
        self.config = config
        self.compression = resolve_compressor("none" if compression is None else compression, "compression")
        if self.compression.applies_momentum:
            raise ValueError(f"compression={self.compression.fingerprint()} applies SGD momentum "
                             "itself; DiLoCo's outer SGD already has momentum (outer_momentum)")
        number("fusion_threshold_mb", fusion_threshold_mb, minimum=0, finite=True)
        named = named_parameters_of(self.inner, named_parameters)
        check_trainable(named, "DiLoCo")
        self._plan_requires_grad(named)
        self._trainable = [(n, p) for n, p in named if p.requires_grad]
        self._ddp = self._ddp_wrapped([p for _, p in self._trainable])
        if not self._trainable:
            raise ValueError("DiLoCo got no trainable parameters (requires_grad=True)")
        self._layouts, self._members = plan_fragments(self._trainable, self.config.fragments,
                                                      int(fusion_threshold_mb * 2 ** 20))

    def _description(self) -> Dict[str, Any]:
        return {"parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._trainable],
                "wrapped in DistributedDataParallel": self._ddp is not None, "settings": repr(self.config),
                "compressor": self.compression.fingerprint(), "inner optimizer": type(self.inner).__name__,
                "fragments": [[self._layouts[b].describe() for b in m] for m in self._members]}

    def _start(self) -> None:
        by_name = dict(self._trainable)
        params = [by_name[s.name] for l in self._layouts for s in l.slots]
        torch.optim.Optimizer.__init__(self, params, {})
        # Share the inner optimizer's groups and state: GradScaler, clipping helpers and LR
        # schedulers built on this object see (and change) the inner optimizer's.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults
        if self._size > 1:     # every replica starts from rank 0's weights, as DDP does
            from ..broadcast import broadcast_parameters
            src = torch.distributed.get_global_rank(self._group, 0)
            broadcast_parameters(self._trainable, root_rank=src, process_group=self._group)
        self._buckets = [FlatBucket(l, [by_name[s.name] for s in l.slots]) for l in self._layouts]
        with torch.no_grad():
            self._global = [b.flat.clone() for b in self._buckets]
        self._params_to_global()
        cfg = self.config
        self.outer_optimizer = torch.optim.SGD(self._global, lr=cfg.outer_lr,
                                               momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
        # one reducer per fragment, on the group's channel; overlapping needs its later group
        channel = runtime.channel(self._group, later=cfg.delay > 0)
        self._reducer = FragmentReducers(self.compression, self._layouts, self._members, channel)
        self._flights: Dict[int, Flight] = {}
        self._fresh = [True] * cfg.fragments     # θ_local = θ_global in this fragment
        # the warm-up's own state: error feedback of gradients is not that of pseudo-gradients
        self._warmup_reducer = Reducer(self.compression, self._layouts, self._group)
        self._counters = {"inner_steps": 0, "skipped_inner_steps": 0, "syncs": 0, "fragment_syncs": 0, "bytes_sent": 0,
                          "nonfinite_syncs": 0, "warmup_syncs": 0}
        self._dense_per_step = dense_bytes(sum(l.numel for l in self._layouts))
        self._last_step = (0, 0)

    # -- the step --------------------------------------------------------------------------
    def _inner_step(self, closure):
        """Run the inner optimizer unless GradScaler found Inf/NaN here, unscaling as GradScaler would."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            self._counters["skipped_inner_steps"] += 1
            return None
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for grad in [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]:
                    grad.mul_(inv.to(grad.device))
        return self.inner.step() if closure is None else self.inner.step(closure)

    def step(self, closure=None):  # type: ignore[override]
        """One inner step; after every ``sync_every``-th (per fragment), the outer step."""
        before = self._counters["bytes_sent"]
        try:
            self._check_live()
            self._check_requires_grad()
            self._agree_if_resumed(self._resume_description, "DiLoCo resumed state")
            if self.config.in_warmup(self._counters["inner_steps"] + 1):
                return self._warmup_step(closure)
            if self._flights:       # issue the next rounds of the reductions in flight, if they can go
                self._reducer.poll()
            loss = self._inner_step(closure)
            self._counters["inner_steps"] += 1
            self._fresh = [False] * self.config.fragments
            step = self._counters["inner_steps"]
            self._launch(self.config.due(step))
            lands = [f for f in self.config.lands(step) if f in self._flights]
            if lands:
                self._land(lands)
            return loss
        finally:
            self._last_step = (self._counters["bytes_sent"] - before, self._dense_per_step)

    @torch.no_grad()
    def _params_to_global(self) -> None:
        """θ_global := the model's parameters (at construction, and after each warm-up step)."""
        for g, bucket in zip(self._global, self._buckets):
            for s, p in zip(bucket.layout.slots, bucket.params):
                g[s.offset:s.end].copy_(p.reshape(-1))

    def _gather_grads(self) -> None:
        """Copy every ``p.grad`` (unscaled under GradScaler; missing = zeros) into the flat buckets."""
        scale = getattr(self, "grad_scale", None)
        inv = None if scale is None else scale.double().reciprocal().float()
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    view.zero_()
                elif inv is None:
                    view.copy_(p.grad)
                else:
                    torch.mul(p.grad, inv.to(p.grad.device), out=view)

    def sync(self) -> None:
        """Bring θ_global up to date now, off the schedule, and make the model θ_global: call it
        on every rank after the last ``step()`` so the model you evaluate or save includes the
        last, partial interval. Reductions in flight land first; the schedule is unchanged.

        Example::

            for x, y in loader:
                loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
            opt.sync()                       # the final model = θ_global, identical everywhere
        """
        self._check_live()
        self._agree_if_resumed(self._resume_description, "DiLoCo resumed state")
        step = self._counters["inner_steps"]
        self._face_agree({"inner steps": step, "reductions in flight": sorted(self._flights),
                          "fragments behind θ_global": [not f for f in self._fresh]},
                         what="DiLoCo.sync() point (every rank calls sync() after the same step)")
        if self.config.in_warmup(step):          # θ_global is current
            return
        if self._flights:
            landing = sorted(self._flights)
            self._land(landing, replace=[f for f in landing if self._flights[f].start == step])
        stale = [f for f, fresh in enumerate(self._fresh) if not fresh]
        if stale:
            self._launch(stale)
            self._land(stale, replace=stale)

    def _warmup_step(self, closure):
        """Post-local-SGD warm-up: the inner step on the reduced gradient; Inf/NaN skips it everywhere."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._gather_grads()
            sent = 0
            if self._size > 1:
                try:
                    for b, bucket in enumerate(self._buckets):
                        self._warmup_reducer.launch(b, bucket.flat)
                    sent = self._warmup_reducer.wait_all()
                except BaseException:
                    self._warmup_reducer.abort()
                    raise
            finite = all(bool(torch.isfinite(b.flat).all()) for b in self._buckets)
            if finite:
                for bucket in self._buckets:
                    bucket.write_back()
        c = self._counters
        c["bytes_sent"] += sent
        c["warmup_syncs"] += 1
        c["inner_steps"] += 1
        if not finite:
            c["skipped_inner_steps"] += 1
            self._warmup_reducer.states = [self.compression.init_state(l) for l in self._layouts]
            return loss
        self.inner.step()
        self._params_to_global()
        return loss

    @torch.no_grad()
    def _launch(self, fragments: List[int]) -> None:
        """Form the pseudo-gradient θ_global − θ_local of ``fragments`` and launch its reduction."""
        step = self._counters["inner_steps"]
        for f in fragments:
            for b in self._members[f]:
                bucket, g = self._buckets[b], self._global[b]
                for s, p, view in zip(bucket.layout.slots, bucket.params, bucket.views):
                    torch.sub(g[s.offset:s.end].view(s.shape), p, out=view)
            if self._size > 1:
                try:
                    self._reducer.launch(f, [self._buckets[b].flat for b in self._members[f]])
                except BaseException:
                    self._reducer.reducers[f].abort()
                    raise
            # one process: Δ is its own average, already there
            self._flights[f] = Flight(f, step, arrived=self._size == 1)

    def _arrive(self, fragments: Sequence[int]) -> None:
        """Wait for ``fragments``' reductions (their results land in their flat buckets)."""
        for flight in (self._flights[f] for f in fragments):
            if not flight.arrived:
                flight.bytes_sent = self._reducer.wait(flight.fragment)
                flight.arrived = True

    def _land(self, fragments: List[int], replace: Sequence[int] = ()) -> None:
        """Finish ``fragments``' reductions, step θ_global, and merge (``mix``) or replace (``replace``)."""
        self._arrive(fragments)
        chosen = [b for f in fragments for b in self._members[f]]
        sent = sum(self._flights.pop(f).bytes_sent for f in fragments)
        with torch.no_grad():
            finite = all(bool(torch.isfinite(self._buckets[b].flat).all()) for b in chosen)
            picked = set(chosen)
            for b, g in enumerate(self._global):
                g.grad = self._buckets[b].flat if b in picked else None
            self.outer_optimizer.step()
            for f in fragments:
                self._merge(f, self.config.mix if f not in replace else 0.0)
        c = self._counters
        c["bytes_sent"] += sent
        c["syncs"] += 1
        c["fragment_syncs"] += len(fragments)
        if not finite:       # the same on every rank: the reduced values are identical
            c["nonfinite_syncs"] += 1
            warnings.warn(f"DiLoCo: the averaged pseudo-gradient of fragment(s) {fragments} landing "
                          f"at inner step {c['inner_steps']} holds NaN/Inf; the parameters are now "
                          "non-finite on every rank (lower the inner lr, clip, or use GradScaler)",
                          RuntimeWarning, stacklevel=4)

    def _merge(self, fragment: int, alpha: float) -> None:
        """θ_local ← α·θ_local + (1 − α)·θ_global (a copy when α = 0: no 0·Inf survives)."""
        for b in self._members[fragment]:
            g, bucket = self._global[b], self._buckets[b]
            g.grad = None
            for s, p in zip(bucket.layout.slots, bucket.params):
                new = g[s.offset:s.end].view(s.shape)
                if alpha == 0.0:
                    p.copy_(new)
                else:
                    p.mul_(alpha).add_(new, alpha=1.0 - alpha)
        self._fresh[fragment] = alpha == 0.0

    def _resume_description(self) -> dict:
        """After a load, what every rank must have resumed alike."""
        steps = {k: self._counters[k] for k in ("inner_steps", "syncs", "fragment_syncs")}
        return {"steps": steps, "reductions in flight": {f: fl.start for f, fl in sorted(self._flights.items())},
                "compressor state": [describe_state(s) for s in self._reducer.states],
                "warm-up compressor state": [describe_state(s) for s in self._warmup_reducer.states]}

    def _release_groups(self) -> None:
        self._group = None
        for reducer in (getattr(self, "_reducer", None), getattr(self, "_warmup_reducer", None)):
            if reducer is not None:          # None: construction failed before the reducers
                reducer.release()

    # -- the rest of the optimizer API -----------------------------------------------------
    def comm_stats(self) -> dict:
        """Whole-run ``bytes_sent`` against an exact fp32 gradient all-reduce every step
        (``dense_bytes``), their ratio and the step and sync counters.

        Example::

            opt.comm_stats()["compression_ratio"]    # = sync_every with compression=None
        """
        c = dict(self._counters)
        sent = c.pop("bytes_sent")
        return report(*self._last_step, sent, c["inner_steps"] * self._dense_per_step, **c)

    @property
    def global_parameters(self) -> List[torch.Tensor]:
        """θ_global, one flat tensor per bucket (identical on every rank), read-only use."""
        return list(self._global)

    @property
    def bucket_layouts(self):
        """The planned buckets of the pseudo-gradient reduction (index = bucket index)."""
        return list(self._layouts)

    @property
    def fragment_buckets(self) -> List[List[int]]:
        """The bucket indices of each fragment."""
        return [list(m) for m in self._members]

    def close(self) -> None:
        """Refuse further steps; reductions in flight are not waited for (:meth:`sync` first)."""
        self._face_close()

    def state_dict(self) -> dict:  # type: ignore[override]
        """The inner optimizer's state dict plus, under ``"diloco"``, θ_global, the outer SGD,
        this rank's compressor state, the counters and any reduction in flight (waited for):
        resuming reproduces the uninterrupted run bitwise. Save it on every rank.

        Example::

            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"ckpt.{rank}.pt")
        """
        self._arrive(sorted(self._flights))
        flights = [{"fragment": f, "start": fl.start, "bytes_sent": fl.bytes_sent,
                    "reduced": [self._buckets[b].flat.detach().clone() for b in self._members[f]]}
                   for f, fl in sorted(self._flights.items())]
        out = self.inner.state_dict()
        out["diloco"] = {"counters": dict(self._counters), "flights": flights,
                         "fresh": list(self._fresh),
                         "global": [g.detach().clone() for g in self._global],
                         "outer": self.outer_optimizer.state_dict(),
                         "reducer": self._reducer.state_dict(),
                         "warmup_reducer": self._warmup_reducer.state_dict(),
                         "config": repr(self.config), **self._envelope(self._counters["inner_steps"])}
        return out

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load this rank's own :meth:`state_dict` (and the model's); the ranks then check their steps."""
        if not isinstance(state_dict, dict) or "diloco" not in state_dict:
            raise ValueError("not a DiLoCo state dict (no 'diloco' entry); a plain optimizer's "
                             "state dict goes to opt.inner.load_state_dict()")
        extra = state_dict["diloco"]
        if not self.config.same_as(extra.get("config")):
            raise ValueError(f"checkpoint was saved with {extra.get('config')}, this DiLoCo has "
                             f"{self.config!r}")
        states = [extra["reducer"]["states"], extra.get("warmup_reducer", {}).get("states", [])]
        if not self._check_envelope(extra, per_rank_state=has_tensor(states)):
            self._mark_loaded()               # the next step raises the problem on every rank
            return
        inner = {k: v for k, v in state_dict.items() if k != "diloco"}
        flights = saved_flights(extra, self._members, [b.flat for b in self._buckets])
        self._arrive(sorted(self._flights))      # this object's own reductions finish (every rank's do)
        load_checked(self, inner, extra)
        self._flights = {}
        with torch.no_grad():
            for f, (flight, reduced) in flights.items():
                for b, r in zip(self._members[f], reduced):
                    self._buckets[b].flat.copy_(r)
                self._flights[f] = flight
        self._fresh = self._saved_fresh(extra)
        self._mark_loaded()

    def _saved_fresh(self, extra: dict) -> List[bool]:
        """Which fragments the checkpoint had equal to θ_global (older ones: from the schedule)."""
        if "fresh" in extra:
            return [bool(x) for x in extra["fresh"]]
        step, cfg = self._counters["inner_steps"], self.config
        synced = set(cfg.due(step))
        return [step == 0 or cfg.in_warmup(step) or f in synced for f in range(cfg.fragments)]
