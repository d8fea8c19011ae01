"""Face: what every face of bitscom is, written once.

A *face* is what a user holds (an optimizer, the DDP hook's state, ...). The policy around
its plan and step is the same for every face, and every defect found in testing sat in a face
with its own copy of a piece of it; so it lives here (docs/design.md, "The Face"). Example::

    class MyFace(Face):
        def __init__(self, named, process_group=None):
            self._face_init("MyFace", process_group, named)
            self._face_agree({"parameters": describe_parameters(named)})

        def step(self):
            self._check_live()
            ...
"""

from __future__ import annotations

import gc
import io
import re
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import runtime
from .agreement import PROBLEM, check_agreement
from .comm import resolve_group

__all__ = ["Face", "require_group", "check_trainable", "ddp_owner", "live_objects", "describe_parameters",
           "raise_problem", "load_all_or_nothing", "own_entry", "rank_key", "pack_entry", "unpack_entry", "release_all",
           "dense_bytes", "report", "ByteLedger", "group_alive", "renamed", "has_tensor"]

_live: "weakref.WeakSet" = weakref.WeakSet()


def release_all() -> None:
    """Drop every live face's process groups: the world is gone (runtime calls it)."""
    for face in list(_live):
        face.process_group = None
        face._release_groups()


runtime.on_world_gone(release_all)


def describe_parameters(named: Sequence[Tuple[str, torch.Tensor]]) -> list:
    """(name, shape, dtype) of each parameter: what every rank must agree on."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in named]


def dense_bytes(numel: int) -> int:
    """What ``numel`` fp32 gradient elements cost uncompressed: every ``compression_ratio``'s baseline."""
    return int(numel) * 4


def report(step_sent: int, step_dense: int, total_sent: int, total_dense: int, **extra) -> dict:
    """The byte report of every face's ``comm_stats()``: the whole run and the last step."""
    stats = dict(extra, bytes_sent=int(total_sent), dense_bytes=int(total_dense),
                 step_bytes_sent=int(step_sent), step_dense_bytes=int(step_dense),
                 total_bytes_sent=int(total_sent), total_dense_bytes=int(total_dense))
    stats["compression_ratio"] = total_dense / total_sent if total_sent else float("nan")
    return stats


class ByteLedger:
    """What a face sent: the open step, the last finished step and the whole run."""

    def __init__(self) -> None:
        self.total_sent = self.total_dense = 0
        self.step_sent = self.step_dense = 0
        self._open_sent = self._open_dense = 0

    def add(self, sent: int, dense: int) -> None:
        self._open_sent += int(sent)
        self._open_dense += int(dense)
        self.total_sent += int(sent)
        self.total_dense += int(dense)

    def end_step(self) -> None:
        self.step_sent, self.step_dense = self._open_sent, self._open_dense
        self._open_sent = self._open_dense = 0

    def report(self, **extra) -> dict:
        return report(self.step_sent, self.step_dense, self.total_sent, self.total_dense, **extra)


def load_all_or_nothing(save: Callable[[], Any], load: Callable[[], None],
                        restore: Callable[[Any], None]) -> None:
    """Run ``load()``; if it raises, put back what ``save()`` captured before and re-raise."""
    backup = save()
    try:
        load()
    except BaseException:
        restore(backup)
        raise


