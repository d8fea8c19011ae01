"""Error feedback for compressors: the one implementation is :mod:`bitscom.lowbit.error_feedback`
(the low-bit collectives share it); this name is kept for imports."""

from ..lowbit.error_feedback import ErrorFeedback

__all__ = ["ErrorFeedback"]
