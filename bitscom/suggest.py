"""Close matches for a misspelled name: every "unknown X" error says what was probably meant."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``options`` to ``word``, or ``""``."""
    close = difflib.get_close_matches(str(word).lower(), [str(o) for o in options], n=2, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"
