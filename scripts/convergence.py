#!/usr/bin/env python3
"""Convergence suite: every compressor (and named variants) against S-SGD, same data, same
seeds, on real tasks, on N gloo ranks of this machine.

    python scripts/convergence.py                       # the default suite (< 1 h on 2 CPU cores)
    python scripts/convergence.py --quick               # 1 seed, shorter runs (smoke / CI-sized)
    python scripts/convergence.py --tasks text_lm --variants ssgd powersgd "powersgd:rank=4,start_iter=30"
    python scripts/convergence.py --sets ef sr --tasks digits_cnn text_lm
    python scripts/convergence.py --plot-only --out results/convergence   # redraw from the CSVs

Why one run for all variants: the comparison that matters is compressor vs S-SGD on the same
task, seed and data order; running them in one suite (one pair of processes, one process
group) keeps everything but the compressor equal. Every rank builds the model from the same
seed; each rank draws its own batches. Bytes are counted by the optimizer itself
(``comm_stats()["step_bytes_sent"]`` summed over every step, warm-up included) and compared with
what fp32 all-reduce would have sent (``dense_bytes``): the whole-run ratio in the summary is
never an analytic claim.

Outputs in ``--out`` (appended, so a suite can be resumed or extended; finished
(task, variant, seed) runs are skipped):

* ``runs.csv``    one row per run: final metric, bytes, wall time, replicas identical or not;
* ``curves.csv``  per logged step: train loss (mean over ranks), cumulative bytes, eval metric;
* ``summary.md``  per task: mean ± spread over seeds, Δ vs S-SGD, whole-run bytes ratio, target;
* PNGs: metric vs step and vs bytes per task, SR vs RTN vs fp32, EF modes × models (loss and
  throughput).

A variant is a registry name with settings: ``name`` (the default), or
``label=name:key=value,key=value`` / ``name:key=value`` on the command line (values are Python
literals). Named sets (``--sets``) are listed in :data:`SETS`.
"""
from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from conv_tasks import OPT_TASKS, TASKS  # noqa: E402

