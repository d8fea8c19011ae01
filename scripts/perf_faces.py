"""perf.py rows for the faces that own their communication: OneBitAdam and DiLoCo.

They are Adam-family optimizers used alone (no DistributedOptimizer, no DDP: each reduces what
it needs itself), so their compute-only steps run a local AdamW (the arithmetic they do) where
the other rows run SGD with momentum.

* ``onebitadam``: :class:`bitscom.OneBitAdam`, ``freeze_step=1`` (the timed steps must be the
  1-bit ones: warm-up covers the exact step and the first compressed one, which allocates the
  error-feedback buffers), ``overlap=True`` (each bucket's 1-bit all-reduce starts from the
  gradient hooks; bitwise the same results), buckets of ``--threshold`` MB.
* ``diloco``: :class:`bitscom.DiLoCo` over AdamW, ``sync_every`` (H, default 8) inner steps per
  synchronization, Streaming DiLoCo with 2 fragments and ``delay=2`` (each fragment's 4-bit
  pseudo-gradient reduction overlaps the next two inner steps: the 4-bit all-reduce has two
  rounds, and DiLoCo issues a round per step). It communicates once in H steps, so its timed
  steps are a whole number of intervals and its bytes and codec per step are averages.
"""
from __future__ import annotations

FACES = ("onebitadam", "diloco")
ADAM_LR = 1e-4       # any stable rate: timing does not depend on it, NaNs might
FREEZE_STEP = 1


def diloco_settings(sync_every: int) -> dict:
    """Streaming DiLoCo's settings for ``sync_every``: 2 fragments, delay 2 (both capped so
    that H = 1 and 2 stay valid: delay < H)."""
    return {"sync_every": sync_every, "fragments": min(2, sync_every), "delay": min(2, sync_every - 1)}


def describe(name: str, a) -> str:
    """The row's settings in words (the CSV's ``settings`` column)."""
    if name == "onebitadam":
        return f"freeze_step={FREEZE_STEP} overlap=1 bucket_mb={a.threshold:g} lr={ADAM_LR:g}"
    s = diloco_settings(a.sync_every)
    return (f"sync_every={s['sync_every']} fragments={s['fragments']} delay={s['delay']} "
            f"compression=lowbit4+ef lr={ADAM_LR:g}")


def adjust_steps(a, name: str, rank: int) -> None:
    """OneBitAdam: warm up past its exact step and first 1-bit step. DiLoCo: warm up at least
    ``delay`` steps and time whole intervals of H steps: a fragment's bytes are counted when its
    reduction lands, ``delay`` steps after it starts, so only then does every window of H steps
    see each fragment land exactly once (a part of an interval would over- or under-count its
    bytes and codec per step)."""
    notes = []
    need = FREEZE_STEP + 1 if name == "onebitadam" else diloco_settings(a.sync_every)["delay"]
    if a.warmup < need:
        notes.append(f"warmup {a.warmup} -> {need} ({name})")
        a.warmup = need
    if name == "diloco" and a.nsteps % a.sync_every:
        n = -(-a.nsteps // a.sync_every) * a.sync_every
        notes.append(f"nsteps {a.nsteps} -> {n}: whole intervals of sync_every={a.sync_every}")
        a.nsteps = n
    if rank == 0 and notes:
        print(f"[perf] {'; '.join(notes)}", flush=True)


def local_optimizer(params):
    """AdamW without communication: the faces' compute-only steps and DiLoCo's inner optimizer."""
    import torch
    return torch.optim.AdamW(params, lr=ADAM_LR)


def build(a, name: str, model, params, size: int):
    """(module, optimizer, comm_stats, codec timer) of a face row."""
    import bitscom
    import perf_codec
    if name == "onebitadam":
        opt = bitscom.OneBitAdam(params, lr=ADAM_LR, freeze_step=FREEZE_STEP, overlap=True,
                                 bucket_mb=a.threshold)
        return model, opt, opt.comm_stats, lambda: perf_codec.onebit_seconds(opt, size)
    opt = bitscom.DiLoCo(local_optimizer(params), model.named_parameters(), fusion_threshold_mb=a.threshold,
                         **diloco_settings(a.sync_every))
    return model, opt, opt.comm_stats, lambda: perf_codec.diloco_seconds(opt, size)