def require_group(process_group, face: str, *, warn_single: bool = False):
    """The group ``face`` uses (or None for one process); a clear error instead of a silent local run."""
    if process_group is not None and not group_alive(process_group):
        raise RuntimeError(
            f"{face} was given a process_group of a world that has since been shut down "
            "(bitscom.shutdown() or dist.destroy_process_group()); its connections are gone. Make "
            "the group again after bitscom.init()")
    group = resolve_group(process_group)
    if group is None:
        info = runtime.discover()
        if info.size > 1:
            raise RuntimeError(
                f"{face} was used before bitscom.init() (or after bitscom.shutdown()): the launcher "
                f"({info.launcher}) started "
                f"{info.size} processes but torch.distributed is not initialized, so it would run "
                "each rank on its own and the replicas would diverge. Call bitscom.init() (or "
                "torch.distributed.init_process_group) first.")
        if warn_single and not runtime.is_initialized():
            warnings.warn(f"bitscom.{face}: neither bitscom.init() nor torch.distributed was "
                          "initialized, so it runs as a plain single-process optimizer; call "
                          "bitscom.init() first (a no-op for one process) to silence this warning",
                          stacklevel=3)
        return None
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of "
                         f"process_group (ranks {dist.get_process_group_ranks(group)}); build "
                         f"{face} on member ranks only")
    return group


def renamed(value, old_value, *, new: str, old: str, where: str):
    """``value``, or ``old_value`` under its deprecated name ``old`` (with a DeprecationWarning)."""
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated name)")
    warnings.warn(f"{where}({old}=...) is deprecated; pass {new}=... (the name every bitscom face "
                  "uses)", DeprecationWarning, stacklevel=3)
    return old_value


def group_alive(group) -> bool:
    """Whether ``group`` is one of torch's live process groups."""
    if not isinstance(group, dist.ProcessGroup):     # e.g. NON_GROUP_MEMBER: membership decides
        return True
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def check_trainable(named: Sequence[Tuple[str, torch.Tensor]], face: str,
                    dtypes: Optional[Sequence[torch.dtype]] = None) -> None:
    """Refuse parameters no face can reduce: meta, non-floating, complex, sparse, other dtypes."""
    for name, p in named:
        if p.is_meta:
            raise ValueError(f"parameter {name!r} is on the meta device (it has no data); "
                             "materialize the model (e.g. model.to_empty(device=...) and "
                             f"initialize it) before building {face}")
        if not p.requires_grad:
            continue
        if p.is_complex():
            raise TypeError(f"parameter {name!r} is complex ({p.dtype}); bitscom reduces real "
                            "tensors only (view it with torch.view_as_real)")
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                            "parameters can be trained")
        if p.layout != torch.strided:
            raise TypeError(f"parameter {name!r} is not dense ({p.layout}); {face} reduces dense "
                            "parameters")
        if dtypes is not None and p.dtype not in dtypes:
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; {face} allows {list(dtypes)}")


def ddp_owner(params: Sequence[torch.Tensor], objects: Optional[list] = None) -> Optional[str]:
    """The class of a DDP module that owns any of ``params`` (it would be reduced twice), or None."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ours = {id(p) for p in params}
    for obj in (live_objects(DDP) if objects is None else objects):
        if isinstance(obj, DDP) and any(id(p) in ours for p in obj.module.parameters()):
            return type(obj).__name__
    return None


def live_objects(types) -> list:
    """Every live object of ``types``: one garbage-collector scan, at construction only."""
    wanted: Dict[type, bool] = {}        # each type's answer once: the scan is one dict lookup per object
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # deprecated torch objects warn when inspected
        for obj in gc.get_objects():
            cls = type(obj)
            hit = wanted.get(cls)
            if hit is None:
                hit = wanted[cls] = issubclass(cls, types)
            if hit:
                found.append(obj)
    return found


def raise_problem(description: Dict[str, Any]) -> None:
    """After an agreement passed: raise the checkpoint problem every rank had alike."""
    if description.get(PROBLEM):
        raise RuntimeError(description[PROBLEM])


_RANK_KEY = re.compile(r"^rank(\d+)$")


def rank_key(rank: int) -> str:
    """The envelope key of rank ``rank``'s own state: ``"rank<r>"``."""
    return f"rank{int(rank)}"


