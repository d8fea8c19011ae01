"""A DDP communication hook that reduces each DDP bucket through any bitscom compressor, with
the optimizer's :class:`~bitscom.engine.Reducer` so later rounds keep one order on the group's
channel; the last bucket's hook finishes them all (docs/api.md, "DDP comm hook")."""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import runtime
from .compressors import Compressor, resolve as resolve_compressor
from .compressors.base import BucketLayout, TensorSlot
from .engine import Reducer
from .face import ByteLedger, Face, dense_bytes, load_all_or_nothing
from .lowbit.config import canonical_fingerprint
from .params import checked_pairs

__all__ = ["ddp_comm_hook", "DDPCommState"]


def _layout(bucket, index: int, names: Optional[Dict[int, str]] = None) -> BucketLayout:
    """The bucket's layout from its gradients' shapes (matrix compressors see matrices)."""
    flat = bucket.buffer()
    params = bucket.parameters() if names is not None else []
    slots, offset = [], 0
    for j, grad in enumerate(bucket.gradients()):
        name = f"ddp.bucket{index}.{j}" if names is None else names.get(id(params[j]))
        if name is None:
            raise RuntimeError(f"DDP bucket {index} holds a parameter of shape "
                               f"{tuple(grad.shape)} that is not in the named_parameters given "
                               "to ddp_comm_hook; pass the DDP model's own named_parameters()")
        slots.append(TensorSlot(name, offset, grad.numel(), tuple(grad.shape)))
        offset += grad.numel()
    if offset != flat.numel():          # DDP packs gradients densely; fall back if that changes
        if names is not None:
            raise RuntimeError(f"DDP bucket {index} is not densely packed ({flat.numel()} elements, "
                               f"gradients {offset}); its slots cannot carry parameter names")
        slots = [TensorSlot(f"ddp.bucket{index}", 0, flat.numel(), (flat.numel(),))]
    return BucketLayout(index, tuple(slots), flat.dtype, flat.device)


