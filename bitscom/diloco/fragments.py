"""Which parameters travel together when DiLoCo synchronizes: ``fragments`` contiguous runs of
nearly equal size (Streaming DiLoCo), planned into buckets numbered globally."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

from ..buckets import plan_buckets
from ..compressors.base import BucketLayout

__all__ = ["split_fragments", "plan_fragments"]


def split_fragments(params: Sequence[Tuple[str, torch.Tensor]], fragments: int) -> List[list]:
    """``params`` cut into ``fragments`` non-empty contiguous runs balanced by element count."""
    params = list(params)
    if fragments > len(params):
        raise ValueError(f"fragments={fragments} is more than the {len(params)} trainable "
                         "parameter tensors; each fragment needs at least one tensor (use "
                         f"fragments <= {len(params)})")
    total = sum(p.numel() for _, p in params)
    runs: List[list] = []
    start, done = 0, 0
    for i in range(fragments):
        left = fragments - i - 1                 # fragments still to fill after this one
        end = start + 1
        done += params[start][1].numel()
        target = total * (i + 1) / fragments
        while end < len(params) - left and done + params[end][1].numel() / 2 <= target:
            done += params[end][1].numel()
            end += 1
        if left == 0:
            end = len(params)
        runs.append(params[start:end])
        start = end
    return runs


def plan_fragments(params: Sequence[Tuple[str, torch.Tensor]], fragments: int,
                   threshold_bytes: int) -> Tuple[List[BucketLayout], List[List[int]]]:
    """(every bucket layout, numbered globally; the bucket indices of each fragment)."""
    layouts: List[BucketLayout] = []
    members: List[List[int]] = []
    for run in split_fragments(params, fragments):
        start = len(layouts)
        layouts += [dataclasses.replace(l, index=start + i) for i, l in enumerate(plan_buckets(run, threshold_bytes))]
        members.append(list(range(start, len(layouts))))
    return layouts, members
