"""Constants, sizes, validation and the counter hash shared by every kernel implementation.

Everything that decides *bytes* lives here once (code ranges, packing groups, wire sizes, the
stochastic-rounding key schedule), so the implementations cannot drift apart (``docs/format.md``).
"""
from __future__ import annotations

from ..validate import choice, number

SUPPORTED_BITS = (1, 2, 4, 8, 12, 16)
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 65536
SCALE_BYTES = 2  # one bfloat16 per block
HADAMARD_BLOCK = 32

MASK32 = 0xFFFFFFFF
# Distinct odd constants so seed halves and index halves do not collide (digits of pi).
SEED_SALT_LO = 0x243F6A88
SEED_SALT_HI = 0x85A308D3


def qmax(bits: int) -> int:
    """Largest signed level of a width: codes are ``q + qmax``, ``q`` in ``[-qmax, qmax]`` (1 bit: 1)."""
    return 1 if bits == 1 else (1 << (bits - 1)) - 1


def group(bits: int) -> tuple[int, int]:
    """(elements, bytes) of the smallest whole-byte group of codes: 8/b elems->1 byte, 12: 2->3, 16: 1->2."""
    return (8 // bits, 1) if bits <= 8 else ((2, 3) if bits == 12 else (1, 2))


def check_bits(bits) -> int:
    return choice("bits", bits, SUPPORTED_BITS)


def check_block_size(block_size, name: str = "block_size") -> int:
    if number(name, block_size, minimum=MIN_BLOCK_SIZE, maximum=MAX_BLOCK_SIZE, integer=True) & (block_size - 1):
        raise ValueError(f"{name} must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}] (e.g. 128), "
                         f"got {block_size!r}")
    return block_size


def check_seed(seed) -> int:
    return number("seed", seed, minimum=0, maximum=2 ** 64 - 1, integer=True)


def check_index_offset(index_offset) -> int:
    return number("index_offset", index_offset, minimum=0, maximum=2 ** 62 - 1, integer=True)


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks covering ``numel`` elements; the last one is zero-padded."""
    return -(-numel // block_size)


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Packed code bytes for ``numel`` elements: whole blocks of ``block_size * bits / 8`` bytes,
    always even (block_size >= 32), so bfloat16 scales placed right after stay aligned."""
    return num_blocks(numel, block_size) * block_size * bits // 8


def scale_bytes(numel: int, block_size: int) -> int:
    """Bytes of the bfloat16 scales for ``numel`` elements."""
    return num_blocks(numel, block_size) * SCALE_BYTES


def wire_bytes(numel: int, bits: int, block_size: int) -> int:
    """Exact bytes one quantized tensor of ``numel`` elements puts on the wire: payload + scales.

    Example::

        wire_bytes(1024, 4, 128)   # 528: 512 payload + 8 scales * 2 bytes
    """
    check_bits(bits)
    check_block_size(block_size)
    number("numel", numel, minimum=0, integer=True)
    return payload_bytes(numel, bits, block_size) + scale_bytes(numel, block_size)


def bits_per_element(bits: int, block_size: int) -> float:
    """Asymptotic wire cost: ``bits + 16 / block_size`` (4-bit, 128 blocks -> 4.125)."""
    return bits + 8 * SCALE_BYTES / block_size


def fmix32(h: int) -> int:
    """MurmurHash3 32-bit finalizer (a bijection on uint32), the mixer of the counter hash."""
    h &= MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    h ^= h >> 16
    return h


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys from a 64-bit seed; element ``i`` then draws ``r = h >> 8`` (24 uniform bits),
    ``h = fmix32(fmix32(lo32(i) ^ k1) ^ hi32(i) ^ k2)``: a function of (seed, global index) only."""
    seed = check_seed(seed)
    return fmix32((seed & MASK32) ^ SEED_SALT_LO), fmix32((seed >> 32) ^ SEED_SALT_HI)
