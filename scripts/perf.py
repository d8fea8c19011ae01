#!/usr/bin/env python3
"""Training-step benchmark: S-SGD, torch's DDP hooks and bitscom compressors in one harness.

Run on every rank by a launcher (scripts/perf.sh picks torchrun, mpirun, or the emulated
cluster). Fake data, random init. After ``--warmup`` steps it times ``--nsteps`` steps (the
slowest rank's time per step), then rank 0 prints the mean step time with a 95% confidence
interval, throughput, bytes each rank hands to the network per step, peak memory, the
ideal step time max(compute, wire bytes / bandwidth), the codec time per step and the
codec-inclusive bound max(compute + codec, wire), and appends one CSV row.

``--opt`` values:

* ``ssgd``          DDP, plain all-reduce of fp32 gradients (the S-SGD baseline)
* ``ddp_fp16``      DDP + torch's ``fp16_compress_hook``
* ``ddp_powersgd``  DDP + torch's ``powerSGD_hook`` (``--rank``; error feedback, warm start)
* ``ddp_<name>``    DDP + ``bitscom.ddp_comm_hook`` with bitscom's compressor ``<name>``
* ``<name>``        ``bitscom.DistributedOptimizer`` with compressor ``<name>`` from the registry:
  none, fp16, bf16, lowbit (``--bits``), powersgd / acpsgd (``--rank``), topk (``--ratio``),
  signsgd, ...
* ``onebitadam``    ``bitscom.OneBitAdam`` (1-bit momentum, overlapped with backward)
* ``diloco``        ``bitscom.DiLoCo`` over AdamW (``--sync-every``, Streaming: 2 fragments, delay 2)

(the last two: scripts/perf_faces.py). Every row also has ``codec_s``, the compressor's
encode/decode seconds per step with the network taken out (timed after the timed steps on
every rank at once, see scripts/perf_codec.py; 0 for the uncompressed rows), ``bound_s`` =
max(compute_time_s + codec_s, comm_time_ideal_s) and ``step_over_bound`` = iter_time_s /
bound_s: 1.0 means the step is as fast as its compute, codec and wire allow.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import logging
import math
import os
import platform
import resource
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import models  # noqa: E402
import perf_codec  # noqa: E402
import perf_faces  # noqa: E402

TORCH_HOOKS = ("ssgd", "ddp_fp16", "ddp_powersgd")
# bitscom registry name -> which command-line settings it takes
SETTINGS = {"lowbit": ("bits", "block_size"), "powersgd": ("rank", "start_iter"), "acpsgd": ("rank", "start_iter"),
            "topk": ("ratio",)}
CSV_FIELDS = ["time", "dnn", "opt", "rank", "bits", "ratio", "bs", "seq_len", "nworkers", "nodes",
              "ranks_per_node", "threshold_mb", "bandwidth", "nsteps", "warmup", "iter_time_s",
              "iter_ci95_s", "throughput", "bytes_sent", "dense_bytes", "compression_ratio",
              "compute_time_s", "compute_ci95_s", "link_gbit", "link_source", "comm_time_ideal_s", "ideal_time_s", "peak_mem_mb", "params",
              "device", "backend", "host", "torch", "status", "note",
              "codec_s", "bound_s", "step_over_bound", "settings"]      # new columns go last
# two-sided 97.5% Student t quantiles for 1..30 degrees of freedom
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci95(xs):
    """(mean, half-width of the 95% confidence interval of the mean)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return m, t * sd / math.sqrt(n)


def _pm(ci) -> str:
    return "" if math.isnan(ci) else f" +/- {ci * 1e3:.1f} ms"


def past_probe(comp, warmup: int, rank: int) -> int:
    """Warm-up steps that reach past ``compression="auto"``'s probe: its first ``probe_steps``
    steps per bucket are exact all-reduces in up to 8 pieces and the next one decides, so timing
    them measures the probe, not the plan (the 0.84x re-measure cell did exactly that)."""
    need = getattr(comp, "probe_steps", 0) + 1 if hasattr(comp, "probe_steps") else 0
    if warmup < need:
        if rank == 0:
            print(f"[perf] warmup {warmup} -> {need}: {type(comp).__name__} probes the link for its first "
                  f"{need - 1} steps", flush=True)
        return need
    return warmup


