"""Codec time per step for scripts/perf.py, and the codec-inclusive bound of a step.

Why: a step cannot be faster than ``bound = max(compute + codec, wire)``: the model's own work
plus the compressor's encode/decode arithmetic (both on the same cores), or the bytes on the
link, whichever is longer. perf.py printed ``max(compute, wire)`` only, so a compressor whose
codec costs more than the wire time it saves looked "far from ideal" without saying why, and
step / max(compute + codec, wire) had to be worked out by hand.

What is timed (:func:`measure`: every rank at once, after a barrier, the slowest rank; during
a step the ranks share the machine's cores, so here they do too):

* a bitscom compressor (``DistributedOptimizer`` or its DDP hook): its ``reduce()`` on every
  bucket of the run, over :class:`bitscom.cost.local.LocalTransport` (the network taken out),
  with :func:`bitscom.cost.time_codec`; ``compression="auto"``: each bucket's choice;
* torch's DDP hooks (``ddp_fp16``, ``ddp_powersgd``): torch's own hook on DDP's own buckets,
  on a one-rank process group per rank (its collectives then move nothing);
* OneBitAdam: its two-stage 1-bit all-reduce of the whole momentum (``overlap=True`` reduces
  the same blocks bucket by bucket, the same arithmetic); DiLoCo: one synchronization of every
  fragment through its compressor, divided by ``sync_every`` (it happens once in that many steps);
* the uncompressed rows (``ssgd``, ``none``): 0 by definition (the 1/n scaling of an exact
  all-reduce is not a codec).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

_KEPT: list = []      # torch_hook_seconds' groups and hook states, until release()
REPEATS = 4          # even: ACP-SGD alternates P and Q steps, so the mean covers both alike
WARMUP = 2           # untimed runs first (allocations, first factor draws)


def bound(compute: float, codec: float, wire: float) -> float:
    """``max(compute + codec, wire)``; NaN when compute or codec was not measured.

    Example::

        bound(1.0, 0.25, 1.1)    # 1.25
    """
    if math.isnan(compute) or math.isnan(codec):
        return float("nan")
    return max(compute + codec, wire)


def over(step: float, limit: float) -> float:
    """``step / limit``: 1.0 = as fast as compute, codec and wire allow; NaN without a bound."""
    return step / limit if limit > 0 else float("nan")


# ---- bitscom compressors on the local transport -----------------------------------------------------
def chosen(comp, states: Sequence, index: int):
    """The compressor that ran bucket ``index``: ``compression="auto"``'s choice, else ``comp``."""
    candidates = getattr(comp, "candidates", None)
    if candidates is None or comp.name != "auto":
        return comp
    choice = getattr(states[index], "choice", -1) if index < len(states) else -1
    if choice < 0:
        raise RuntimeError(f"compression='auto' has not decided bucket {index}; raise --warmup")
    return candidates[choice]


def compressor_seconds(pairs, world: int, repeats: int = REPEATS) -> float:
    """Sum over ``(compressor, layout)`` pairs of the mean seconds of one ``reduce()`` of the
    layout on a local transport of ``world`` ranks (``none`` has no codec: 0)."""
    from bitscom.cost import time_codec
    total = 0.0
    gen = torch.Generator().manual_seed(0)
    for comp, layout in pairs:
        if comp.name == "none":
            continue
        grad = torch.randn(layout.numel, generator=gen).to(layout.device, layout.dtype)
        total += time_codec(comp, layout, world, grad, repeats=repeats, warmup=WARMUP,
                            statistic=statistics.fmean)
    return total


def ddp_buckets(net) -> list:
    """DDP's own buckets (``dist.GradBucket``: index, flat buffer, gradient views, is_last),
    zero-filled copies of the ones the run used (after the first step's rebuild)."""
    buckets = net.reducer._get_zeros_like_grad_buckets()
    if not buckets:
        raise RuntimeError("DDP reports no gradient buckets")
    return buckets