class DDPCommState(Face):
    """What the hook keeps between calls (a Face); built by :func:`ddp_comm_hook`. Example::

        state, hook = bitscom.ddp_comm_hook(bitscom.compressors.get("topk", ratio=0.01))
        ddp_model.register_comm_hook(state, hook)
        ...
        torch.save({"model": ddp_model.state_dict(), "comm": state.state_dict()}, path)
        state.load_state_dict(torch.load(path)["comm"])
    """

    def __init__(self, compressor: Optional[Compressor], process_group,
                 names: Optional[Dict[int, str]] = None, error: Optional[BaseException] = None):
        self._face_init("ddp_comm_hook", process_group, warn_single=False)
        agreed: dict = {}
        if error is None and compressor is not None:
            agreed["compressor"] = compressor.fingerprint()
            if names is not None:
                agreed["parameter names"] = sorted(names.values())
        self._face_agree(agreed, error, what="DDP comm hook")
        assert compressor is not None
        self.compressor = compressor
        self._names = names                       # id(parameter) -> name, or None
        # layouts and states filled in lazily, per DDP bucket index
        channel = runtime.channel(self.process_group, later=self._size > 1)
        self._reducer = Reducer(compressor, [], channel)
        self._keys: Dict[int, tuple] = {}          # index -> (parameter ids, layout) of the bucket seen
        self._loaded: Dict[int, tuple] = {}       # index -> (shapes, state dict) awaiting a bucket
        self._pending: List[Tuple[torch.futures.Future, torch.Tensor]] = []
        self._bytes = ByteLedger()
        self._buckets = 0                         # DDP buckets of the last iteration
        self._iterations = 0

    def close(self) -> None:
        """Forget the buckets in flight; the hook fails loudly if DDP calls it afterwards."""
        self._face_close()
        self._reducer.abort()

    def _release_groups(self) -> None:
        reducer = getattr(self, "_reducer", None)      # None: construction failed before it
        if reducer is not None:
            reducer.abort()

    def _prepare(self, bucket) -> int:
        index = bucket.index()
        layout = _layout(bucket, index, self._names)
        key = (tuple(id(p) for p in bucket.parameters()), layout)
        if self._keys.get(index) != key:               # first sight, or DDP rebuilt this bucket
            state = self._reducer.set_bucket(index, layout)
            saved = self._loaded.get(index)
            if saved is not None and saved[0] == _shapes(layout):
                state.load_state_dict(saved[1])
                del self._loaded[index]
            self._keys[index] = key
        return index

    def _on_bucket(self, bucket) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        try:
            self._check_live()                          # closed, or its world gone
            if not self._pending:                        # first bucket of an iteration
                self._agree_if_resumed(lambda: {"iterations": self._iterations}, "DDP comm hook checkpoint")
            index = self._prepare(bucket)
            flat = bucket.buffer()
            if index == 0 and self._pending:
                raise RuntimeError("bitscom DDP hook: bucket 0 arrived while the previous "
                                   "iteration's buckets were unfinished; the hook state is shared "
                                   "by two models or an iteration was interrupted")
            self._pending.append((future, flat))
            self._reducer.launch(index, flat)
            self._reducer.poll()
            if bucket.is_last():
                self._finish()
        except BaseException as err:
            self._fail(err)
            raise
        return future

    def _finish(self) -> None:
        sent = self._reducer.wait_all()
        pending, self._pending = self._pending, []
        self._bytes.add(sent, sum(dense_bytes(flat.numel()) for _, flat in pending))
        self._bytes.end_step()
        self._buckets = len(pending)
        self._iterations += 1
        for future, flat in pending:
            future.set_result(flat)

    def _fail(self, err: BaseException) -> None:
        pending, self._pending = self._pending, []
        self._reducer.abort()
        for future, _ in pending:
            if not future.done():
                future.set_exception(RuntimeError(f"bitscom DDP hook failed: {err}"))

    bucket_states = property(lambda self: list(self._reducer.states), doc="Each DDP bucket's state (None: unseen).")

    def comm_stats(self) -> dict:
        """Bytes this rank sent (:func:`bitscom.face.report`; a step is one iteration). Example::

            state.comm_stats()["compression_ratio"]
        """
        return self._bytes.report(buckets=self._buckets)

    def state_dict(self) -> dict:
        """Per-bucket compressor state with each bucket's gradient shapes, and the settings."""
        buckets = {i: (_shapes(layout), state.state_dict())
                   for i, (layout, state) in enumerate(zip(self._reducer.layouts, self._reducer.states)) if state is not None}
        for i, saved in self._loaded.items():       # loaded but not used yet: keep it
            buckets.setdefault(i, saved)
        return {"compressor": self.compressor.fingerprint(), "buckets": buckets,
                "envelope": self._envelope(self._iterations)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; a bucket not seen yet loads when DDP hands it over."""
        if canonical_fingerprint(str(state_dict.get("compressor"))) != self.compressor.fingerprint():
            raise ValueError(f"checkpoint compressor {state_dict.get('compressor')} differs from "
                             f"{self.compressor.fingerprint()}")
        if self._pending:
            raise RuntimeError("load_state_dict() called during backward; call it between iterations")
        envelope = state_dict.get("envelope", {})
        per_rank = any(saved for _, saved in state_dict["buckets"].values())
        self._mark_loaded()                 # the ranks compare what they resumed at the next bucket
        if not self._check_envelope(envelope, per_rank_state=per_rank):
            return
        load_all_or_nothing(self._snapshot, lambda: self._load(state_dict), self._restore)
        self._iterations = int(envelope.get("steps", self._iterations))

    def _load(self, state_dict: dict) -> None:
        self._loaded = {}
        for i, (shapes, saved) in state_dict["buckets"].items():
            i = int(i)
            if i < len(self._reducer.states) and self._reducer.states[i] is not None \
                    and _shapes(self._reducer.layouts[i]) == tuple(shapes):
                self._reducer.states[i].load_state_dict(saved)
            else:
                self._loaded[i] = (tuple(shapes), saved)

    def _snapshot(self) -> tuple:
        return self.state_dict()["buckets"], dict(self._loaded)

    def _restore(self, saved: tuple) -> None:
        self._load({"buckets": saved[0]})
        self._loaded.update(saved[1])


def _shapes(layout: BucketLayout) -> tuple:
    return tuple(tuple(s.shape) for s in layout.slots)


def _hook(state, bucket):       # no annotations: DDP checks them and these would be strings
    return state._on_bucket(bucket)


def ddp_comm_hook(compression="none", process_group=None, named_parameters=None, *,
                  compressor=None) -> tuple:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``; every rank must call
    it (it agrees on the settings). ``compression``: a compressor, a registry name or a Horovod
    codec (``compressor=`` is its deprecated name); ``named_parameters`` names DDP's bucket
    slots after the parameters (which ``Exclude`` needs). Example::

        model = torch.nn.parallel.DistributedDataParallel(net)
        state, hook = bitscom.ddp_comm_hook(bitscom.compressors.get("signsgd"))
        model.register_comm_hook(state, hook)

        comp = bitscom.compressors.Exclude("topk", patterns=("*.bias", "*norm*"))
        state, hook = bitscom.ddp_comm_hook(comp, named_parameters=net.named_parameters())
    """
    if compressor is not None:
        warnings.warn("ddp_comm_hook(compressor=...) is deprecated; pass compression=... (the name "
                      "every bitscom face uses)", DeprecationWarning, stacklevel=2)
        compression = compressor
    error: Optional[BaseException] = None
    comp: Optional[Compressor] = None
    names = None
    try:                    # validated on every rank, raised on every rank by the agreement
        comp = _checked_compression(compression, named_parameters)
        if named_parameters is not None:
            names = {id(p): n for n, p in checked_pairs(named_parameters)}
    except (TypeError, ValueError) as err:
        error = err
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        raise RuntimeError("ddp_comm_hook needs torch.distributed: call bitscom.init() (or "
                           "torch.distributed.init_process_group) before building the hook")
    state = DDPCommState(comp, process_group, names, error)
    return state, _hook


def _checked_compression(compression, named_parameters) -> Compressor:
    """The compressor ``compression`` names, if a DDP hook can run it."""
    comp = resolve_compressor(compression, "compression")
    if comp.applies_momentum:
        raise ValueError(f"compression={comp.fingerprint()} applies SGD momentum before "
                         "compressing and needs an optimizer without momentum, which a DDP hook "
                         "cannot check; use bitscom.DistributedOptimizer with "
                         "torch.optim.SGD(..., momentum=0)")
    if comp.uses_names and named_parameters is None:
        raise ValueError(f"compression={comp!r} matches parameter names and DDP's buckets "
                         "carry none: pass named_parameters=model.named_parameters() to "
                         "ddp_comm_hook")
    return comp
