#!/usr/bin/env python3
"""Adam-family convergence: the suite's byte-level GPT (``text_lm``, AdamW) trained with
optimizers that own their communication — ``bitscom.diloco.DiLoCo`` (local AdamW, compressed
pseudo-gradients, outer Nesterov SGD), ``bitscom.onebit.OneBitAdam`` and
``bitscom.onebit.ZeroOneAdam`` — against S-SGD (exact AdamW over a fp32 all-reduce), same
model, data and seeds, on 2 gloo ranks.

    python scripts/conv_adam.py --variants ssgd diloco-h16 diloco-h16-fp32 --out results/adam
    python scripts/conv_adam.py --steps 1000 --variants ssgd diloco-h16 --out results/adam1000
    python scripts/conv_adam.py --tasks digits_cnn --variants ssgd diloco-h16 --out results/adam_cnn
    python scripts/conv_adam.py --variants "d=diloco:sync_every=8,outer_lr=0.5"

Bytes are each optimizer's own ``comm_stats()``: DiLoCo's and 1-bit Adam's are whole-run
counters (warm-up included), S-SGD's ``DistributedOptimizer`` reports the last step and is
summed; the driver tells them apart by ``dense_bytes`` growing with the step count. Runs are
appended to ``runs.csv`` / ``curves.csv`` in convergence.py's format (so ``conv_report.py``
summarizes them and an interrupted study resumes). DiLoCo's model is θ_global: evaluation and
the replica check use the global parameters (the local ones differ between syncs by design).
"""
from __future__ import annotations

import argparse
import ast
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import convergence as conv  # noqa: E402
from conv_tasks import TASKS  # noqa: E402

LOWBIT_EF = ("lowbit", {"bitwidth": 4, "error_feedback": True})
# label -> (kind, settings); kind in {ssgd, diloco, onebit, zeroone}
VARIANTS = {
    "ssgd": ("ssgd", {}),
    **{f"diloco-h{h}": ("diloco", {"sync_every": h}) for h in (4, 8, 16, 32, 64)},
    **{f"diloco-h{h}-fp32": ("diloco", {"sync_every": h, "compression": None}) for h in (8, 16, 32)},
    **{f"diloco-h{h}-2bit": ("diloco", {"sync_every": h, "compression": "lowbit2"}) for h in (16, 32)},
    **{f"diloco-h16-olr{lr}": ("diloco", {"sync_every": 16, "outer_lr": lr}) for lr in (0.3, 0.5, 1.0)},
    **{f"diloco-h32-olr{lr}": ("diloco", {"sync_every": 32, "outer_lr": lr}) for lr in (0.5, 1.0)},
    # plain periodic averaging of local AdamW (outer lr 1, no momentum: PostLocalSGD's rule)
    **{f"diloco-h{h}-avg": ("diloco", {"sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.0,
                                       "nesterov": False}) for h in (4, 8, 16, 32)},
    **{f"diloco-h{h}-avg-fp32": ("diloco", {"sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.0,
                                            "nesterov": False, "compression": None}) for h in (8, 16)},
    **{f"diloco-h{h}-m0.5": ("diloco", {"sync_every": h, "outer_lr": 0.7, "outer_momentum": 0.5})
       for h in (8, 16)},
    **{f"onebit-fs{f}": ("onebit", {"freeze_step": f}) for f in (15, 30, 60, 100, 150)},
    "zeroone": ("zeroone", {}),
}
SETS = {
    "diloco": ["ssgd", "diloco-h8", "diloco-h16", "diloco-h32", "diloco-h8-fp32", "diloco-h16-fp32",
               "diloco-h32-fp32"],
    "outer-lr": ["ssgd", "diloco-h16", "diloco-h16-olr0.5", "diloco-h16-olr1.0"],
    "onebit": ["ssgd", "onebit-fs30", "onebit-fs60", "onebit-fs100", "zeroone"],
}
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95)}


def parse_variant(text):
    """``label`` | ``kind:k=v,...`` | ``label=kind:k=v,...`` -> (label, kind, settings)."""
    if text in VARIANTS:
        kind, settings = VARIANTS[text]
        return text, kind, dict(settings)
    label = None
    if "=" in text.split(":", 1)[0]:
        label, text = text.split("=", 1)
    kind, _, rest = text.partition(":")
    if kind not in ("ssgd", "diloco", "onebit", "zeroone"):
        raise SystemExit(f"unknown optimizer kind {kind!r} in {text!r}: use ssgd, diloco, onebit, "
                         f"zeroone or one of {sorted(VARIANTS)}")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"variant setting {item!r} is not key=value (in {text!r})")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return label or kind + "".join(f"-{k}{v}" for k, v in settings.items()), kind, settings


def _compression(value, seed):
    """DiLoCo's pseudo-gradient compressor: default 4-bit lowbit with error feedback;
    ``None`` exact fp32; ``"lowbit2"`` 2-bit with error feedback; else a registry name."""
    import bitscom
    if value is None:
        return None
    if value == "default":
        name, kw = LOWBIT_EF
    elif value == "lowbit2":
        name, kw = "lowbit", {"bitwidth": 2, "error_feedback": True}
    else:
        name, kw = value, {}
    return conv.build_compressor(name, kw, seed) if kw else bitscom.compressors.get(name)


