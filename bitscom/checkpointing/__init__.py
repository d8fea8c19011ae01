"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank saves in one call, in parallel, and a run of
another world size can load where the state allows it (what loads where, and the key layout: docs/checkpoints.md).
"""

from __future__ import annotations

import inspect

__all__ = ["save", "load"]

# Options of one face only, and why the other refuses them.
_ONLY_FOR = {
    "reset_compressor_state": "reset_compressor_state applies to DistributedOptimizer; a "
                              "ShardedOptimizer has no compressor state to reset",
    "load_replicas": "load_replicas applies to ShardedOptimizer; a DistributedOptimizer "
                     "checkpoint holds no parameters (save them in extra)",
}


def _face(opt, what: str):
    """``opt`` if it writes its own DCP payload (``save_dcp`` / ``load_dcp``). Asked of the face,
    never by isinstance on face classes: checkpointing sits below the faces and imports none."""
    if not (callable(getattr(opt, "save_dcp", None)) and callable(getattr(opt, "load_dcp", None))):
        raise TypeError(f"{what}() takes a bitscom.DistributedOptimizer or bitscom.ShardedOptimizer, "
                        f"got {type(opt).__name__}")
    return opt


def save(opt, path, *, extra=None) -> None:
    """Save ``opt`` (and ``extra``, e.g. ``{"model": model.state_dict()}``) to the DCP checkpoint
    directory ``path``, which every rank of the optimizer's group calls with, on shared storage.

    Example::

        bitscom.checkpointing.save(opt, "ckpt/step100", extra={"model": model.state_dict()})
        bitscom.checkpointing.load(opt, "ckpt/step100", extra={"model": model.state_dict()})   # in place
    """
    _face(opt, "save").save_dcp(path, extra=extra)


def load(opt, path, *, extra=None, reset_compressor_state: bool = False,
         load_replicas: bool = True) -> None:
    """Load a :func:`save` checkpoint into ``opt`` (and ``extra``, the same keys, in place); every rank calls it.
    ``reset_compressor_state`` (DistributedOptimizer): start the compressor state from zero, needed to load per-rank
    error-feedback state on another world size. ``load_replicas`` (ShardedOptimizer): also set the model's parameters
    (example: :func:`save`'s)."""
    face = _face(opt, "load")
    options: dict = {"reset_compressor_state": reset_compressor_state} if reset_compressor_state else {}
    if load_replicas is not True:
        options["load_replicas"] = load_replicas
    accepted = inspect.signature(face.load_dcp).parameters
    for name in options:
        if name not in accepted:
            raise ValueError(_ONLY_FOR[name])
    face.load_dcp(path, extra=extra, **options)
