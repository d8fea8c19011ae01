"""bitscom's FSDP state in torch's own checkpoint flow (what torchtitan and Accelerate call).

``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` carry the model
and the optimizer; ``dcp.save`` / ``dcp.load`` write and read them. bitscom's per-rank state
(error-feedback residuals and step counters of every reduce-scatter and replicate all-reduce)
goes into the same ``dcp.save`` call as one more entry, a ``Stateful``
(:class:`FSDPCheckpointState`):

* ``layout``: the world, the replicate/shard sizes, the sharded modules and the settings, the
  same on every rank (DCP stores it once);
* ``rank<r>``: rank ``r``'s :meth:`~bitscom.fsdp.FSDPCompression.state_dict`, pickled (written by
  rank ``r`` only; another rank never reads it).

Loading on the same mesh restores every rank's own state: the run goes on bit for bit. The
handle's checkpoint envelope refuses another rank's state and a step that differs between
ranks (the same error on every rank at the next reduction). On another mesh the per-rank
residuals do not reshard (they belong to one rank's shard of one replica): the load raises a
ValueError naming ``reset_compressor_state=True``, which restarts bitscom's state from zero and
loads the model and optimizer (which DCP does reshard). A run with more ranks than the saving
one fails inside ``dcp.load`` already, on every rank ("Missing key in checkpoint state_dict:
bitscom.rank<r>" when the entry is called "bitscom"): the same option
is the remedy.

Trust: loading unpickles the per-rank entries, as DCP does for any non-tensor value; load
checkpoints you wrote.

Example::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd,
              "bitscom": bitscom.fsdp.checkpoint_state(model)}, checkpoint_id=path)
    # resume
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "bitscom": bitscom.fsdp.checkpoint_state(model)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
"""

from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist

from ..checkpointing.common import blob, unblob
from .compress import FSDPCompression, handle

__all__ = ["FSDPCheckpointState", "checkpoint_state"]


class FSDPCheckpointState:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` holding one handle's per-rank state.

    Args:
        compression: the :class:`~bitscom.fsdp.FSDPCompression` (or the compressed model).
        reset_compressor_state: load nothing of bitscom's state (start residuals and steps from
            zero): the way to resume on another mesh.

    Example::

        dcp.save({"model": model_sd, "bitscom": FSDPCheckpointState(handle)}, checkpoint_id=path)
    """

    def __init__(self, compression: FSDPCompression, reset_compressor_state: bool = False):
        if not isinstance(compression, FSDPCompression):
            raise TypeError(f"expected a bitscom.fsdp handle (or a compressed model), got "
                            f"{type(compression).__name__}")
        self.compression = compression
        self.reset_compressor_state = bool(reset_compressor_state)

    def _layout(self) -> str:
        return self.compression.checkpoint_layout()

    def _key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> Dict[str, Any]:
        """``layout`` and this rank's pickled state (just ``layout`` with ``reset_compressor_state``)."""
        out: Dict[str, Any] = {"layout": self._layout()}
        if not self.reset_compressor_state:
            out[self._key()] = blob(self.compression.state_dict())
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore this rank's own state; another mesh is a ValueError naming the option."""
        if self.reset_compressor_state:
            return
        saved, here = state.get("layout"), self._layout()
        if saved != here:
            raise ValueError(
                f"this bitscom.fsdp checkpoint was saved with layout '{saved}', this run has '{here}': "
                "the per-rank error-feedback residuals and step counters belong to the saving mesh and "
                "do not reshard. Pass reset_compressor_state=True to bitscom.fsdp.checkpoint_state() "
                "to load the model and optimizer and restart bitscom's state from zero")
        data = state.get(self._key())
        if data is None:
            raise ValueError(f"this bitscom.fsdp checkpoint has no entry {self._key()!r} (saved with "
                             "reset_compressor_state=True?); pass reset_compressor_state=True to load without it")
        self.compression.load_state_dict(unblob(data.getvalue() if hasattr(data, "getvalue") else data))


def checkpoint_state(model_or_handle, *, reset_compressor_state: bool = False) -> FSDPCheckpointState:
    """The entry to put beside ``"model"`` and ``"optim"`` in the dict given to ``dcp.save`` /
    ``dcp.load`` (see the module docstring).

    Example::

        dcp.save({"model": model_sd, "optim": optim_sd,
                  "bitscom": bitscom.fsdp.checkpoint_state(model)}, checkpoint_id=path)
    """
    h = model_or_handle if isinstance(model_or_handle, FSDPCompression) else handle(model_or_handle)
    if not isinstance(reset_compressor_state, bool):
        raise TypeError(f"reset_compressor_state must be True or False, got {reset_compressor_state!r}")
    return FSDPCheckpointState(h, reset_compressor_state)

