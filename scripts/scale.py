#!/usr/bin/env python3
"""Predicted speed-up over S-SGD at 8-1024 ranks, from bitscom's cost model (no GPU, no ranks).

    python scripts/scale.py                       # full grid -> docs/scale_speedup.csv/.png
    python scripts/scale.py --quick --out /tmp/s  # two models, three world sizes (tests)

For each model the per-layer gradient shapes come from the real architecture built on the
``meta`` device (scripts/models.py for the CNNs, ``transformers`` configs for BERT and GPT;
no weights, no download), bucketed exactly as bitscom buckets them
(``bitscom.buckets.plan_buckets``, 25 MB). Each bucket's rounds come from
``bitscom.cost.rounds_for`` (with the bucket's tensor shapes, so PowerSGD/ACP-SGD see the
real matrices) and their time from ``bitscom.cost.round_seconds`` on a flat ring of
``world`` ranks at 1/10/25/100 Gbit/s with ``--latency-us`` per message.

Step time model (stated, simple): ``fwd + max(bwd, comm_overlappable) + comm_last + codec``:
the forward is 1/3 of the compute, communication of every bucket but the last (the first
layers' gradients) can hide under the backward pass (wait-free back-propagation, as DDP and
bitscom do), and codec time runs on the same GPU so it never hides. Codec time is
``elements x CODEC_S_PER_ELEM[compressor]`` (a stated parameter; Top-k and Sign-SGD also
decode one contribution per rank, so their decode grows with ``world``).

GPU compute per step is NOT measured here (no GPU in this session): it is the per-GPU
throughput in :data:`THROUGHPUT` (approximate published figures, sources in the table;
override with ``--compute-ms model=ms``).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
GBITS = (1, 10, 25, 100)
COMPRESSORS = {            # column name -> (registry name, settings)
    "ssgd": ("none", {}),
    "fp16": ("fp16", {}),
    "lowbit": ("lowbit", {}),            # 4 bits, bitscom's default block
    "powersgd": ("powersgd", {"rank": 4}),
    "acpsgd": ("acpsgd", {"rank": 4}),
    "topk": ("topk", {"ratio": 0.01}),
    "signsgd": ("signsgd", {}),
    "auto": ("auto", {}),                # per bucket, what compression="auto" picks (auto_cell)
}
# Codec seconds per gradient element on a V100-class GPU (~800 GB/s): a pass over fp32 data
# costs ~5e-12 s/element; the figures count the passes each codec makes (cast: 2; low-bit
# quantize+pack+unpack+EF: ~8; low-rank: two skinny matmuls + orthogonalization + EF: ~10;
# Top-k selection is ~20 passes on GPUs). "decode" is per element received per rank.
CODEC_S_PER_ELEM = {"ssgd": 0.0, "fp16": 1e-11, "lowbit": 4e-11, "powersgd": 5e-11, "acpsgd": 5e-11,
                    "topk": 1e-10, "signsgd": 3e-11}
DECODE_S_PER_ELEM_PER_RANK = {"topk": 1e-11, "signsgd": 5e-12}
# ``auto`` is not a column of COMPRESSORS: per bucket it takes the candidate with the smallest
# codec + communication time, as ``compression="auto"`` does (bitscom.cost.auto.decide: ties go
# to the earlier candidate, plain all-reduce first), from the candidates it allows the model's
# optimizer (Adam-type for BERT/GPT: ADAM_SAFE; SGD for the CNNs: SGD_SAFE). Codec seconds per
# element by registry name, as above.
AUTO_CODEC_S_PER_ELEM = {"none": 0.0, "fp16": 1e-11, "bf16": 1e-11, "lowbit": 4e-11, "powersgd": 5e-11}
# (samples/s per GPU, batch per GPU, source). Approximate public figures for mixed-precision
# training on one V100 (the ACP-SGD paper's GPU generation); treat them as +-30%.
THROUGHPUT = {
    "resnet50": (1200.0, 64, "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch, V100 AMP (~1.2k img/s)"),
    "resnet152": (480.0, 64, "ResNet-152 ~2.8x ResNet-50's FLOPs (11.5 vs 4.1 GFLOPs/img) at the same rate"),
    "vgg16": (400.0, 64, "VGG-16 15.5 GFLOPs/img, ~3x ResNet-50's cost per image on V100"),
    "bert_base": (200.0, 32, "NVIDIA DeepLearningExamples BERT-base pretraining seq 128, V100 AMP (~200 seq/s)"),
    "bert_large": (65.0, 16, "NVIDIA DeepLearningExamples BERT-large pretraining seq 128, V100 AMP (~65 seq/s)"),
}
# GPT (SDP4Bit's sizes, seq 2048): compute = 6 x params x tokens FLOPs at GPT_FLOPS achieved
# (A100 bf16 peak is 312 TFLOP/s; Megatron-LM reports ~40% of peak for these sizes).
GPT_SIZES = {   # SDP4Bit's model cards (/work/shared/seeds/001_*): layers, hidden
    "gpt_125m": (12, 768), "gpt_350m": (24, 1024), "gpt_1.3b": (24, 2048), "gpt_6.7b": (32, 4096)}
GPT_SEQ, GPT_TOKENS_PER_GPU, GPT_FLOPS = 2048, 8 * 2048, 120e12   # 120 TFLOP/s achieved, A100 bf16
FIELDS = ["model", "params", "buckets", "world", "gbit", "compressor", "bytes_per_rank", "comm_s",
          "codec_s", "compute_s", "step_s", "speedup_vs_ssgd", "compute_source"]


def _meta_params(name: str):
    """(named parameters on the meta device, source text)."""
    with torch.device("meta"):
        if name in ("resnet50", "resnet152", "vgg16"):
            import models
            model, _ = models._cnn(name)
            return list(model.named_parameters())
        if name.startswith("bert"):
            from transformers import BertConfig, BertForPreTraining
            kw = {} if name == "bert_base" else dict(hidden_size=1024, num_hidden_layers=24,
                                                      num_attention_heads=16, intermediate_size=4096)
            return list(BertForPreTraining(BertConfig(**kw)).named_parameters())
        if name in GPT_SIZES:
            from transformers import GPT2Config, GPT2LMHeadModel
            layers, hidden = GPT_SIZES[name]
            cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), n_positions=GPT_SEQ)
            return list(GPT2LMHeadModel(cfg).named_parameters())
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(all_models())}")


def all_models():
    return list(THROUGHPUT) + list(GPT_SIZES)


def compute_seconds(name: str, params: int, overrides: dict) -> tuple:
    if name in overrides:
        return overrides[name] / 1e3, "--compute-ms"
    if name in THROUGHPUT:
        rate, bs, src = THROUGHPUT[name]
        return bs / rate, f"bs {bs} at {rate:g}/s (THROUGHPUT)"
    secs = 6 * params * GPT_TOKENS_PER_GPU / GPT_FLOPS
    return secs, f"6 N x {GPT_TOKENS_PER_GPU} tok / {GPT_FLOPS / 1e12:g} TFLOP/s"


def bucket_shapes(named, threshold_mb: float = 25.0):
    from bitscom.buckets import plan_buckets
    return [[s.shape for s in lay.slots] for lay in plan_buckets(named, int(threshold_mb * 2**20))]


def auto_candidates(model: str) -> tuple:
    """What ``compression="auto"`` may choose from for ``model``'s usual optimizer."""
    from bitscom.cost.auto import ADAM_SAFE, SGD_SAFE
    return SGD_SAFE if model in ("resnet50", "resnet152", "vgg16") else ADAM_SAFE