# label -> (registry name, settings)
VARIANTS = {
    "ssgd": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "lowbit": ("lowbit", {}),
    "powersgd": ("powersgd", {}),
    "acpsgd": ("acpsgd", {}),
    "topk": ("topk", {}),
    "signsgd": ("signsgd", {}),
    # error-feedback modes of the low-bit all-reduce (the seed's none / legacy / ef21 / ef21_plus)
    "lowbit-ef_none": ("lowbit", {"error_feedback_mode": "none"}),
    "lowbit-ef": ("lowbit", {"error_feedback_mode": "legacy"}),
    "lowbit-ef21": ("lowbit", {"error_feedback_mode": "ef21"}),
    "lowbit-ef21_plus": ("lowbit", {"error_feedback_mode": "ef21_plus"}),
    # stochastic vs nearest rounding (the seed's SR vs RTN end-to-end curves)
    "lowbit-rtn": ("lowbit", {"stochastic_rounding": False}),
    "lowbit-sr": ("lowbit", {"stochastic_rounding": True}),
    "lowbit-2bit": ("lowbit", {"bits": 2}),
    # ranks, ratios, warm-ups
    "powersgd-r1": ("powersgd", {"rank": 1}),
    "powersgd-r2": ("powersgd", {"rank": 2}),
    "powersgd-r4": ("powersgd", {"rank": 4}),
    "powersgd-r8": ("powersgd", {"rank": 8}),
    "powersgd-r16": ("powersgd", {"rank": 16}),
    "powersgd-warm0": ("powersgd", {"start_iter": 0}),
    "powersgd-warm30": ("powersgd", {"start_iter": 30}),
    "acpsgd-r1": ("acpsgd", {"rank": 1}),
    "acpsgd-r4": ("acpsgd", {"rank": 4}),
    "acpsgd-r8": ("acpsgd", {"rank": 8}),
    "acpsgd-r16": ("acpsgd", {"rank": 16}),
    "acpsgd-r32": ("acpsgd", {"rank": 32}),
    "acpsgd-warm30": ("acpsgd", {"start_iter": 30}),
    "topk-0.01": ("topk", {"ratio": 0.01}),
    "topk-0.03": ("topk", {"ratio": 0.03}),
    "topk-0.05": ("topk", {"ratio": 0.05}),
    "signsgd-vote": ("signsgd", {"majority_vote": True, "block_size": None}),   # the old default
    "signsgd-pertensor": ("signsgd", {"block_size": None}),                      # EF, one scale per tensor
    "signsgd-b64": ("signsgd", {"block_size": 64}),
    "signsgd-b16": ("signsgd", {"block_size": 16}),
    "signsgd-b32": ("signsgd", {"block_size": 32}),                               # the default before block 16
    "topk-0.04-warm10": ("topk", {"ratio": 0.04, "start_iter": 10}),
    # ResNet study: plain SGD (no momentum, 10x lr: the same effective step) isolates momentum
    "ssgd-nomom": ("none", {"opt.momentum": 0.0, "opt.lr_scale": 10.0}),
    "topk-nomom": ("topk", {"opt.momentum": 0.0, "opt.lr_scale": 10.0}),
    "signsgd-nomom": ("signsgd", {"opt.momentum": 0.0, "opt.lr_scale": 10.0}),
    "acpsgd-nomom": ("acpsgd", {"opt.momentum": 0.0, "opt.lr_scale": 10.0}),
    # DGC's momentum correction (bitscom.compressors.MomentumCorrection): momentum 0.9 applied
    # on each rank before compression, the SGD without momentum and with weight_decay/(1-0.9)
    # (opt.dgc); ssgd-mc isolates that change of algorithm with nothing compressed
    "ssgd-mc": ("none", {"mc": 0.9, "opt.dgc": True}),
    # AdamW's preconditioning on each rank before compression (study-only, text_lm)
    "ssgd-ladam": ("none", {"ladam": True, "opt.local_adam": True}),
    "topk-ladam": ("topk", {"ladam": True, "opt.local_adam": True}),
    "signsgd-ladam": ("signsgd", {"ladam": True, "opt.local_adam": True}),
    "acpsgd-ladam": ("acpsgd", {"ladam": True, "opt.local_adam": True}),
    "powersgd-ladam": ("powersgd", {"ladam": True, "opt.local_adam": True}),
    "topk-dgc": ("topk", {"mc": 0.9, "mc_masking": True, "opt.dgc": True}),     # + factor masking
    "topk-mc-nomask": ("topk", {"mc": 0.9, "mc_masking": False, "opt.dgc": True}),
    "signsgd-mc": ("signsgd", {"mc": 0.9, "opt.dgc": True}),
    "acpsgd-mc": ("acpsgd", {"mc": 0.9, "opt.dgc": True}),
    "signsgd-b16-mc": ("signsgd", {"block_size": 16, "mc": 0.9, "opt.dgc": True}),
    "acpsgd-r8-mc": ("acpsgd", {"rank": 8, "mc": 0.9, "opt.dgc": True}),
    # Top-k per tensor (DGC's layer-wise selection), with and without momentum correction
    "topk-pt": ("topk", {"per_tensor": True}),
    "topk-pt-mc": ("topk", {"per_tensor": True, "mc": 0.9, "mc_masking": False, "opt.dgc": True}),
    "topk-pt-dgc": ("topk", {"per_tensor": True, "mc": 0.9, "mc_masking": True, "opt.dgc": True}),
    # ResNet study: GroupNorm gains/biases (and all biases) left exact
    "topk-keep-gn": ("topk", {"exclude": "*.n1.*|*.n2.*|norm.*|*.bias"}),
    "signsgd-keep-gn": ("signsgd", {"exclude": "*.n1.*|*.n2.*|norm.*|*.bias"}),
    # AdamW study (text_lm): warm-ups, 1-bit Adam's frozen variance, tensors left uncompressed
    "acpsgd-warm10": ("acpsgd", {"start_iter": 10}),
    "acpsgd-r8-warm10": ("acpsgd", {"rank": 8, "start_iter": 10}),
    "acpsgd-r8-noef": ("acpsgd", {"rank": 8, "error_feedback": False}),
    "acpsgd-r8-warm30-fv30": ("acpsgd", {"rank": 8, "start_iter": 30, "opt.freeze_step": 30}),
    "topk-warm30": ("topk", {"start_iter": 30}),
    "topk-warm30-fv30": ("topk", {"start_iter": 30, "opt.freeze_step": 30}),
    "signsgd-warm30": ("signsgd", {"start_iter": 30}),
    "signsgd-warm30-fv30": ("signsgd", {"start_iter": 30, "opt.freeze_step": 30}),
    "signsgd-vote-warm30": ("signsgd", {"majority_vote": True, "block_size": None, "start_iter": 30}),
    "signsgd-vote-warm30-fv30": ("signsgd", {"majority_vote": True, "block_size": None, "start_iter": 30,
                                             "opt.freeze_step": 30}),
    "signsgd-vote-keep-norms": ("signsgd", {"majority_vote": True, "block_size": None,
                                            "exclude": "*.bias|*ln*"}),
    "signsgd-vote-keep-emb": ("signsgd", {"majority_vote": True, "block_size": None,
                                          "exclude": "*.bias|*ln*|tok.*|pos.*|head.*"}),
    "ssgd-fv30": ("none", {"opt.freeze_step": 30}),
    "topk-keep-norms": ("topk", {"exclude": "*.bias|*ln*"}),
    "topk-keep-emb": ("topk", {"exclude": "*.bias|*ln*|tok.*|pos.*|head.*"}),
    "signsgd-keep-norms": ("signsgd", {"exclude": "*.bias|*ln*"}),
    "signsgd-keep-emb": ("signsgd", {"exclude": "*.bias|*ln*|tok.*|pos.*|head.*"}),
    "acpsgd-keep-emb": ("acpsgd", {"exclude": "*.bias|*ln*|tok.*|pos.*|head.*"}),
}
DEFAULTS = ["ssgd", "fp16", "bf16", "lowbit", "powersgd", "acpsgd", "topk", "signsgd"]
SETS = {
    "defaults": DEFAULTS,
    "ef": ["ssgd", "lowbit-ef_none", "lowbit-ef", "lowbit-ef21", "lowbit-ef21_plus"],
    "sr": ["ssgd", "lowbit-rtn", "lowbit-sr"],
    "lowrank": ["ssgd", "powersgd-r1", "powersgd-r2", "powersgd-r4", "powersgd-r8", "powersgd-warm0",
                "powersgd-warm30", "acpsgd-r1", "acpsgd-r4", "acpsgd-r8", "acpsgd-warm30"],
    "sparse": ["ssgd", "topk-0.01", "topk-0.03", "topk-0.05", "signsgd", "signsgd-b64", "signsgd-pertensor",
               "signsgd-vote"],
    # why the biased compressors lose accuracy on the narrow GroupNorm ResNet (digits_resnet)
    "resnet": ["ssgd", "acpsgd", "acpsgd-r8", "topk", "topk-keep-gn", "topk-0.04-warm10", "signsgd",
               "signsgd-b16", "signsgd-keep-gn"],
    # ... and with momentum correction (with --sets dgc: the ResNet table of docs/convergence.md)
    "resnet-dgc": ["ssgd", "topk-pt", "topk-pt-mc", "topk-pt-dgc", "signsgd-b16-mc", "acpsgd-r8-mc"],
    # DGC's momentum correction against the defaults (SGD+momentum tasks: digits_cnn, digits_resnet)
    # (the defaults' own rows come from the default suite: same seeds, same S-SGD bit for bit)
    "dgc": ["ssgd", "ssgd-mc", "topk-dgc", "topk-mc-nomask", "signsgd-mc", "acpsgd-mc"],
    # why the biased compressors fall behind under AdamW, and what the literature's fixes buy
    # (text_lm only: the frozen variance replaces the task's AdamW; docs/convergence.md)
    "adamw": ["ssgd", "powersgd", "powersgd-warm0", "powersgd-r8", "acpsgd", "acpsgd-r8",
              "acpsgd-r8-warm10", "acpsgd-r8-noef", "acpsgd-r8-warm30-fv30", "acpsgd-keep-emb",
              "topk", "topk-warm30", "topk-warm30-fv30", "topk-keep-norms", "topk-keep-emb",
              "signsgd", "signsgd-b64", "signsgd-warm30", "signsgd-keep-emb", "signsgd-vote",
              "signsgd-vote-warm30", "signsgd-vote-warm30-fv30", "signsgd-vote-keep-norms",
              "signsgd-vote-keep-emb", "ssgd-fv30"],
}
RUN_FIELDS = ["task", "variant", "compressor", "settings", "seed", "steps", "world", "final_metric",
              "eval_loss", "test_acc", "train_loss_last", "bytes_sent", "dense_bytes", "ratio",
              "wall_s", "steps_per_s", "replicas_identical", "nonfinite", "fingerprint"]
