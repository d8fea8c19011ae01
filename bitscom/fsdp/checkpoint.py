"""bitscom's FSDP state in torch's own checkpoint flow (``dcp.save`` / ``dcp.load``): one more
``Stateful`` entry beside the model and optimizer (docs/fsdp.md, Checkpoints). Loading unpickles
the per-rank entries, as DCP does for any non-tensor value: load checkpoints you wrote.
"""

from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist

from ..checkpointing.common import blob, unblob
from ..validate import flag, instance
from .compress import FSDPCompression, handle

__all__ = ["FSDPCheckpointState", "checkpoint_state"]


class FSDPCheckpointState:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` holding one handle's per-rank state.

    ``reset_compressor_state=True`` loads nothing of bitscom's state (residuals and steps
    start from zero): the way to resume on another mesh.

    Example::

        dcp.save({"model": model_sd, "bitscom": FSDPCheckpointState(handle)}, checkpoint_id=path)
    """

    def __init__(self, compression: FSDPCompression, reset_compressor_state: bool = False):
        instance("compression", compression, FSDPCompression, "a bitscom.fsdp handle (or a compressed model)")
        self.compression = compression
        self.reset_compressor_state = bool(reset_compressor_state)

    def _key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> Dict[str, Any]:
        """``layout`` and this rank's pickled state (just ``layout`` with ``reset_compressor_state``)."""
        out: Dict[str, Any] = {"layout": self.compression.checkpoint_layout()}
        if not self.reset_compressor_state:
            out[self._key()] = blob(self.compression.state_dict())
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore this rank's own state; another mesh is a ValueError naming the option."""
        if self.reset_compressor_state:
            return
        saved, here = state.get("layout"), self.compression.checkpoint_layout()
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
    ``dcp.load``.

    Example::

        dcp.save({"model": model_sd, "optim": optim_sd,
                  "bitscom": bitscom.fsdp.checkpoint_state(model)}, checkpoint_id=path)
    """
    h = model_or_handle if isinstance(model_or_handle, FSDPCompression) else handle(model_or_handle)
    return FSDPCheckpointState(h, flag("reset_compressor_state", reset_compressor_state))