def auto_cell(buckets, candidates, world, gbit, latency_s):
    """(bytes per rank, per-bucket seconds, codec seconds) of ``auto``: per bucket the candidate
    with the smallest codec + communication time (first one on ties)."""
    from bitscom.cost import Link, Topology, round_seconds, rounds_for
    from bitscom.cost.auto import decide
    topo = Topology(world, intra=Link.from_gbit(gbit, latency_s), inter=Link.from_gbit(gbit, latency_s))
    nbytes, secs, codec = 0, [], 0.0
    for shapes in buckets:
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        options = []
        for comp in candidates:
            rounds = rounds_for(comp, numel, world, shapes=[tuple(s) for s in shapes])
            c = numel * AUTO_CODEC_S_PER_ELEM[comp.name]
            options.append((sum(r.nbytes for r in rounds), sum(round_seconds(r, topo) for r in rounds), c))
        b, t, c = options[decide([t + c for _, t, c in options])]
        nbytes, codec = nbytes + b, codec + c
        secs.append(t)
    return nbytes, secs, codec


def comm_and_codec(buckets, comp_col, world, gbit, latency_s):
    """(bytes per rank, per-bucket comm seconds, codec seconds) for one cell."""
    import bitscom.compressors as C
    from bitscom.cost import Link, Topology, round_seconds, rounds_for
    reg, kw = COMPRESSORS[comp_col]
    comp = C.get(reg, **kw)
    topo = Topology(world, intra=Link.from_gbit(gbit, latency_s), inter=Link.from_gbit(gbit, latency_s))
    nbytes, secs, codec = 0, [], 0.0
    for shapes in buckets:
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        rounds = rounds_for(comp, numel, world, shapes=[tuple(s) for s in shapes])
        nbytes += sum(r.nbytes for r in rounds)
        secs.append(sum(round_seconds(r, topo) for r in rounds))
        codec += numel * CODEC_S_PER_ELEM[comp_col]
        codec += numel * world * DECODE_S_PER_ELEM_PER_RANK.get(comp_col, 0.0)
    return nbytes, secs, codec


