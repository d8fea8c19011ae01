"""Checks of settings, written once: every error names the setting, the value and what is
allowed. ``True`` is never a number here and NaN never passes a bound."""

from __future__ import annotations

import math
import numbers as _numbers
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Sequence, Tuple, Union

__all__ = ["number", "real", "numbers", "flag", "choice", "instance"]

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60     # a model, an optimizer or a tensor prints pages


def _bounds(minimum, maximum, inclusive: Tuple[bool, bool]) -> str:
    low, high = (f"{v:g}" if isinstance(v, float) else v for v in (minimum, maximum))   # ints exactly
    if minimum is not None and maximum is not None:
        return f" in {'[' if inclusive[0] else '('}{low}, {high}{']' if inclusive[1] else ')'}"
    if minimum is not None or maximum is not None:
        below = maximum is not None
        return f" {'<' if below else '>'}{'=' if inclusive[below] else ''} {high if below else low}"
    return ""


def _within(v: float, minimum: Optional[float], maximum: Optional[float], closed: Tuple[bool, bool]) -> bool:
    low = minimum is None or (v >= minimum if closed[0] else v > minimum)
    return low and (maximum is None or (v <= maximum if closed[1] else v < maximum))


def _closed(inclusive: Union[bool, Tuple[bool, bool]]) -> Tuple[bool, bool]:
    return (inclusive, inclusive) if isinstance(inclusive, bool) else (inclusive[0], inclusive[1])


def number(name: str, value: Any, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
           inclusive: Union[bool, Tuple[bool, bool]] = True, integer: bool = False,
           finite: bool = False, why: str = "") -> Any:
    """``value`` if an int (``integer``) or real number within the bounds, else a ValueError
    (``why``, when given, ends the message: what the bound protects)."""
    closed = _closed(inclusive)
    kind = "an int" if integer else ("a finite number" if finite else "a number")
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if ok:
        v = float(value)
        ok = not math.isnan(v) and not (finite and math.isinf(v)) and _within(v, minimum, maximum, closed)
    if not ok:
        raise ValueError(f"{name} must be {kind}{_bounds(minimum, maximum, closed)}, got {value!r}{_why(why)}")
    return value


def real(name: str, value: Any, **bounds) -> float:
    """``float(value)`` checked by :func:`number`; no real number at all is :func:`instance`'s TypeError."""
    return number(name, float(instance(name, value, _numbers.Real, "a number")), **bounds)


def numbers(name: str, values: Any, *, nonempty: bool = False, minimum: Optional[float] = None,
            maximum: Optional[float] = None, inclusive: Union[bool, Tuple[bool, bool]] = True,
            integer: bool = False, finite: bool = False) -> tuple:
    """``values`` as a tuple of :func:`number`-checked items (no string: ``'25'``; errors ``name[i]``)."""
    kinds = "ints" if integer else ("finite numbers" if finite else "numbers")
    what = f"{'non-empty ' if nonempty else ''}sequence of {kinds}{_bounds(minimum, maximum, _closed(inclusive))}"
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a {what}, got {values!r}")
    items = tuple(values)
    if nonempty and not items:
        raise ValueError(f"{name} must be a {what}, got {values!r}")
    for i, v in enumerate(items):
        number(f"{name}[{i}]", v, minimum=minimum, maximum=maximum, inclusive=inclusive,
               integer=integer, finite=finite)
    return items


def _why(why: str) -> str:
    return f"; {why}" if why else ""


def flag(name: str, value: Any, why: str = "") -> bool:
    """``value`` if it is a bool, else a TypeError (``'no'`` would read as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}{_why(why)}")
    return value


def choice(name: str, value: Any, allowed: Sequence[Any], why: str = "") -> Any:
    """``value`` if it is one of ``allowed``, else a ValueError listing them."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}{_why(why)}")
    return value


def instance(name: str, value: Any, types: Union[type, Tuple[type, ...]], allowed: str) -> Any:
    """``value`` if an instance of ``types`` (a bool only where named), else a TypeError naming it
    (its repr shortened to one line)."""
    kinds = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        shown = " ".join(_SHORT.repr(value).split())
        raise TypeError(f"{name} must be {allowed}, got {shown} ({type(value).__name__})")
    return value
