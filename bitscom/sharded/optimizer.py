"""ShardedOptimizer: ZeRO-style sharded data parallelism with SDP4Bit's communication quantization
(the data path: docs/sharded.md)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import zlib
from collections import defaultdict
from typing import Any, Dict, List, Optional, cast

import torch
import torch.distributed as dist

from .. import runtime
from ..checkpointing.sharded import load_sharded, save_sharded
from ..comm import Comm, gather_objects, wait
from ..face import ByteLedger
from ..lifecycle import StepFace, StepLifecycle
from ..runtime import node_groups, node_layout
from ..ops import Average, ReduceOp
from ..params import named_parameters_of
from ..validate import number
from .norms import clip_coefficient, global_norm, norm_summary
from .checkpoint import FORMAT, join_pieces, piece_state, split_state
from .config import ShardedConfig
from .gradients import GradientReducer, Topology, gradient_wire_bytes
from .layout import plan_shards
from .weights import gather_parameters, weight_wire_bytes

__all__ = ["ShardedOptimizer", "ELEMENTWISE_OPTIMIZERS"]

ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD",
    "Rprop") if hasattr(torch.optim, n))
"""Optimizers whose update of an element depends only on that element's gradient and state, so
running them on a 1-D slice of a parameter equals running them on the whole parameter."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _resolve_topology(process_group, intra_group, inter_group, local_size):
    """(topology, "consistent" or this rank's layout problem); no intra group: one still to build."""
    if process_group is None:
        return Topology(None, None, None, 1, 0, 1), "consistent"
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    intra_group, inter_group, local_size = _node_choice(process_group, intra_group, inter_group, local_size)
    if intra_group is None:
        if world % local_size:
            raise ValueError(f"local_size={local_size!r} must be an int >= 1 dividing the world size {world}")
        return Topology(process_group, None, None, world, rank, local_size), "consistent"
    topology = Topology(process_group, intra_group, inter_group, world, rank, dist.get_world_size(intra_group))
    return topology, _layout_problem(topology)


def _node_choice(process_group, intra_group, inter_group, local_size):
    """(intra, inter, local_size): the user's node groups, else runtime's, else one node."""
    if (intra_group is None) != (inter_group is None):
        raise ValueError("pass both intra_group and inter_group, or neither")
    if intra_group is not None and local_size is not None:
        raise ValueError("pass intra_group/inter_group or local_size, not both")
    if intra_group is None and local_size is None:
        if runtime.is_initialized() and runtime.intra_group() is not None \
                and dist.get_world_size(process_group) == runtime.size():
            return runtime.intra_group(), runtime.inter_group(), None
        return None, None, dist.get_world_size(process_group)
    return intra_group, inter_group, local_size


def _layout_problem(t: Topology) -> str:
    """"consistent" when the node groups are contiguous nodes of the group, else what is wrong."""
    world, rank, L = t.world, t.rank, t.local_size
    group, intra, inter = (dist.get_process_group_ranks(cast(Any, g)) for g in (t.group, t.intra, t.inter))
    expect_intra, expect_inter = node_layout(group, L, rank) if world % L == 0 else (None, None)
    if expect_intra is None or intra != expect_intra or inter != expect_inter:
        return (f"rank {rank}: intra group {intra}, inter group {inter}; expected contiguous nodes of "
                f"{L} ranks (intra {expect_intra}, inter {expect_inter})")
    return "consistent"


def _trainable_of(named):
    """The (name, parameter) pairs that train: at least one, one dtype and one device."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
    dtypes = sorted({str(p.dtype) for _, p in trainable})
    devices = sorted({str(p.device) for _, p in trainable})
    if len(dtypes) > 1 or len(devices) > 1:
        raise TypeError(f"all trainable parameters must share one dtype and device; got dtypes "
                        f"{dtypes} on devices {devices}")
    return trainable


def _check_optimizer(optimizer, elementwise: bool) -> None:
    if isinstance(optimizer, ShardedOptimizer):
        raise TypeError("optimizer is already a bitscom.ShardedOptimizer; wrap it only once")
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "compression"):
        raise TypeError("optimizer must be a plain torch.optim.Optimizer (not a bitscom "
                        f"DistributedOptimizer), got {type(optimizer).__name__}")
    if not elementwise and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise TypeError(f"{type(optimizer).__name__} is not known to be elementwise; sharding it "
                        "would change its result silently. Known: "
                        f"{[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}; pass elementwise=True "
                        "if every update of an element depends only on that element")


def _delegated(name: str) -> Any:
    """A property read from and written to the wrapped optimizer's attribute ``name``."""
    return property(lambda self: getattr(self.optimizer, name),
                    lambda self, value: setattr(self.optimizer, name, value))


