"""Error feedback (kept as an import path): :class:`ErrorFeedback`, :class:`SteppedErrorFeedback`.

The one implementation lives in :mod:`bitscom.lowbit.error_feedback` (below the compressors
and the low-bit collectives, which both use it); this module re-exports it.

Example::

    from bitscom.error_feedback import ErrorFeedback
    ef = ErrorFeedback(numel, device)
"""

from .lowbit.error_feedback import ErrorFeedback, SteppedErrorFeedback

__all__ = ["ErrorFeedback", "SteppedErrorFeedback"]
