"""DiLoCo for bitscom: local inner steps, compressed pseudo-gradients, an outer Nesterov SGD.

See :class:`DiLoCo` and ``docs/diloco.md``.

Example::

    from bitscom.diloco import DiLoCo
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), model.named_parameters(),
                 sync_every=16)
"""

from .config import DiLoCoConfig
from .optimizer import DEFAULT_COMPRESSION, DiLoCo

__all__ = ["DiLoCo", "DiLoCoConfig", "DEFAULT_COMPRESSION"]
