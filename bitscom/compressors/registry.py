"""Compressors by name, for scripts and command lines: ``get("acpsgd", rank=4)``. A dict filled
by :func:`register`, not an if/elif factory, so adding a compressor touches one file.
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict

from .base import Compressor
from ..suggest import did_you_mean
from ..validate import instance
from .hvd_adapter import HorovodAdapter, is_codec

_REGISTRY: Dict[str, Callable[..., Compressor]] = {}


def register(name: str, factory: Callable[..., Compressor]) -> None:
    """Make ``factory`` available as ``get(name, **kwargs)``.

    Example::

        register("halves", Halves)          # then get("halves"), perf.sh opt=halves
    """
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"compressor name {name!r} is already registered to {_REGISTRY[name]!r}")
    _REGISTRY[name] = factory


def names() -> list:
    """The registered compressor names, sorted.

    Example::

        print(bitscom.compressors.names())   # ['acpsgd', 'auto', 'bf16', ...]
    """
    return sorted(_REGISTRY)


def get(name: str, **kwargs) -> Compressor:
    """Build the compressor registered as ``name`` with its settings.

    Example::

        comp = bitscom.compressors.get("fp16")
        comp = bitscom.compressors.get("acpsgd", rank=4)
        comp = bitscom.compressors.get(MyHorovodCodec)   # wrapped in HorovodAdapter
    """
    if isinstance(name, Compressor):
        if kwargs:
            raise ValueError(f"settings {sorted(kwargs)} given with a compressor instance {name!r}")
        return name
    if is_codec(name):      # a Horovod-style codec class/instance: compress/decompress
        if kwargs:
            raise ValueError(f"settings {sorted(kwargs)} given with the codec {name!r}")
        return HorovodAdapter(name)
    key = str(name).lower()
    if key in ("ssgd", "s-sgd", "allreduce"):
        key = "none"
    if key not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}{did_you_mean(key, names())}; registered names "
                         f"are {names()}")
    try:
        return _REGISTRY[key](**kwargs)
    except TypeError as err:
        raise TypeError(f"bad settings for compressor {key!r}: {err}{_setting_hint(key, kwargs)}") from None


def _setting_hint(key: str, kwargs: dict) -> str:
    """For a misspelled keyword: the close matches among the factory's parameters, and them all."""
    try:
        params = inspect.signature(_REGISTRY[key]).parameters.values()
    except (TypeError, ValueError):
        return ""
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ""                        # the factory names its settings itself (LowBitConfig)
    accepted = [p.name for p in params if p.name not in ("self", "config")]
    unknown = [k for k in kwargs if k not in accepted]
    if not unknown or not accepted:
        return ""
    hints = "".join(did_you_mean(k, accepted) for k in unknown)
    return f"{hints}; {key} takes {accepted}"


def resolve(compressor, what: str = "compression") -> Compressor:
    """A compressor instance, the one a registry name builds, or a Horovod-style codec wrapped
    in ``HorovodAdapter``; anything else is a TypeError naming ``what`` (the caller's argument)."""
    if isinstance(compressor, str) or is_codec(compressor):
        compressor = get(compressor)
    return instance(what, compressor, Compressor, "a bitscom compressor, a Horovod-style codec "
                    f"(compress/decompress) or a registry name (one of {names()})")