CURVE_FIELDS = ["task", "variant", "seed", "step", "train_loss", "bytes_sent", "dense_bytes",
                "eval_loss", "test_acc"]


def parse_variant(text: str):
    """``label`` | ``name:k=v,k=v`` | ``label=name:k=v`` -> (label, registry name, settings)."""
    if text in VARIANTS:
        name, settings = VARIANTS[text]
        return text, name, dict(settings)
    label = None
    if "=" in text.split(":", 1)[0]:
        label, text = text.split("=", 1)
    name, _, rest = text.partition(":")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"variant setting {item!r} is not key=value (in {text!r})")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    if label is None:
        label = name + "".join(f"-{k}{v}" for k, v in settings.items())
    return label, name, settings


# ---- one training run (on every rank) ----------------------------------------------------
def _params_digest(model) -> torch.Tensor:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return torch.tensor(list(h.digest()[:8]), dtype=torch.int64)


def split_settings(settings: dict):
    """``(compressor settings, optimizer settings)``: keys ``opt.X`` are the optimizer's ``X``."""
    comp = {k: v for k, v in settings.items() if not k.startswith("opt.")}
    opt = {k[4:]: v for k, v in settings.items() if k.startswith("opt.")}
    return comp, opt


def _takes_seed(name) -> bool:
    """Whether the registry compressor ``name`` has a seed of its own: PowerSGD/ACP-SGD's
    initial factors (``seed``) or lowbit's stochastic-rounding base (``config.seed``)."""
    import bitscom
    built = bitscom.compressors.get(name)
    return hasattr(built, "seed") or hasattr(getattr(built, "config", None), "seed")