def own_entry(saved: Dict[str, Any], rank: int, map_location=None) -> Dict[str, Any]:
    """``saved`` with rank ``rank``'s ``rank<r>`` entry (else the lowest rank's) over shared fields."""
    ranked = {int(m.group(1)): key for key in saved if isinstance(key, str) and (m := _RANK_KEY.match(key))}
    if not ranked:
        return saved
    entry = unpack_entry(saved[ranked.get(rank, ranked[min(ranked)])], map_location)
    return {**{k: v for k, v in saved.items() if k not in ranked.values()}, **entry}


def has_tensor(obj: Any) -> bool:
    """Whether a nested state (dicts, lists, tuples) holds a tensor: per-rank state such as residuals."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    return isinstance(obj, torch.Tensor) or (isinstance(obj, (list, tuple)) and any(has_tensor(v) for v in obj))


def pack_entry(own: Dict[str, Any]) -> bytes:
    """A rank's own state as one opaque value: DCP refuses tensors where a template has None."""
    buffer = io.BytesIO()
    torch.save(own, buffer)
    return buffer.getvalue()


def unpack_entry(entry: Any, map_location=None) -> Dict[str, Any]:
    """The inverse of :func:`pack_entry` (DCP may hand back a ``BytesIO``; a dict passes)."""
    if isinstance(entry, dict):
        return entry
    data = entry.getvalue() if isinstance(entry, io.BytesIO) else entry
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"a per-rank checkpoint entry must be the bytes state_dict() wrote, got "
                         f"{type(entry).__name__}")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