def progress(rank: int, what: str, i: int, warmup: int, timed: int, seconds: float) -> None:
    """One line per step on rank 0, so a long run shows it is alive and how fast it goes."""
    if rank != 0:
        return
    tag = f"warm-up {i + 1}/{warmup}" if i < warmup else f"timed {i - warmup + 1}/{timed}"
    print(f"[perf] {what} {tag}: {seconds * 1e3:.1f} ms (rank 0)", flush=True)


def probe_link(size: int, sizes_mb=(4, 32), repeat: int = 3) -> float:
    """Bits/s one rank's link carries, from timed fp32 all-reduces of two sizes (collective).

    Ring all-reduce of B bytes moves 2(n-1)/n B over each link, so the slope between the two
    sizes gives the rate and cancels the per-call latency. Used when the run is unshaped, so
    the ideal time has a wire term instead of none.
    """
    secs = []
    for mb in sizes_mb:
        x = torch.zeros(mb * 2**18)
        dist.all_reduce(x)                    # connect / allocate, untimed
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeat):
            dist.all_reduce(x)
        secs.append((time.perf_counter() - t0) / repeat)
    took = torch.tensor([secs[1] - secs[0]], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    moved = (sizes_mb[1] - sizes_mb[0]) * 2**20 * 2 * (size - 1) / size
    return moved * 8 / max(float(took.item()), 1e-9)


def link_rate(bandwidth: str, size: int) -> tuple:
    """(bits/s, where it came from): the shaped rate given, else probed on the group."""
    rate = parse_rate(bandwidth)
    if rate:
        return rate, "shaped"
    if size < 2:
        return None, ""
    return probe_link(size), "probed"


def parse_rate(text):
    if not text or str(text).lower() in ("none", "0", ""):
        return None
    import cluster
    return cluster.parse_rate(text)


# ---- analytic bytes for torch's own hooks (they do not count) ------------------------------------
def powersgd_hook_bytes(params, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes torch's powerSGD_hook hands to all-reduce per step (after its warm-up iterations).

    Mirrors ``powerSGD_hook``: vectors (ndim <= 1) are all-reduced uncompressed; a tensor
    viewed as an n x m matrix (n = shape[0]) is compressed when (n + m) * r * 2 < n * m
    (``min_compression_rate``=2), sending P (n x r) and Q (m x r); r = min(rank, n, m).
    Otherwise it goes uncompressed. fp32 throughout.
    """
    total = 0
    for p in params:
        if p.ndim <= 1:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(rank, n, m)
        if (n + m) * r * min_compression_rate < n * m:
            total += (n + m) * r
        else:
            total += p.numel()
    return total * 4


def analytic_bytes(opt: str, params, rank: int) -> int:
    numel = sum(p.numel() for p in params)
    if opt == "ssgd":
        return numel * 4
    if opt == "ddp_fp16":
        return numel * 2
    return powersgd_hook_bytes(params, rank)


# ---- the harness ---------------------------------------------------------------------------------
def parse_args(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--opt", default=env("opt", "ssgd"))
    ap.add_argument("--dnn", default=env("dnn", "resnet50"), choices=list(models.MODELS))
    ap.add_argument("--bs", type=int, default=int(env("bs", 32)), help="batch size per rank")
    ap.add_argument("--seq-len", type=int, default=int(env("seq_len", 128)), help="transformers: tokens")
    ap.add_argument("--rank", type=int, default=int(env("rank", 4)), help="PowerSGD / ACP-SGD rank")
    ap.add_argument("--start-iter", type=int, default=int(env("start_iter", 0)),
                    help="powersgd/acpsgd: dense steps before compressing (timed steps must come after; "
                         "torch's hook needs 2)")
    ap.add_argument("--bits", type=int, default=int(env("bits", 4)), help="lowbit: bits per element")
    ap.add_argument("--block-size", type=int, default=None, help="lowbit: elements per scale")
    ap.add_argument("--ratio", type=float, default=float(env("ratio", 0.05)), help="topk: kept fraction")
    ap.add_argument("--threshold", type=float, default=float(env("threshold", 25)),
                    help="fusion threshold / DDP bucket cap, MB")
    ap.add_argument("--nsteps", type=int, default=int(env("nsteps", 10)), help="timed steps")
    ap.add_argument("--warmup", type=int, default=int(env("warmup", 3)), help="untimed steps first")
    ap.add_argument("--compute-steps", type=int, default=int(env("compute_steps", 2)),
                    help="steps timed without communication (before wrapping) for the ideal time; 0 = skip")
    ap.add_argument("--bandwidth", default=env("bandwidth", ""),
                    help="the link rate this run is under (recorded; used for the ideal time)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--sync-every", type=int, default=int(env("sync_every", 8)),
                    help="diloco: inner steps per synchronization (timed steps round up to a multiple)")
    ap.add_argument("--csv", default=env("csv", os.path.join(os.path.dirname(HERE), "results", "perf.csv")))
    ap.add_argument("--note", default=env("note", ""), help="free text stored in the CSV row")
    ap.add_argument("--device", default=env("device", "auto"), choices=["auto", "cpu", "cuda"])
    ap.add_argument("--check-only", action="store_true",
                    help="only check that --opt exists in this build (exit 2 + a CSV row if not)")
    a = ap.parse_args(argv)
    if a.warmup < a.start_iter:
        a.warmup = a.start_iter        # time the compressed steps, not the dense warm-up
    if a.nsteps < 1 or a.warmup < 0:
        ap.error(f"nsteps must be >= 1 and warmup >= 0, got {a.nsteps}, {a.warmup}")
    if a.bs < 1:
        ap.error(f"bs must be >= 1, got {a.bs}")
    if a.sync_every < 1:
        ap.error(f"sync-every must be >= 1, got {a.sync_every}")
    return a


def opt_kind(opt: str, available) -> tuple:
    """('torch', opt) | ('bitscom', name) | ('hook', name) | ('face', opt); SystemExit naming
    what exists."""
    if opt in TORCH_HOOKS:
        return "torch", opt
    if opt in perf_faces.FACES:
        return "face", opt
    name = opt[4:] if opt.startswith("ddp_") else opt
    if name in ("ssgd", "s-sgd", "allreduce"):
        name = "none"
    if name not in available:
        raise SystemExit(f"opt={opt!r}: compressor {name!r} is not available in this build of bitscom; "
                         f"available: {', '.join(TORCH_HOOKS + perf_faces.FACES)}, and bitscom's "
                         f"{', '.join(available)} "
                         f"(as '<name>' for DistributedOptimizer or 'ddp_<name>' for the DDP hook)")
    return ("hook" if opt.startswith("ddp_") else "bitscom"), name


def compressor_kwargs(name: str, a) -> dict:
    values = {"bits": a.bits, "block_size": a.block_size, "rank": a.rank, "ratio": a.ratio,
              "start_iter": a.start_iter}
    return {k: values[k] for k in SETTINGS.get(name, ()) if values[k] is not None}


def write_row(path: str, row: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
            f.seek(0)
            old = list(csv.DictReader(f))
        if header != CSV_FIELDS:         # an older file: rewrite it under today's columns
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
                w.writeheader()
                w.writerows({k: r.get(k, "") for k in CSV_FIELDS} for r in old)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _measure_compute(a, kind, wl, model, params, batch, dev, rank, size):
    """Compute alone (no hooks yet): what a step would cost with an infinitely fast network.

    Measured like the timed steps (same warm-up count, ranks released together by a barrier,
    the slowest rank per step), so the two are comparable: with one untimed step and no
    barrier, the compute steps ran cold (allocator, kernel caches) and out of step with the
    other ranks, and could come out above the communicating step time. The local optimizer
    is the row's arithmetic: AdamW for the Adam-family faces, SGD with momentum otherwise.
    """
    compute_times = []
    if a.compute_steps <= 0:
        return compute_times
    local = perf_faces.local_optimizer(params) if kind == "face" else \
        torch.optim.SGD(params, lr=a.lr, momentum=0.9)
    for i in range(max(1, a.warmup) + a.compute_steps):
        if size > 1:
            dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        local.zero_grad()
        wl.loss(model, batch).backward()
        local.step()
        _sync(dev)
        dt = time.perf_counter() - t0
        if i >= max(1, a.warmup):
            compute_times.append(dt)
        progress(rank, "compute", i, max(1, a.warmup), a.compute_steps, dt)
    del local
    model.zero_grad(set_to_none=True)
    return compute_times


def _wrap_ddp(a, kind, name, model, params, dev, rank, size):
    """DDP, with torch's own hooks or bitscom's comm hook: (module, optimizer, comm_stats, codec
    timer or None: no codec)."""
    import bitscom
    from torch.nn.parallel import DistributedDataParallel as DDP
    stats, codec = None, None
    cap = a.threshold
    if a.opt == "ddp_powersgd" and dist.get_backend() == "gloo":
        # torch's powerSGD_hook chains its P/Q all-reduces in future callbacks; with gloo
        # and several buckets those callbacks issue collectives in a rank-dependent order
        # ("Received data size doesn't match expected size"). One bucket avoids that.
        cap = max(cap, sum(p.numel() * p.element_size() for p in params) / 2**20 + 1)
        a.note = (a.note + " " if a.note else "") + f"gloo: one DDP bucket ({cap:.0f} MB) for powerSGD_hook"
    net = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=cap)
    if a.opt == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        codec = lambda: perf_codec.torch_hook_seconds(a.opt, net, a.rank)  # noqa: E731
    elif a.opt == "ddp_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=a.rank,
                                 start_powerSGD_iter=2, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True)
        net.register_comm_hook(state, ps.powerSGD_hook)
        a.warmup = max(a.warmup, 2)      # its first iterations are plain all-reduce
        codec = lambda: perf_codec.torch_hook_seconds(a.opt, net, a.rank)  # noqa: E731
    elif kind == "hook":
        comp = bitscom.compressors.get(name, **compressor_kwargs(name, a))
        a.warmup = past_probe(comp, a.warmup, rank)
        hook_state, hook = bitscom.ddp_comm_hook(comp)
        net.register_comm_hook(hook_state, hook)
        stats = hook_state.comm_stats
        if name != "none":
            codec = lambda: perf_codec.compressor_seconds(  # noqa: E731
                [(perf_codec.chosen(comp, hook_state.bucket_states, l.index), l) for l in perf_codec.ddp_layouts(net)],
                size)
    return net, torch.optim.SGD(params, lr=a.lr, momentum=0.9), stats, codec


def _wrap_bitscom(a, name, model, params, rank, size):
    """bitscom.DistributedOptimizer: (module, optimizer, comm_stats, codec timer or None)."""
    import bitscom
    comp = bitscom.compressors.get(name, **compressor_kwargs(name, a))
    a.warmup = past_probe(comp, a.warmup, rank)
    if rank == 0 and name == "auto":     # its per-bucket predicted seconds, at INFO
        logging.basicConfig(format="[perf] %(message)s")
        logging.getLogger("bitscom").setLevel(logging.INFO)
    # dgc (MomentumCorrection) applies the momentum itself: the SGD then has none
    base = torch.optim.SGD(params, lr=a.lr, momentum=0.0 if comp.applies_momentum else 0.9)
    opt = bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp, fusion_threshold_mb=a.threshold)
    bitscom.broadcast_parameters(model.state_dict(), root_rank=0)

    def codec():
        states = opt.compressor_states
        return perf_codec.compressor_seconds([(perf_codec.chosen(comp, states, l.index), l)
                                              for l in opt.bucket_layouts], size)
    return model, opt, opt.comm_stats, (codec if name != "none" else None)


def _window(stats):
    """(bytes sent, dense bytes) so far on this rank (every face counts the whole run)."""
    if stats is None:
        return None
    st = stats()
    return st["bytes_sent"], st["dense_bytes"]


def _timed_steps(a, wl, net, opt, batch, dev, rank, size, stats):
    """Warm-up, then ``a.nsteps`` timed steps: this rank's step times in seconds, and the bytes
    (sent, dense) per timed step, None without a count (torch's hooks). Bytes are the timed
    window's over its steps: one meaning for the faces that send every step and for DiLoCo,
    which sends once in ``sync_every`` steps (its last step alone would say 0 or a lot)."""
    def step():
        opt.zero_grad()
        wl.loss(net, batch).backward()
        opt.step()

    for i in range(a.warmup):
        t0 = time.perf_counter()
        step()
        progress(rank, "step", i, a.warmup, a.nsteps, time.perf_counter() - t0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if size > 1:
        dist.barrier()
    before = _window(stats)
    times = []
    for i in range(a.nsteps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        progress(rank, "step", a.warmup + i, a.warmup, a.nsteps, times[-1])
    after = _window(stats)
    per_step = None if before is None else tuple((y - x) / a.nsteps for x, y in zip(before, after))
    return times, per_step


def _gather(a, stats, window, params, times, compute_times, dev, rank, size):
    """The slowest rank's time per step, bytes and memory: (times, compute times, peak MB, sent, dense)."""
    t = torch.tensor(times, dtype=torch.float64)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    if window is not None:
        sent, dense = window
        plan = stats().get("auto_plan")
        if rank == 0 and plan is not None:    # compression="auto": what it chose
            print(f"[perf] auto plan per bucket: {' | '.join(map(str, plan))}", flush=True)
    else:
        sent, dense = analytic_bytes(a.opt, params, a.rank), sum(p.numel() for p in params) * 4
    extra = torch.tensor([peak, sent], dtype=torch.float64)
    ct = torch.tensor(compute_times, dtype=torch.float64)
    if size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        if len(ct):
            dist.all_reduce(ct, op=dist.ReduceOp.MAX)
    peak, sent_max = extra.tolist()
    return t.tolist(), ct.tolist(), peak, sent_max, dense


def settings_text(kind: str, name: str, a) -> str:
    """The row's settings in words: the printed opt line and the CSV's ``settings`` column."""
    if kind == "face":
        return perf_faces.describe(name, a)
    if kind == "torch":
        return f"rank={a.rank}" if a.opt == "ddp_powersgd" else ""
    return " ".join(f"{k}={v}" for k, v in compressor_kwargs(name, a).items())


def _fmt(x: float, digits: int = 5) -> str:
    return "" if math.isnan(x) else f"{x:.{digits}f}"


def _report(a, kind, name, wl, dev, size, times, compute_times, peak, sent_max, dense, rate, rate_source, codec):
    """Rank 0: one CSV row and the summary lines."""
    import bitscom
    compute, compute_ci = mean_ci95(compute_times) if compute_times else (float("nan"), float("nan"))
    mean, ci = mean_ci95(times)
    # ring all-reduce: each rank's link carries 2(n-1)/n of the payload in each direction
    comm_ideal = sent_max * 2 * (size - 1) / size / (rate / 8) if size > 1 else 0.0
    ideal = comm_ideal if math.isnan(compute) else max(compute, comm_ideal)
    limit = perf_codec.bound(compute, codec, comm_ideal)
    over = perf_codec.over(mean, limit)
    thr = a.bs * size / mean
    nodes = size // max(1, bitscom.local_size())
    row = _base_row(a, size) | {
        "nodes": nodes, "ranks_per_node": bitscom.local_size(),
        "iter_time_s": f"{mean:.5f}", "iter_ci95_s": f"{ci:.5f}", "throughput": f"{thr:.3f}",
        "bytes_sent": int(sent_max), "dense_bytes": int(dense),
        "compression_ratio": f"{dense / sent_max:.2f}" if sent_max else "",
        "compute_time_s": f"{compute:.5f}" if not math.isnan(compute) else "",
        "compute_ci95_s": f"{compute_ci:.5f}" if not math.isnan(compute_ci) else "",
        "link_gbit": f"{rate / 1e9:.4g}" if rate else "", "link_source": rate_source,
        "comm_time_ideal_s": f"{comm_ideal:.5f}",
        "ideal_time_s": f"{ideal:.5f}" if not math.isnan(ideal) else "", "peak_mem_mb": f"{peak:.0f}",
        "params": wl.numel, "device": str(dev), "backend": dist.get_backend() if size > 1 else "",
        "status": "ok", "codec_s": _fmt(codec), "bound_s": _fmt(limit), "step_over_bound": _fmt(over, 3),
        "settings": settings_text(kind, name, a)}
    write_row(a.csv, row)
    where = os.environ.get("BITSCOM_CLUSTER", "this machine")
    settings = settings_text(kind, name, a)
    print(f"[perf] {a.dnn} ({wl.numel / 1e6:.1f}M params, {wl.source}), bs {a.bs}/rank, "
          f"{size} rank(s) on {where}")
    print(f"[perf] opt={a.opt} {settings} threshold={a.threshold:g}MB bandwidth={a.bandwidth or 'unshaped'}")
    print(f"[perf] iteration time {mean * 1e3:.1f} ms +/- {ci * 1e3:.1f} ms (95% CI, {a.nsteps} steps), "
          f"throughput {thr:.2f} samples/s")
    print(f"[perf] bytes on the wire {sent_max / 1e6:.2f} MB/step/rank (fp32 {dense / 1e6:.2f} MB, "
          f"{dense / sent_max if sent_max else float('nan'):.1f}x fewer), peak memory {peak:.0f} MB")
    comp_txt = (f"compute {compute * 1e3:.1f} ms{_pm(compute_ci)}" if not math.isnan(compute)
                else "compute not measured (compute_steps=0)")
    link_txt = f"{rate / 1e9:.3g} Gbit/s {rate_source}" if size > 1 else "one rank, no wire"
    print(f"[perf] {comp_txt}, ideal comm {comm_ideal * 1e3:.1f} ms ({link_txt}), "
          f"ideal step {ideal * 1e3:.1f} ms -> {a.csv}")
    if math.isnan(codec):
        print("[perf] codec not measured (its timing failed, above): no bound")
    else:
        print(f"[perf] codec {codec * 1e3:.1f} ms/step, bound max(compute + codec, wire) {limit * 1e3:.1f} ms, "
              f"step/bound {over:.2f}")
    if not math.isnan(compute) and compute - compute_ci > mean + ci:
        print("[perf] note: compute-only steps measured slower than the communicating steps beyond "
              "their 95% CIs: the machine's load changed between the two phases; rerun", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    import bitscom
    try:
        kind, name = opt_kind(a.opt, bitscom.compressors.names())
    except SystemExit as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
            write_row(a.csv, _base_row(a, int(os.environ.get("WORLD_SIZE", "1"))) | {"status": "unavailable",
                                                                                         "note": str(err)[:200]})
        return 2
    if a.check_only:
        return 0

    bitscom.init(device=None if a.device == "auto" else a.device)
    rank, size = bitscom.rank(), bitscom.size()
    dev = bitscom.runtime.device()
    in_cluster = bool(os.environ.get("BITSCOM_CLUSTER"))
    # all emulated nodes share this machine's cores
    sharers = size if in_cluster else bitscom.local_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, sharers)))
    # Subnormal floats cost x86 cores ~100x per operation: a few steps of OneBitAdam with
    # freeze_step=1 on a random-init BERT put 0.3% of its gradients there and its steps ran 1.4x
    # slower. The benchmark times communication and codecs, not that, so it flushes them (every row).
    torch.set_flush_denormal(True)
    torch.manual_seed(1234 + rank)

    wl = models.build(a.dnn, a.bs, a.seq_len)
    model = wl.model.to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = wl.make_batch(dev)

    if kind == "face":
        perf_faces.adjust_steps(a, name, rank)
    compute_times = _measure_compute(a, kind, wl, model, params, batch, dev, rank, size)
    if kind in ("torch", "hook"):
        net, opt, stats, codec_timer = _wrap_ddp(a, kind, name, model, params, dev, rank, size)
    elif kind == "face":
        net, opt, stats, codec_timer = perf_faces.build(a, name, model, params, size)
    else:
        net, opt, stats, codec_timer = _wrap_bitscom(a, name, model, params, rank, size)
    times, window = _timed_steps(a, wl, net, opt, batch, dev, rank, size, stats)
    if kind == "face":
        opt.sync()           # DiLoCo: land the reductions in flight (after the byte window)
    times, compute_times, peak, sent_max, dense = _gather(a, stats, window, params, times, compute_times, dev,
                                                          rank, size)
    if rank == 0 and codec_timer is not None:
        print("[perf] timing the codec on every rank at once (network taken out)", flush=True)
    codec = perf_codec.measure(a.opt, codec_timer, rank, size)
    rate, rate_source = link_rate(a.bandwidth, size)     # collective when probed: every rank
    if rank == 0:
        _report(a, kind, name, wl, dev, size, times, compute_times, peak, sent_max, dense, rate, rate_source,
                codec)
    perf_codec.release()
    bitscom.shutdown()
    return 0


def _base_row(a, size) -> dict:
    return {"time": datetime.datetime.now().isoformat(timespec="seconds"), "dnn": a.dnn, "opt": a.opt,
            "rank": a.rank, "bits": a.bits, "ratio": a.ratio, "bs": a.bs,
            "seq_len": a.seq_len if a.dnn.startswith(("bert", "gpt")) else "", "nworkers": size,
            "threshold_mb": a.threshold, "bandwidth": a.bandwidth or "none", "nsteps": a.nsteps,
            "warmup": a.warmup, "host": socket.gethostname(), "torch": torch.__version__,
            "note": a.note, "status": "", "device": "", "nodes": "", "ranks_per_node": ""} | \
        {"python": platform.python_version()}


if __name__ == "__main__":
    sys.exit(main())