class ShardedOptimizer(StepFace, torch.optim.Optimizer):
    """Shard ``optimizer``'s state over ranks (ZeRO / Megatron distributed optimizer) and
    optionally quantize its communication the SDP4Bit way.

    Each rank keeps an fp32 master copy of its slice of every bucket and the wrapped optimizer
    is re-pointed at it (existing state is sliced; an LR scheduler keeps working), so optimizer
    state takes about 1/world of the memory. The reduced gradient exists only as shards: after
    backward ``p.grad`` is ``None``, so clip with :meth:`clip_grad_norm_`. The arguments are
    :class:`~bitscom.sharded.ShardedConfig`'s plus the node groups (docs/sharded.md, Settings).

    Example::

        bitscom.init()
        model = GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
        opt = bitscom.ShardedOptimizer(opt, model.named_parameters(), quantized_weights=True,
                                       quantized_gradients=True, hadamard_transform=True)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
    """

    def __init__(self, optimizer, named_parameters=None, process_group=None, *, quantized_weights: bool = False,
                 weight_quantization_bits: int = 4, wq_group_size: int = 2048, quantized_gradients: bool = False,
                 gradient_quantization_bits_intra: int = 8, gq_group_size_intra: int = 512,
                 gradient_quantization_bits_inter: int = 4, gq_group_size_inter: int = 128,
                 hadamard_transform: bool = False, gradient_alltoall_pipeline: int = 1, fusion_threshold_mb: float = 25,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average, intra_group=None, inter_group=None,
                 local_size: Optional[int] = None, elementwise: bool = False, seed: int = 0):
        settings = locals()          # every ShardedConfig field is a keyword argument of that name
        _check_optimizer(optimizer, elementwise)
        if local_size is not None:
            number("local_size", local_size, minimum=1, integer=True)
        self.config = ShardedConfig(**{f.name: settings[f.name] for f in dataclasses.fields(ShardedConfig)})
        named = named_parameters_of(optimizer, named_parameters)
        self._face_init("ShardedOptimizer", process_group, named, warn_single=False, dtypes=_DTYPES)
        self._trainable = _trainable_of(named)
        self._param_dtype = self._trainable[0][1].dtype
        self._master_dtype = torch.float64 if self._param_dtype == torch.float64 else torch.float32
        device = self._trainable[0][1].device
        topo, layout = _resolve_topology(self.process_group, intra_group, inter_group, local_size)
        self.process_group = topo.group
        self.plan = plan_shards([(n, tuple(p.shape), p.numel()) for n, p in self._trainable], topo.world, topo.rank,
                                self.config.fusion_threshold_bytes, self.config.gradient_alltoall_pipeline,
                                torch.empty((), dtype=self._master_dtype).element_size())
        self._ddp = self._ddp_wrapped([p for _, p in self._trainable])
        self._static = self._describe(optimizer, topo, layout)
        self._life = StepLifecycle(self, "ShardedOptimizer", topo.group, backward_passes_per_step)
        self._life.agree()                      # every rank, before any other collective
        if layout != "consistent":
            raise RuntimeError(layout)
        self._refuse_ddp(self._ddp)
        if topo.intra is None and topo.world > 1 and self.config.quantized_gradients:
            intra, inter = node_groups(topo.group, topo.local_size)
            topo = Topology(topo.group, intra, inter, topo.world, topo.rank, topo.local_size)
        self.topo = topo
        self._params = [p for _, p in self._trainable]
        self._broadcast_parameters()
        self._build_master(device)
        self.optimizer = optimizer
        self._take_over(optimizer)
        self._build_buckets(topo, device)
        self._reducer = GradientReducer(self.config, topo)
        self._stats: Dict[str, Any] = {}
        self._bytes = ByteLedger()
        self._norms: Optional[torch.Tensor] = None   # this step's global gradient norm summary (clip_grad_norm_)
        self._uid = zlib.crc32(repr(self._static).encode()) & 0x3FFFFFFF
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._life.attach(self._params, solo=True)

    # -- construction helpers ---------------------------------------------------------------
    def _build_master(self, device) -> None:
        """This rank's master shard, its gradient, and the pieces (views) the optimizer works on."""
        self._master = torch.zeros(self.plan.master_numel, dtype=self._master_dtype, device=device)
        self._master_grad = torch.zeros_like(self._master)
        self._pieces: List[torch.Tensor] = []
        with torch.no_grad():
            for piece in self.plan.pieces:
                view = self._master[piece.master_offset:piece.master_offset + piece.numel]
                view.copy_(self._params[piece.index].detach().reshape(-1)[piece.start:piece.stop])
                view.grad = self._master_grad[piece.master_offset:piece.master_offset + piece.numel]
                self._pieces.append(view)

    def _build_buckets(self, topo, device) -> None:
        """The flat gradient buckets of the plan, and where each parameter sits in them."""
        self._buckets = [torch.zeros(topo.world * b.shard_numel, dtype=self._master_dtype, device=device)
                         for b in self.plan.buckets]
        self._where: Dict[int, tuple] = {id(self._params[s.index]): (bi, s)
                                         for bi, b in enumerate(self.plan.buckets) for s in b.slots}
        self._reset_buckets()

    def _describe(self, optimizer, topo, layout) -> dict:
        groups = [{k: repr(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {"ranks per node": topo.local_size,
                "node layout": "consistent" if layout == "consistent" else "inconsistent (see the rank's error)",
                "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in self._trainable],
                "buckets": self.plan.describe(), "settings": self.config.describe(),
                "wrapped optimizer": type(optimizer).__name__, "param_groups": groups,
                "wrapped in DistributedDataParallel": self._ddp is not None}

    def _description(self) -> dict:
        return self._static

    def _broadcast_parameters(self) -> None:
        """Replicas start identical (like DDP): rank 0's parameters, through the one Comm."""
        if self.topo.world > 1:
            comm = Comm(self.topo.group)
            with torch.no_grad():
                wait([comm.broadcast(p.data, 0) for p in self._params])

    def _take_over(self, optimizer) -> None:
        """Re-point ``optimizer`` at this rank's pieces, slicing any state it already has."""
        owned = defaultdict(list)      # id(parameter) -> its (piece, master view) pairs; frozen: none
        for piece, tensor in zip(self.plan.pieces, self._pieces):
            owned[id(self._params[piece.index])].append((piece, tensor))
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for group in optimizer.param_groups:
            for p in group["params"]:
                for piece, tensor in owned[id(p)]:
                    st = {key: piece_state(piece.name, key, v, p.numel())
                          for key, v in optimizer.state.get(p, {}).items()}
                    if st:
                        entry = {"master": p.detach(), "state": {key: v for key, (_, v) in st.items()},
                                 "element_keys": [key for key, (kind, _) in st.items() if kind == "elements"]}
                        new_state[tensor] = split_state(entry, piece.start, piece.stop)
            group["params"] = [tensor for p in group["params"] for _, tensor in owned[id(p)]]
        optimizer.state = new_state

    # -- delegation so schedulers see a normal optimizer --------------------------------------
    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def add_param_group(self, param_group):
        raise RuntimeError("ShardedOptimizer plans its shards once; add every parameter group to the "
                           "optimizer before wrapping it")

    def __repr__(self):
        return f"ShardedOptimizer({type(self.optimizer).__name__}, {self.config})"

    # -- the lifecycle's calls: one gradient, the end of a step -------------------------------
    @property
    def _step_count(self) -> int:
        """Optimizer steps taken (seeds every quantized round; checkpointed and agreed)."""
        return self._life.steps

    def _on_gradient(self, p: torch.Tensor, last_pass: bool) -> None:
        """Move ``p.grad`` into its bucket and, on the step's last pass, launch the ready buckets."""
        bi, slot = self._where[id(p)]
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise TypeError(f"parameter {slot.name!r} has a sparse gradient; ShardedOptimizer "
                            "reduces dense gradients only (use a dense embedding)")
        if self._next_launch > bi:
            raise RuntimeError(f"parameter {slot.name!r} got a gradient after its bucket was already "
                               "reduced this step; call step() before the next backward")
        view = self._buckets[bi][slot.offset:slot.end]
        with torch.no_grad():
            if self._passes[slot.index] == 0:
                view.copy_(p.grad.reshape(-1))
            else:
                view.add_(p.grad.reshape(-1))
        p.grad = None
        self._passes[slot.index] += 1
        if last_pass:
            self._mark_ready(bi, slot.index)
            self._launch_ready()
        self._reducer.poll()

    def _mark_ready(self, bi: int, index: int) -> None:
        if not self._ready[index]:
            self._ready[index] = True
            self._pending[bi] -= 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            self._life.begin(notify=True)
            b = self.plan.buckets[self._next_launch]
            out = self._master_grad[b.master_offset:b.master_offset + b.shard_numel]
            self._reducer.launch(self._next_launch, self._buckets[self._next_launch], out, self._step_count)
            self._next_launch += 1

    def _finish(self) -> None:
        """Complete the reduce-scatter into the master gradient; missing gradients count as zeros."""
        self._life.check_open()
        self._life.check_requires_grad()
        try:
            for bi in range(self._next_launch, len(self._buckets)):
                for s in self.plan.buckets[bi].slots:
                    if self._passes[s.index] == 0:
                        self._buckets[bi][s.offset:s.end].zero_()
                    self._mark_ready(bi, s.index)
            self._launch_ready()
            sent = self._reducer.wait_all()
            for piece, tensor in zip(self.plan.pieces, self._pieces):
                tensor.grad = self._master_grad[piece.master_offset:piece.master_offset + piece.numel]
            self._norms = norm_summary([cast(torch.Tensor, t.grad) for t in self._pieces], self._master.device, self.topo)
            self._life.end()
        except BaseException:
            self._reducer.abort()
            raise
        finally:
            self._reset_buckets()
        dense = sum(gradient_wire_bytes(ShardedConfig(), self.topo, b.shard_numel) for b in self.plan.buckets)
        self._stats = {"gradient_bytes": sent, "dense_gradient_bytes": dense}
        self._bytes.add(sent, dense)
        self._life.completed = True

    def _reset_buckets(self) -> None:
        self._next_launch = 0
        self._passes = [0] * len(self._params)
        self._ready = [False] * len(self._params)
        self._pending = [len(b.slots) for b in self.plan.buckets]
        self._life.reset_collectives()

    def shadow_step(self) -> None:
        """Join the others' step with zero gradients (join()): their all-gather needs this shard."""
        for bucket in self._buckets:
            bucket.zero_()
        self._life.begin(notify=False)     # join's all-reduce took the place of the notice
        self._finish()
        self._apply_step()

    def _after_join(self, root_rank: int, group) -> None:
        """Nothing to resynchronize: every step's all-gather left the replicas identical."""

    # -- the public step API -----------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish this step's reduce-scatter now; a no-op when backward already did it.

        Example::

            loss.backward()
            opt.synchronize()                      # no-op: already reduced
            print(opt.clip_grad_norm_(1.0))
        """
        if not self._life.completed:
            self._finish()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Not available: ``p.grad`` is ``None`` after backward; use :meth:`clip_grad_norm_`."""
        raise RuntimeError("ShardedOptimizer keeps the reduced gradient sharded and p.grad is None "
                           "after backward, so torch.nn.utils.clip_grad_norm_(model.parameters()) "
                           "would see nothing; call opt.clip_grad_norm_(max_norm) and then opt.step()")
        yield  # pragma: no cover

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the reduced gradient by its global norm over all shards (torch's
        ``clip_grad_norm_`` on the unsharded model, any ``norm_type``); returns the norm,
        identical on every rank.

        Example::

            loss.backward()
            total = opt.clip_grad_norm_(1.0)
            opt.step()
        """
        self.synchronize()
        grads = [cast(torch.Tensor, t.grad) for t in self._pieces]   # set by every _finish
        total = global_norm(grads, float(norm_type), self._norms, self._master.device, self.topo,
                            [piece.index for piece in self.plan.pieces], len(self._params))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        coef = clip_coefficient(max_norm, total)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.to(torch.float32)

    # GradScaler then hands over its scale and inf flag: step() uses that to refuse AMP loudly.
    _step_supports_amp_scaling = True

    def _refuse_grad_scaler(self) -> None:
        """Refuse GradScaler (its inf check would see only this rank's shard), leaving the
        optimizer usable: the step's reduction completes on every rank and GradScaler's
        attributes are removed (it deletes them only after a step that returns)."""
        if "grad_scale" not in self.__dict__ and "found_inf" not in self.__dict__:
            return
        self.__dict__.pop("grad_scale", None)
        self.__dict__.pop("found_inf", None)
        self.synchronize()
        self._reset_step()
        raise RuntimeError(
            "ShardedOptimizer does not support torch.amp.GradScaler: its unscale and inf check "
            "would see only this rank's shard (ranks could skip differently). Train with bf16 "
            "autocast without a scaler, or use bitscom.DistributedOptimizer with GradScaler")

    def step(self, closure=None):
        """Synchronize (if not done), update this rank's shard, all-gather the parameters."""
        self._refuse_grad_scaler()
        if closure is not None:
            raise ValueError("ShardedOptimizer.step() takes no closure: the closure's backward "
                             "would be reduced by the hooks; call backward yourself, then step()")
        self._life.check_open()
        if self._life.completed:
            self._life.check_requires_grad()
        self.synchronize()
        return self._apply_step()

    def _apply_step(self):
        try:
            result = self.optimizer.step()
            sent = gather_parameters(self.config, self.topo, self.plan, self._master, self._params, self._step_count)
        finally:
            self._reset_step()
        self._stats["weight_bytes"] = sent
        self._stats["dense_weight_bytes"] = sum(
            weight_wire_bytes(ShardedConfig(), self.topo, b.shard_numel, self._param_dtype)
            for b in self.plan.buckets)
        self._bytes.add(sent, self._stats["dense_weight_bytes"])
        self._bytes.end_step()
        self._life.stepped()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients, a reduction completed by backward included."""
        self._reset_step()
        for p in self._params:
            p.grad = None

    def close(self) -> None:
        """Remove the gradient hooks; later steps raise."""
        self._reducer.abort()
        self._life.close()
        self._face_close()

    # -- statistics ------------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Bytes sent against exact sharded DP (:func:`bitscom.face.report`), gradients and weights apart."""
        return self._bytes.report(**self._stats)

    def memory_stats(self) -> dict:
        """Bytes this rank holds for optimizer state, the master shard and its gradient."""
        state = sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor))
        nbytes = self._master.numel() * self._master.element_size()
        return {"optimizer_state_bytes": state, "master_bytes": nbytes, "master_grad_bytes": nbytes,
                "bucket_bytes": sum(b.numel() * b.element_size() for b in self._buckets)}

    @property
    def shard_pieces(self):
        """(name, start, stop, master view) of every piece this rank owns (read-only use)."""
        return [(p.name, p.start, p.stop, t) for p, t in zip(self.plan.pieces, self._pieces)]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard; loads only into the same world and plan (see consolidated_state_dict)."""
        # A copy, not references to the live state (torch's default): loading it into another
        # optimizer in the same process must not make the two share moment buffers.
        return {"optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "sharded": {**self._envelope(self._step_count), "step": self._step_count,
                            "plan": self.plan.describe(), "master": self._master.clone()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict` of the same rank and world size, or a consolidated one."""
        if state_dict.get("format") == FORMAT:
            self.load_consolidated_state_dict(state_dict)
            return
        if "sharded" not in state_dict:
            raise ValueError("not a ShardedOptimizer state dict (no 'sharded' entry); load a plain "
                             "optimizer's state before wrapping it")
        sh = state_dict["sharded"]
        if sh["world"] == self.topo.world and sh["plan"] == self.plan.describe() and \
                not self._check_envelope(sh, per_rank_state=True):   # another rank's shard: every
            self._life.loaded(None)                                  # rank raises at the next step
            return
        if sh["world"] != self.topo.world or sh["rank"] != self.topo.rank or sh["plan"] != self.plan.describe():
            raise ValueError(f"this shard checkpoint was written by rank {sh['rank']} of {sh['world']} "
                             f"with another plan; this is rank {self.topo.rank} of {self.topo.world}. "
                             "Use consolidated_state_dict() to change the world size")
        with torch.no_grad():
            self._master.copy_(sh["master"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._life.loaded(int(sh["step"]))   # the ranks compare their steps before the next one

    def consolidated_state_dict(self, to_rank: int = 0) -> Optional[dict]:
        """Gather a world-size-independent checkpoint on rank ``to_rank`` (``None`` elsewhere);
        every rank must call it.

        Example::

            ckpt = opt.consolidated_state_dict()
            if bitscom.rank() == 0:
                torch.save(ckpt, "opt.pt")
        """
        number("to_rank", to_rank, minimum=0, maximum=self.topo.world - 1, integer=True)
        gathered = gather_objects(self._my_pieces(), self.topo.group, to_rank)
        if gathered is None:          # not the destination rank
            return None
        shapes = {n: tuple(p.shape) for n, p in self._trainable}
        params = join_pieces(gathered, shapes, {n: p.dtype for n, p in self._trainable})
        name_of = {id(t): piece.name for piece, t in zip(self.plan.pieces, self._pieces)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": sorted({name_of[id(t)] for t in g["params"]})} for g in self.optimizer.param_groups]
        return {"format": FORMAT, "step": self._step_count, "settings": self.config.describe(),
                "optimizer": type(self.optimizer).__name__, "params": params, "param_groups": groups}

    def _my_pieces(self) -> Dict[str, list]:
        """Per parameter, each owned piece's (start, stop, master, replica, state), on the CPU."""
        mine: Dict[str, list] = defaultdict(list)
        for piece, tensor in zip(self.plan.pieces, self._pieces):
            p = self._params[piece.index]
            st = {k: piece_state(piece.name, k, v, piece.numel)
                  for k, v in self.optimizer.state.get(tensor, {}).items()}
            mine[piece.name].append((piece.start, piece.stop, tensor.detach().cpu().clone(),
                                     p.detach().reshape(-1)[piece.start:piece.stop].cpu().clone(),
                                     {k: (kind, v.cpu() if isinstance(v, torch.Tensor) else v)
                                      for k, (kind, v) in st.items()}))
        return dict(mine)

    def _check_checkpoint(self, shapes: dict, n_groups: int) -> None:
        """A checkpoint (consolidated or DCP) holds this model's parameters and param group count."""
        names = [n for n, _ in self._trainable]
        if sorted(shapes) != sorted(names):
            missing = sorted(set(names) - set(shapes))[:5]
            extra = sorted(set(shapes) - set(names))[:5]
            raise ValueError(f"checkpoint parameters differ from this model's: missing {missing}, "
                             f"unexpected {extra}")
        for n, p in self._trainable:
            if tuple(shapes[n]) != tuple(p.shape):
                raise ValueError(f"parameter {n!r}: checkpoint shape {tuple(shapes[n])}, "
                                 f"model shape {tuple(p.shape)}")
        if n_groups != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {n_groups} param groups, the "
                             f"optimizer {len(self.optimizer.param_groups)}")

    def load_consolidated_state_dict(self, state_dict: dict, load_replicas: bool = True) -> None:
        """Load a :meth:`consolidated_state_dict` of any world size (and the replicas)."""
        if state_dict.get("format") != FORMAT:
            raise ValueError(f"not a consolidated ShardedOptimizer checkpoint (format "
                             f"{state_dict.get('format')!r}, expected {FORMAT!r})")
        params = state_dict["params"]
        self._check_checkpoint({n: e["master"].shape for n, e in params.items()}, len(state_dict["param_groups"]))
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        with torch.no_grad():
            for piece, tensor in zip(self.plan.pieces, self._pieces):
                entry = params[piece.name]
                tensor.copy_(entry["master"].reshape(-1)[piece.start:piece.stop])
                st = split_state(entry, piece.start, piece.stop)
                if st:
                    new_state[tensor] = {k: (v.to(tensor.device) if isinstance(v, torch.Tensor) else v)
                                         for k, v in st.items()}
            if load_replicas:
                for n, p in self._trainable:
                    p.copy_(params[n]["replica"].to(p.device))
        for g, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.state = new_state
        self._life.loaded(int(state_dict["step"]))

    @classmethod
    def from_args(cls, optimizer, args, named_parameters=None, process_group=None, **kwargs):
        """Build from the SDP4Bit Megatron flags parsed by :func:`bitscom.sharded.add_arguments`.

        Example::

            parser = argparse.ArgumentParser(); bitscom.sharded.add_arguments(parser)
            opt = bitscom.ShardedOptimizer.from_args(opt, parser.parse_args(), model.named_parameters())
        """
        from .args import settings_from_args
        return cls(optimizer, named_parameters, process_group, **settings_from_args(args), **kwargs)

    def save_dcp(self, path, *, extra=None) -> None:
        """Save through ``torch.distributed.checkpoint``; see :func:`bitscom.checkpointing.save`."""
        save_sharded(self, path, extra)

    def load_dcp(self, path, *, extra=None, load_replicas: bool = True) -> None:
        """Load a :meth:`save_dcp` checkpoint of any world size (:func:`bitscom.checkpointing.load`)."""
        load_sharded(self, path, extra, load_replicas)
