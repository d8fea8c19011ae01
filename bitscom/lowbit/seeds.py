"""The one seed mixer of bitscom: every stochastic-rounding seed of every face comes from :func:`mix_seed`, a splitmix64
chain. Different parts give unrelated seeds, the same parts the same seed in every process, so a resumed run repeats its
bytes and no two ranks, stages or steps share a stream.
"""

from __future__ import annotations

import zlib

__all__ = ["mix_seed", "stage_seed", "key_id"]

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*parts: int, start: int = 0) -> int:
    """A 64-bit seed from integer parts (a splitmix64 chain from ``start``).

    Example::

        seed = mix_seed(base_seed, step, rank, bucket, chunk, stage)
    """
    h = start & _M64
    for part in parts:
        h = _splitmix64(h ^ _splitmix64(int(part) & _M64))
    return h


def stage_seed(seed: int, key: int, step: int, rank: int, stage: int) -> int:
    """The stochastic-rounding seed of one (key, step, rank, stage) of a collective."""
    return mix_seed(key, step, rank, stage, start=seed)


def key_id(key) -> int:
    """A stable integer for a user key, the same in every process (ints as they are, else CRC32 of the repr)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key & _M64
    return zlib.crc32(repr(key).encode())