def build_compressor(name, settings, seed=None):
    """The variant's compressor; a setting ``exclude=PAT|PAT|...`` (``fnmatch`` patterns on
    parameter names, ``|``-separated) wraps it in :class:`bitscom.compressors.Exclude`: those
    tensors travel uncompressed. ``mc=M`` (and ``mc_masking=False``) wraps the result in
    :class:`bitscom.compressors.MomentumCorrection` with momentum ``M`` (pair it with
    ``opt.dgc=True``: the task's SGD then has no momentum of its own). ``ladam=True`` wraps it
    in the study-only ``conv_local_adam.LocalAdam`` (pair it with ``opt.local_adam=True``).

    ``seed`` (the run's training seed) becomes the compressor's own seed where it has one and
    the variant does not set it: 3 training seeds then also sample 3 initial low-rank factors
    (one seed of PowerSGD/ACP-SGD's Q alone moved ACP-SGD's GPT loss by ±2.5 points). Every
    rank passes the same training seed, so the compressor is identical on every rank."""
    import bitscom
    comp = dict(split_settings(settings)[0])
    if seed is not None and "seed" not in comp and _takes_seed(name):
        comp["seed"] = int(seed)
    exclude = comp.pop("exclude", None)
    mc, masking = comp.pop("mc", None), comp.pop("mc_masking", False)
    ladam = comp.pop("ladam", False)
    if isinstance(exclude, str):
        exclude = tuple(exclude.split("|"))
    built = bitscom.compressors.get(name, **comp)
    if exclude is not None:
        built = bitscom.compressors.Exclude(built, patterns=exclude)
    if mc is not None:
        built = bitscom.compressors.MomentumCorrection(built, momentum=mc, masking=masking)
    if ladam:                    # study-only (scripts/conv_local_adam.py); pair with opt.local_adam
        from conv_local_adam import LocalAdam
        built = LocalAdam(built)
    return built