def _groups(model):
    """text_lm's parameter groups (decay on matrices only, as conv_tasks does)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def build(kind, settings, model, task, task_name, world, seed):
    """(optimizer whose param_groups the schedule scales, the object with comm_stats())."""
    import bitscom
    s = dict(settings)
    base = task.make_optimizer(model, world) if kind in ("ssgd", "diloco") else None
    lr_scale = s.pop("inner_lr_scale", 1.0)     # the task's (inner) lr times this, schedule kept
    s.pop("final_sync", None)                   # train_one's: opt.sync() after the last step
    if base is not None:
        for g in base.param_groups:
            g["lr"] *= lr_scale
    if kind == "ssgd":
        opt = bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression="none")
        return opt, base
    if kind == "diloco":
        from bitscom.diloco import DiLoCo      # inner: the task's own optimizer (text_lm: AdamW)
        comp = _compression(s.pop("compression", "default"), seed)
        opt = DiLoCo(base, model.named_parameters(), compression=comp, **s)
        return opt, base
    if task_name != "text_lm":
        raise SystemExit(f"{kind} is an Adam optimizer: only the text_lm task trains with Adam")
    from bitscom import onebit
    cls = onebit.OneBitAdam if kind == "onebit" else onebit.ZeroOneAdam
    opt = cls(_groups(model), **ADAMW, **s)
    return opt, opt


def _eval_model(model, opt):
    """The model to evaluate: DiLoCo's θ_global loaded into a copy; else the model itself."""
    glob = getattr(opt, "global_parameters", None)
    if glob is None:
        return model
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())
    with torch.no_grad():
        for layout, flat in zip(opt.bucket_layouts, glob):
            for slot in layout.slots:
                named[slot.name].copy_(flat[slot.offset:slot.end].view_as(named[slot.name]))
    return m


def train_one(task, task_name, kind, settings, seed, rank, world, eval_every):
    torch.manual_seed(seed)
    model = task.make_model()
    opt, sched = build(kind, settings, model, task, task_name, world, seed)
    base_lrs = [g["lr"] for g in sched.param_groups]
    # final_sync=True: opt.sync() after the last step, so the evaluated model includes the last
    # partial interval and the replicas end identical (DiLoCo, ZeroOneAdam; OneBitAdam: no-op).
    final_sync = bool(settings.get("final_sync")) and kind in ("diloco", "zeroone", "onebit")
    torch.manual_seed(seed * 1000 + rank + 1)
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    losses, curve = [], []
    sent = dense = 0
    nonfinite = False
    t0 = time.perf_counter()
    for step in range(task.steps):
        for g, lr in zip(sched.param_groups, base_lrs):
            g["lr"] = lr * task.lr_at(step)
        batch = task.batch(step, rank, world, gen)
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        if final_sync and step + 1 == task.steps:    # the last partial interval, synchronized
            opt.sync()
        stats = opt.comm_stats()                     # whole run on every face
        sent, dense = stats["bytes_sent"], stats["dense_bytes"]
        losses.append(loss.item())
        nonfinite = nonfinite or not torch.isfinite(loss).item()
        if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == task.steps):
            curve.append((step + 1, sent, dense, task.evaluate(_eval_model(model, opt))))
    wall = time.perf_counter() - t0
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    digests = [torch.zeros(8, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(digests, conv._params_digest(_eval_model(model, opt)))
    identical = all(torch.equal(d, digests[0]) for d in digests)
    if hasattr(opt, "close"):
        opt.close()
    return mean_losses.tolist(), curve, sent, dense, wall, identical, nonfinite


def worker(rank, world, port, jobs, args):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tasks = {}
    try:
        for task_name, label, kind, settings, seed in jobs:
            if task_name not in tasks:
                tasks[task_name] = TASKS[task_name](**({"steps": args.steps} if args.steps else {}))
            task = tasks[task_name]
            res = train_one(task, task_name, kind, settings, seed, rank, world, args.eval_every)
            if rank == 0:
                _write(args, task, task_name, label, kind, settings, seed, world, *res)
    finally:
        dist.destroy_process_group()


def _write(args, task, task_name, label, kind, settings, seed, world, losses, curve, sent, dense,
           wall, identical, nonfinite):
    fp = kind + "(" + ",".join(f"{k}={v!r}" for k, v in sorted(settings.items())) + ")"
    conv._record(args.out, task, task_name, label, "none" if kind == "ssgd" else kind, settings,
                 seed, world, losses, curve, sent, dense, wall, identical, nonfinite,
                 args.eval_every, fingerprint=fp)
    metric = curve[-1][3][task.metric]
    print(f"[adam] {task_name} {label:22s} seed {seed}: {task.metric} {metric:.4f}  "
          f"{dense / max(sent, 1):.1f}x fewer bytes  {wall:.0f}s"
          f"{'' if identical else '  REPLICAS DIFFER'}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["text_lm"], choices=list(TASKS))
    ap.add_argument("--sets", nargs="+", default=None, choices=list(SETS))
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "adam"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "command.txt"), "a") as f:
        f.write("python scripts/conv_adam.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "\n")
    labels = [lb for s in (args.sets or ([] if args.variants else ["diloco"])) for lb in SETS[s]]
    labels += args.variants or []
    variants = conv.unique_variants(labels, parse_variant)
    done = conv._done(os.path.join(args.out, "runs.csv"))
    jobs = [(t, label, kind, settings, seed) for t in args.tasks for seed in range(args.seeds)
            for label, kind, settings in variants if (t, label, seed) not in done]
    print(f"[adam] {len(jobs)} run(s) to do ({len(done)} already in {args.out})", flush=True)
    if jobs:
        mp.spawn(worker, args=(args.world, conv._free_port(), jobs, args), nprocs=args.world, join=True)
    from conv_report import report
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