def step_seconds(compute_s, bucket_secs, codec_s):
    """fwd + max(bwd, comm of all buckets but the last) + last bucket's comm + codec."""
    fwd, bwd = compute_s / 3, compute_s * 2 / 3
    last = bucket_secs[-1] if bucket_secs else 0.0
    return fwd + max(bwd, sum(bucket_secs) - last) + last + codec_s


def predict(models_, worlds, gbits, comps, latency_s=25e-6, overrides=None):
    rows = []
    for name in models_:
        named = _meta_params(name)
        params = sum(p.numel() for _, p in named)
        buckets = bucket_shapes(named)
        compute_s, src = compute_seconds(name, params, overrides or {})
        for world in worlds:
            for gbit in gbits:
                base = None
                for c in ["ssgd"] + [c for c in comps if c != "ssgd"]:
                    nbytes, secs, codec = (auto_cell(buckets, auto_candidates(name), world, gbit, latency_s)
                                           if c == "auto" else comm_and_codec(buckets, c, world, gbit, latency_s))
                    step = step_seconds(compute_s, secs, codec)
                    base = step if c == "ssgd" else base
                    rows.append({"model": name, "params": params, "buckets": len(buckets), "world": world,
                                 "gbit": gbit, "compressor": c, "bytes_per_rank": nbytes,
                                 "comm_s": f"{sum(secs):.6g}", "codec_s": f"{codec:.6g}",
                                 "compute_s": f"{compute_s:.6g}", "step_s": f"{step:.6g}",
                                 "speedup_vs_ssgd": f"{base / step:.4g}", "compute_source": src})
    return rows


FIGURE_MODELS = ("bert_base", "gpt_1.3b")
FIGURE_GBITS = (1, 10, 100)
LABELS = {"fp16": "fp16", "lowbit": "low-bit 4-bit", "powersgd": "PowerSGD rank 4",
          "acpsgd": "ACP-SGD rank 4", "topk": "Top-k 1%", "signsgd": "Sign-SGD", "auto": "auto"}