class Face:
    """The base of every face (see the module docstring)."""

    _face_name = "face"
    _face_closed = False
    _face_resumed = False     # a checkpoint was loaded: the ranks compare before the next collective
    _face_problem: Optional[str] = None

    def _face_init(self, name: str, process_group, named: Optional[Sequence[Tuple[str, torch.Tensor]]] = None,
                   *, warn_single: bool = True, dtypes=None) -> None:
        self._face_name = name
        group = require_group(process_group, name, warn_single=warn_single)
        self.process_group = group
        self._size = dist.get_world_size(group) if group is not None else 1
        self._rank = dist.get_rank(group) if group is not None else 0
        self._world = runtime.world_token() if group is not None else None
        self._face_closed = False
        self._face_problem = None
        self._face_planned: list = []
        if named is not None:
            check_trainable(named, name, dtypes)
            self._plan_requires_grad(named)
        _live.add(self)

    def _plan_requires_grad(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        self._face_planned = [(n, p, p.requires_grad) for n, p in named]   # plans are made once

    def _check_requires_grad(self) -> None:
        """A parameter frozen or unfrozen since construction is an error (plans are made once)."""
        for name, p, planned in self._face_planned:
            if p.requires_grad != planned:
                change = "unfrozen" if p.requires_grad else "frozen"
                raise RuntimeError(
                    f"parameter {name!r} was {change} (requires_grad={p.requires_grad}) after "
                    f"{self._face_name} was built; bitscom plans once, so it would be updated "
                    "wrongly. close() this optimizer and build a new one after changing "
                    "requires_grad")

    def _ddp_wrapped(self, params: Sequence[torch.Tensor], found: Optional[list] = None) -> Optional[str]:
        return ddp_owner(params, found) if self._size > 1 else None

    def _refuse_ddp(self, owner: Optional[str]) -> None:
        """Raise (after the agreement, so on every rank alike) if the model is DDP-wrapped."""
        if owner is None:
            return
        raise TypeError(
            f"the model's parameters belong to a {owner} (e.g. from Accelerate's prepare()): DDP "
            f"already all-reduces them in full precision during backward, so {self._face_name} "
            "would communicate on top of it and comm_stats() would hide DDP's traffic. Give "
            f"{self._face_name} a model that was never wrapped in DDP (with Accelerate: prepare() "
            "only the data loader, see docs/integrations.md), or keep DDP and compress with "
            "bitscom.ddp_comm_hook instead")

    def _face_agree(self, description: Dict[str, Any], error: Optional[BaseException] = None,
                    what: Optional[str] = None) -> None:
        """Compare ``description`` across ranks; then raise ``error`` (on every rank alike)."""
        desc: Dict[str, Any] = {"settings error": None if error is None else f"{type(error).__name__}: {error}"}
        if error is None:
            desc.update({"face": self._face_name, "world size": self._size, **description})
        if self._size > 1:
            check_agreement(desc, self.process_group, what=what or f"{self._face_name} plan")
        if error is not None:
            raise error

    def _check_live(self) -> None:
        if self._face_closed:
            raise RuntimeError(f"this {self._face_name} was closed; build a new one")
        if self._size > 1 and runtime.world_token() != self._world:   # gone, or a new world
            raise RuntimeError(
                f"this {self._face_name} was built in a process group that has since been shut down "
                "(bitscom.shutdown() or dist.destroy_process_group()"
                + (", and bitscom.init() started a new one" if dist.is_initialized() else "")
                + f"); its groups are gone. Build a new {self._face_name} (and its model replicas) "
                "after bitscom.init()")

    def _release_groups(self) -> None:
        """Faces drop whatever else holds groups (their reducers, lifecycles); overridden."""

    def _envelope(self, steps: int, own: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Who saved a checkpoint and when, with this rank's state under :func:`rank_key` (DCP dedups)."""
        envelope: Dict[str, Any] = {"face": self._face_name, "rank": self._rank, "world": self._size,
                                    "steps": int(steps)}
        if own is not None:
            envelope[rank_key(self._rank)] = pack_entry(dict(own, rank=self._rank))
        return envelope

    def _own_entry(self, saved: Dict[str, Any]) -> Dict[str, Any]:
        return own_entry(saved, self._rank)

    def _check_envelope(self, saved: Dict[str, Any], per_rank_state: bool) -> bool:
        """Whether ``saved`` may be loaded (another rank's state: a problem for every rank, False)."""
        world = saved.get("world", saved.get("world size"))
        if world is not None and world != self._size:
            raise ValueError(f"this checkpoint was saved by a {self._face_name} over {world} ranks; "
                             f"this one has {self._size}")
        rank = saved.get("rank")
        if rank is None or rank == self._rank or not per_rank_state:
            return True
        dcp = ("bitscom.checkpointing.save(opt, path) / bitscom.checkpointing.load(opt, path) "
               "(DCP with per-rank keys), or " if callable(getattr(self, "save_dcp", None)) else "")
        problem = (f"rank {self._rank} was given the checkpoint of rank {rank} of {world} (per-rank "
                   "state such as error-feedback memory), so resuming would not reproduce the run. "
                   "One rank's state was saved for every rank: torch.save on the main process only, "
                   "or torch.distributed.checkpoint.save of a state dict whose per-rank state "
                   "shares its keys across ranks (DCP keeps one copy of such a key). Use "
                   f"{dcp}save opt.state_dict() on every rank (e.g. f'opt.{{bitscom.rank()}}.pt') and "
                   "load each rank's own file, or drop the compressor state to restart it from zero")
        if self._size == 1:
            raise ValueError(problem)
        self._face_problem = problem
        return False

    def _deferred_problem(self) -> Dict[str, Any]:
        problem, self._face_problem = self._face_problem, None
        return {PROBLEM: problem}

    def _mark_loaded(self) -> None:
        self._face_resumed = True

    def _agree_if_resumed(self, describe: Callable[[], Dict[str, Any]], what: str) -> None:
        """After a load: the ranks compare what they resumed and any deferred problem."""
        if not self._face_resumed:
            return
        self._face_resumed = False
        desc = dict(describe(), **self._deferred_problem())
        if self._size > 1:
            check_agreement(desc, self.process_group, what=what)
        raise_problem(desc)

    def _face_close(self) -> None:
        self._face_closed = True
        _live.discard(self)