def ddp_layouts(net) -> list:
    """A :class:`bitscom.compressors.base.BucketLayout` per DDP bucket, its slots the gradients'
    shapes (as bitscom's DDP hook builds them, so matrix compressors see matrices)."""
    from bitscom.cost import layout_of
    out = []
    for b in ddp_buckets(net):
        flat = b.buffer()
        shapes = [tuple(g.shape) for g in b.gradients()]
        if sum(math.prod(s) for s in shapes) != flat.numel():     # not densely packed: one tensor
            shapes = [(flat.numel(),)]
        layout = layout_of(flat.numel(), flat.dtype, shapes=shapes)
        out.append(dataclasses.replace(layout, index=b.index(), device=flat.device))
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def torch_hook_seconds(opt: str, net, powersgd_rank: int, repeats: int = REPEATS) -> float:
    """Mean seconds of one step of torch's ``ddp_fp16`` / ``ddp_powersgd`` hook over DDP's
    buckets, on a one-rank group of this rank (every rank must call it: it makes the groups).
    PowerSGD runs its plain steps (``start_powerSGD_iter=2``) and first factor draw untimed.

    The groups and the hook's state stay referenced (``_KEPT``) until :func:`release`: the
    hook's future callbacks run on the group's own thread and hold them, and destroying the
    group right after the last ``wait()`` let a callback drop the last reference there, so the
    group was freed on its own thread ("Resource deadlock avoided": one rank aborted, BERT-base
    ``ddp_powersgd`` on the emulated cluster)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    buckets = ddp_buckets(net)
    mine, groups = dist.new_subgroups(group_size=1)
    if opt == "ddp_fp16":
        hook, state, warmup = default_hooks.fp16_compress_hook, mine, WARMUP
    else:
        state = ps.PowerSGDState(process_group=mine, matrix_approximation_rank=powersgd_rank,
                                 start_powerSGD_iter=2, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True)
        hook, warmup = ps.powerSGD_hook, 2 + WARMUP
    _KEPT.append((groups, state))
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(b.buffer().numel(), generator=gen).to(b.buffer()) for b in buckets]
    times = []
    for i in range(warmup + repeats):
        for b, g in zip(buckets, grads):
            b.buffer().copy_(g)
        _sync(grads[0].device)
        t0 = time.perf_counter()
        for fut in [hook(state, b) for b in buckets]:
            fut.wait()
        _sync(grads[0].device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def release() -> None:
    """Destroy :func:`torch_hook_seconds`' groups and drop them, on this (the main) thread,
    well after their last callback ran: before ``bitscom.shutdown()``, since a gloo group that
    outlives the world is torn down at interpreter exit, where its threads can abort the process."""
    import gc
    for groups, _state in _KEPT:
        for g in groups:
            dist.destroy_process_group(g)
    _KEPT.clear()
    gc.collect()


# ---- the faces that own their communication ---------------------------------------------------------
def onebit_seconds(opt, world: int, repeats: int = REPEATS) -> float:
    """OneBitAdam's codec per (compressed) step: its 1-bit two-stage all-reduce of the momentum."""
    from bitscom.compressors import LowBit
    from bitscom.cost import layout_of
    layout = dataclasses.replace(layout_of(opt.exp_avg.numel()), device=opt.exp_avg.device)
    return compressor_seconds([(LowBit(opt.config.codec), layout)], world, repeats)


def diloco_seconds(opt, world: int, repeats: int = REPEATS) -> float:
    """DiLoCo's codec per inner step: every bucket of every fragment once per ``sync_every``."""
    pairs = [(opt.compression, layout) for layout in opt.bucket_layouts]
    return compressor_seconds(pairs, world, repeats) / opt.config.sync_every


def measure(what: str, timer: Optional[Callable[[], float]], rank: int, size: int) -> float:
    """The slowest rank's seconds of ``timer()`` run on every rank at once (0 without a timer:
    an uncompressed row). A failure on any rank is NaN on every rank, so the row keeps its
    other columns; ``timer`` must raise only after its own collectives (or before all of them)."""
    if timer is None:
        return 0.0
    if size > 1:
        dist.barrier()
    try:
        seconds = float(timer())
    except Exception as err:  # noqa: BLE001 (reported; NaN reaches every rank)
        print(f"[perf] rank {rank}: timing the codec of {what} failed: {err!r}", flush=True)
        seconds = float("inf")
    if size > 1:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t.item())
    return float("nan") if math.isinf(seconds) else seconds