def run_key(name, settings, seed=None) -> str:
    """What makes two variants train identically: the compressor's fingerprint (built for
    training seed ``seed``) + optimizer settings."""
    opt = split_settings(settings)[1]
    return build_compressor(name, settings, seed).fingerprint() + "".join(
        f";opt.{k}={opt[k]!r}" for k in sorted(opt))


def train_one(task, name, settings, seed, rank, world, eval_every):
    import bitscom
    torch.manual_seed(seed)
    model = task.make_model()
    base = task.make_optimizer(model, world, **split_settings(settings)[1])
    base_lrs = [g["lr"] for g in base.param_groups]
    opt = bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=build_compressor(name, settings, seed))
    torch.manual_seed(seed * 1000 + rank + 1)           # dropout masks differ per rank
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    losses, curve = [], []
    sent = dense = 0
    nonfinite = False
    t0 = time.perf_counter()
    for step in range(task.steps):
        for g, lr in zip(base.param_groups, base_lrs):
            g["lr"] = lr * task.lr_at(step)
        batch = task.batch(step, rank, world, gen)
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        stats = opt.comm_stats()
        sent += stats["step_bytes_sent"]
        dense += stats["step_dense_bytes"]
        losses.append(loss.item())
        nonfinite = nonfinite or not torch.isfinite(loss).item()
        if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == task.steps):
            curve.append((step + 1, sent, dense, task.evaluate(model)))
    wall = time.perf_counter() - t0
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    digests = [torch.zeros(8, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(digests, _params_digest(model))
    identical = all(torch.equal(d, digests[0]) for d in digests)
    return mean_losses.tolist(), curve, sent, dense, wall, identical, nonfinite


def _done(path):
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {(r["task"], r["variant"], int(r["seed"])) for r in csv.DictReader(f)}


def _append(path, fields, rows):
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:                          # keep an older file's columns (resume across versions)
        with open(path) as f:
            fields = next(csv.reader(f))
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)


def _record(out, task, task_name, label, name, settings, seed, world, losses, curve, sent, dense,
            wall, identical, nonfinite, eval_every, fingerprint=None):
    """Append one run's curve rows and its summary row (rank 0 only). The row keeps the
    compressor's full fingerprint: a label like "powersgd" means "the default of the day"
    (``fingerprint`` overrides it, for drivers whose runs are not a compressor)."""
    fingerprint = fingerprint or run_key(name, settings, seed)
    final = curve[-1][3]
    rows = []
    for s, b, d, e in curve:            # train loss: the mean since the last logged step
        window = losses[max(0, s - eval_every):s]
        rows.append({"task": task_name, "variant": label, "seed": seed, "step": s,
                     "train_loss": f"{sum(window) / len(window):.5f}",
                     "bytes_sent": b, "dense_bytes": d,
                     "eval_loss": f"{e['eval_loss']:.5f}", "test_acc": f"{e['test_acc']:.3f}"})
    _append(os.path.join(out, "curves.csv"), CURVE_FIELDS, rows)
    _append(os.path.join(out, "runs.csv"), RUN_FIELDS, [{
        "task": task_name, "variant": label, "compressor": name,
        "settings": ";".join(f"{k}={v}" for k, v in settings.items()), "seed": seed,
        "steps": task.steps, "world": world, "final_metric": f"{final[task.metric]:.5f}",
        "eval_loss": f"{final['eval_loss']:.5f}", "test_acc": f"{final['test_acc']:.3f}",
        "train_loss_last": f"{losses[-1]:.5f}", "bytes_sent": sent, "dense_bytes": dense,
        "ratio": f"{dense / sent:.4f}" if sent else "nan", "wall_s": f"{wall:.2f}",
        "steps_per_s": f"{task.steps / wall:.3f}", "replicas_identical": int(identical),
        "nonfinite": int(nonfinite), "fingerprint": fingerprint}])


def worker(rank, world, port, jobs, args):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tasks = {}
    try:
        for task_name, labels, name, settings, seed in jobs:
            if task_name not in tasks:
                tasks[task_name] = TASKS[task_name](**args.task_kwargs.get(task_name, {}))
            task = tasks[task_name]
            losses, curve, sent, dense, wall, identical, nonfinite = train_one(
                task, name, settings, seed, rank, world, args.eval_every)
            if rank != 0:
                continue
            final = curve[-1][3]
            metric = final[task.metric]
            for label in labels:
                _record(args.out, task, task_name, label, name, settings, seed, world, losses, curve,
                        sent, dense, wall, identical, nonfinite, args.eval_every)
            label = "/".join(labels)
            print(f"[conv] {task_name:14s} {label:24s} seed {seed}: {task.metric} {metric:.4f}  "
                  f"{dense / max(sent, 1):.2f}x fewer bytes  {wall:.0f}s"
                  f"{'' if identical else '  REPLICAS DIFFER'}", flush=True)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--sets", nargs="+", default=None, choices=list(SETS),
                    help="named variant sets (default: defaults ef sr)")
    ap.add_argument("--variants", nargs="+", default=None, help="variant labels or name:k=v,... specs")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per (task, variant) (3; --quick: 1)")
    ap.add_argument("--steps", type=int, default=None, help="override every task's step count")
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, 150 steps, the default compressors only (a smoke run)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--eval-every", type=int, default=50,
                    help="steps between held-out evaluations (rank 0; the CNN eval costs ~14 steps)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "convergence"))
    ap.add_argument("--plot-only", action="store_true", help="only redraw summary and PNGs from the CSVs")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds or 1
        args.steps = args.steps or 150
        args.sets = args.sets or ([] if args.variants else ["defaults"])
    args.seeds = args.seeds or 3
    args.task_kwargs = {t: ({"steps": args.steps} if args.steps else {}) for t in TASKS}
    return args


