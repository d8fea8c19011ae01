"""Error feedback for compressors: the one implementation lives in :mod:`bitscom.error_feedback`
(below the compressors, so the low-bit collectives use it too); this name is kept for imports.
"""

from ..lowbit.error_feedback import ErrorFeedback

__all__ = ["ErrorFeedback"]
