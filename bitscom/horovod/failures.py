"""Collective failures that name the bitscom call and the likely cause (torch's timeout errors do
not say which user call waited), with torch's error as ``__cause__``."""

from __future__ import annotations

from typing import Any, Optional

from .. import runtime

__all__ = ["peer_failure", "guard", "GuardedWork"]


def _timeout_words() -> str:
    timeout = runtime.timeout()
    if timeout is None:
        return "the process group's timeout (torch's default, 30 minutes; set it with bitscom.init(timeout=...))"
    return f"init's timeout ({timeout})"


def peer_failure(what: str, err: BaseException, during: str = "a collective") -> RuntimeError:
    """The error for ``what`` (e.g. ``"bitscom.allreduce_async 'loss'"``) whose collective failed."""
    return RuntimeError(
        f"{what}: {during} did not complete ({type(err).__name__}: {err}). Most likely a peer "
        f"did not reach the same call within {_timeout_words()}, or it died; every rank must "
        "make the same bitscom calls in the same order.")


class GuardedWork:
    """A torch work handle whose ``wait()`` failure is re-raised as :func:`peer_failure`."""

    __slots__ = ("work", "what")

    def __init__(self, work: Any, what: str):
        self.work = work
        self.what = what

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Optional[Any] = None) -> bool:
        try:
            self.work.wait()
        except RuntimeError as err:
            raise peer_failure(self.what, err) from err
        return True


def guard(work: Any, what: str) -> Optional[GuardedWork]:
    """Wrap the work a :class:`~bitscom.comm.Comm` call returned (``None``: nothing to wait for)."""
    return None if work is None else GuardedWork(work, what)
