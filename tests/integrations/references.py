"""Independent byte counts for the recipes' model (Linear(32, 64), ReLU, Linear(64, 4)), from
each compressor's wire format as documented, not from bitscom's own accounting."""

import math

SHAPES = [(64, 32), (64,), (4, 64), (4,)]
NUMEL = sum(math.prod(s) for s in SHAPES)          # 2372
FP32_BYTES = 4 * NUMEL


def lowbit_bytes(numel: int, world: int, bits: int = 4, block: int = 128) -> int:
    """Flat two-stage low-bit all-reduce: each rank sends ``world`` block-padded shards of
    ``bits`` per element in the all-to-all (its own included) and one shard, requantized at
    max(bits, 4), in the all-gather; every block of ``block`` elements carries a bf16 scale."""
    shard = -(-numel // (world * block)) * block
    stage2 = max(bits, 4)

    def packed(elements, width):
        return elements * width // 8 + (elements // block) * 2

    return packed(world * shard, bits) + packed(shard, stage2)


def powersgd_bytes(shapes, rank: int, min_compression_rate: float = 2) -> int:
    """PowerSGD in fp32: an n x m matrix sends P (n x r) and Q (m x r), r = min(n, m, rank),
    unless that is not ``min_compression_rate`` times smaller; vectors go uncompressed."""
    elements = 0
    for shape in shapes:
        if len(shape) == 2:
            n, m = shape
            r = min(n, m, rank)
            factors = (n + m) * r
            elements += factors if n * m >= min_compression_rate * factors else n * m
        else:
            elements += shape[0]
    return 4 * elements
