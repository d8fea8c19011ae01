"""DiLoCo for bitscom: local inner steps, compressed pseudo-gradients, an outer Nesterov SGD.
See :class:`DiLoCo` and ``docs/diloco.md``."""

from .config import DiLoCoConfig
from .optimizer import DEFAULT_COMPRESSION, DiLoCo

__all__ = ["DiLoCo", "DiLoCoConfig", "DEFAULT_COMPRESSION"]
