"""Error feedback's old import path: re-exports :mod:`bitscom.lowbit.error_feedback`. Example::

    from bitscom.error_feedback import ErrorFeedback
"""

from .lowbit.error_feedback import ErrorFeedback, SteppedErrorFeedback

__all__ = ["ErrorFeedback", "SteppedErrorFeedback"]