def plot(rows, path):
    """The README's picture: speed-up over S-SGD vs ranks for BERT-base and GPT-1.3B at 1, 10
    and 100 Gbit/s (whichever of them ``rows`` holds), a legend in every panel; every other
    cell is in the CSV."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    have_models = {r["model"] for r in rows}
    models_ = [m for m in FIGURE_MODELS if m in have_models] or list(dict.fromkeys(r["model"] for r in rows))[:2]
    have_gbits = {r["gbit"] for r in rows}
    gbits = [g for g in FIGURE_GBITS if g in have_gbits] or sorted(have_gbits)[:3]
    comps = [c for c in dict.fromkeys(r["compressor"] for r in rows) if c != "ssgd"]
    fig, axes = plt.subplots(len(models_), len(gbits), figsize=(4.6 * len(gbits), 3.8 * len(models_)),
                             squeeze=False, sharex=True)
    for i, m in enumerate(models_):
        for j, g in enumerate(gbits):
            ax = axes[i][j]
            for c in comps:
                pts = sorted((r["world"], float(r["speedup_vs_ssgd"])) for r in rows
                             if r["model"] == m and r["gbit"] == g and r["compressor"] == c)
                style = dict(color="black", lw=2.4, marker="o") if c == "auto" else dict(marker=".", lw=1.3)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS.get(c, c), **style)
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m.replace('_', '-')}, {g} Gbit/s", fontsize=11)
            ax.grid(True, which="major", alpha=0.3)
            ax.tick_params(labelsize=9)
            if j == 0:
                ax.set_ylabel("predicted speed-up over S-SGD", fontsize=10)
            if i == len(models_) - 1:
                ax.set_xlabel("ranks", fontsize=10)
            ax.legend(fontsize=7.5, loc="best", framealpha=0.85)
    fig.suptitle("bitscom cost model: predicted speed-up over the fp32 all-reduce (a model, not a measurement; "
                 "every model and link in scale_speedup.csv)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_compute_ms(entries, models) -> dict:
    """``{model: ms}`` from ``--compute-ms`` entries ``model=ms``. A bad entry is a ValueError
    naming it and what is allowed (the format, the model names, a finite ms > 0): ``garbage``
    used to end in a traceback, ``nosuchmodel=5`` was silently ignored and ``resnet50=-1``
    predicted with a negative compute time.

    Example::

        parse_compute_ms(["resnet50=40"], all_models())     # {'resnet50': 40.0}
    """
    from bitscom.validate import choice, number
    out = {}
    for entry in entries:
        name, sep, text = entry.partition("=")
        if not sep:
            raise ValueError(f"--compute-ms entry {entry!r} is not MODEL=MS (e.g. resnet50=40); "
                             f"MODEL is one of {', '.join(models)}")
        choice(f"the model of --compute-ms entry {entry!r}", name, tuple(models))
        try:
            ms = float(text)
        except ValueError:
            ms = text                 # no number: number() refuses it, naming it
        out[name] = number(f"the milliseconds of --compute-ms entry {entry!r}", ms, minimum=0,
                           inclusive=False, finite=True)
    return out


def wait_for_cost(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            import bitscom.cost  # noqa: F401
            return
        except ImportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "docs"))
    ap.add_argument("--quick", action="store_true", help="resnet50 + bert_base, 8/64/1024 ranks, 1 and 100 Gbit/s")
    ap.add_argument("--models", nargs="*", default=None, choices=all_models(), metavar="MODEL",
                    help=f"models to predict (default: all): {', '.join(all_models())}")
    ap.add_argument("--latency-us", type=float, default=25.0, help="per-message latency (alpha)")
    ap.add_argument("--compute-ms", nargs="*", default=[], metavar="MODEL=MS",
                    help="measured compute per step in ms (> 0) replacing THROUGHPUT's, e.g. resnet50=40")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    wait_for_cost(0)
    from bitscom.validate import number
    try:
        overrides = parse_compute_ms(a.compute_ms, all_models())
        number("--latency-us", a.latency_us, minimum=0, finite=True)
    except ValueError as err:
        ap.error(str(err))
    models_ = a.models or (["resnet50", "bert_base"] if a.quick else all_models())
    worlds, gbits = ((8, 64, 1024), (1, 100)) if a.quick else (WORLDS, GBITS)
    rows = predict(models_, worlds, gbits, list(COMPRESSORS), a.latency_us * 1e-6, overrides)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "scale_speedup.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows)")
    if not a.no_plot:
        plot(rows, os.path.join(a.out, "scale_speedup.png"))
        print(f"wrote {os.path.join(a.out, 'scale_speedup.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