def _record_command(out, argv):
    """Append this invocation to ``out/command.txt`` (every command that added rows, in order)."""
    line = "python scripts/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = os.path.join(out, "command.txt")
    old = open(path).read() if os.path.exists(path) else ""
    if line not in old.splitlines():
        with open(path, "w") as f:
            f.write("".join(f"{c}\n" for c in old.splitlines() + [line]))


def unique_variants(labels, parse):
    """``parse(text)`` of each label, the first of each resulting label only (conv_adam.py too)."""
    variants, seen = [], set()
    for text in labels:
        v = parse(text)
        if v[0] not in seen:
            seen.add(v[0])
            variants.append(v)
    return variants


def _variants(args):
    """The requested variants, each once, checked before any rank is spawned."""
    labels = []
    for s in (args.sets or (["defaults", "ef", "sr"] if args.variants is None else [])):
        labels += SETS[s]
    labels += args.variants or []
    variants = unique_variants(labels, parse_variant)
    for label, name, settings in variants:     # fail before spawning: unknown names/settings
        build_compressor(name, settings)
        opt = split_settings(settings)[1]
        for t in args.tasks:
            unknown = sorted(set(opt) - OPT_TASKS.get(t, set()))
            if unknown:
                raise SystemExit(f"variant {label!r} sets optimizer options {unknown}, which task "
                                 f"{t!r} does not take (it takes {sorted(OPT_TASKS.get(t, ()))})")
    return variants


def _jobs(args, variants, done):
    """(task, labels, name, settings, seed) still to run.

    Variants that build the same compressor (e.g. "lowbit" and "lowbit-rtn" while nearest
    rounding is the default) train once and are recorded under every label.
    """
    by_print, groups = {}, []
    for label, name, settings in variants:
        key = run_key(name, settings)
        if key in by_print:
            by_print[key][0].append(label)
        else:
            by_print[key] = ([label], name, settings)
            groups.append(by_print[key])
    jobs = []
    for t in args.tasks:
        for seed in range(args.seeds):
            for labels, name, settings in groups:
                todo = [lb for lb in labels if (t, lb, seed) not in done]
                if todo:
                    jobs.append((t, todo, name, settings, seed))
    return jobs


def main(argv=None) -> int:
    args = _parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.plot_only:
        _record_command(args.out, argv)
        done = _done(os.path.join(args.out, "runs.csv"))
        jobs = _jobs(args, _variants(args), done)
        print(f"[conv] {len(jobs)} run(s) to do ({len(done)} already in {args.out}) on {args.world} "
              "gloo ranks", flush=True)
        if jobs:
            mp.spawn(worker, args=(args.world, _free_port(), jobs, args), nprocs=args.world, join=True)

    from conv_report import report
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
