#!/usr/bin/env python3
"""Summarize benchmark CSVs: a markdown table and PNG plots.

    python scripts/plot_perf.py results/batch/perf.csv --out results/batch
    python scripts/plot_perf.py --mnist results/batch/mnist.csv --out results/batch

From perf.py's CSV: ``step_time.png`` (step time per compressor and bandwidth, with the 95%
CI and the ideal time max(compute, bytes/bandwidth) as a marker), ``speedup.png`` (speed-up
over DDP S-SGD, ``opt=ssgd``, of the same model, batch, world size, threshold and bandwidth)
and ``summary.md``. From mnist.py's per-epoch CSV: ``loss_vs_time.png``.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections import OrderedDict, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _f(x, default=float("nan")):
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def load(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _bw_key(bw):
    import cluster
    return float("inf") if bw in ("", "none") else cluster.parse_rate(bw)


def _bw_text(bw):
    """'1gbit' -> '1 Gbit/s' for axis labels; anything unparsed is shown as given."""
    for unit, text in (("gbit", "Gbit/s"), ("mbit", "Mbit/s")):
        if bw.endswith(unit) and bw[:-len(unit)].replace(".", "", 1).isdigit():
            return f"{bw[:-len(unit)]} {text}"
    return "unshaped" if bw in ("", "none") else bw


def config_key(r):
    """Rows comparable to each other: everything but the compressor and its settings."""
    return (r["dnn"], r["bs"], r.get("seq_len", ""), r["nworkers"], r.get("ranks_per_node", ""),
            r["threshold_mb"], r["bandwidth"])


def label(r):
    o = r["opt"]
    if o in ("powersgd", "acpsgd", "ddp_powersgd", "ddp_acpsgd"):
        return f"{o} r{r['rank']}"
    if o in ("lowbit", "ddp_lowbit"):
        return f"{o} {r['bits']}b"
    if o in ("topk", "ddp_topk"):
        return f"{o} {r['ratio']}"
    return o


_NAMES = {"fp16": "fp16", "bf16": "bf16", "lowbit": "lowbit", "powersgd": "PowerSGD", "acpsgd": "ACP-SGD",
          "topk": "Top-k", "signsgd": "Sign-SGD", "auto": 'compression="auto"', "dgc": "DGC",
          "onebitadam": "OneBitAdam", "zeroone": "ZeroOneAdam", "diloco": "DiLoCo"}


def display_name(r):
    """The legend text a reader knows: torch's hooks named as torch's, bitscom's as the README does.

    ``label()`` stays the key that matches rows across runs; this is only what a plot shows.
    """
    o = r["opt"]
    if o == "ssgd":
        return "DDP S-SGD (fp32)"
    if o == "ddp_fp16":
        return "torch DDP fp16 hook"
    if o == "ddp_powersgd":
        return f"torch PowerSGD hook, rank {r['rank']}"
    via_hook = o.startswith("ddp_")
    base = o[4:] if via_hook else o
    text = "bitscom " + _NAMES.get(base, base)
    if base in ("powersgd", "acpsgd") and r.get("rank"):
        text += f" rank {r['rank']}"
    elif base == "lowbit" and r.get("bits"):
        text += f" {r['bits']}-bit"
    elif base == "topk" and r.get("ratio"):
        text += f" {_f(r['ratio']) * 100:g}%"
    return text + (" (DDP hook)" if via_hook else "")


def latest_ok(rows):
    """The last successful row per (config, label): reruns replace earlier measurements."""
    out = OrderedDict()
    for r in rows:
        if r.get("status") == "ok":
            out[(config_key(r), label(r))] = r
    return list(out.values())


def speedups(rows):
    base = {config_key(r): _f(r["iter_time_s"]) for r in rows if r["opt"] == "ssgd"}
    return {id(r): base[config_key(r)] / _f(r["iter_time_s"]) for r in rows if config_key(r) in base}


def speedup_ci(rows):
    """95% CI half-width of each speed-up b/t, from the step times' CIs (first-order error
    propagation: relative errors add in quadrature); 0 where a CI is missing."""
    base = {config_key(r): r for r in rows if r["opt"] == "ssgd"}
    out = {}
    for r in rows:
        b = base.get(config_key(r))
        if b is None:
            continue
        rel = [_f(x["iter_ci95_s"], 0.0) / _f(x["iter_time_s"]) for x in (b, r)]
        rel = [0.0 if math.isnan(e) else e for e in rel]
        out[id(r)] = _f(b["iter_time_s"]) / _f(r["iter_time_s"]) * math.hypot(*rel) if r is not b else \
            0.0
    return out


def summary_table(rows) -> str:
    rows = latest_ok(rows)
    sp = speedups(rows)
    lines = ["| model | ranks | bandwidth | opt | step time (ms, 95% CI) | speed-up vs S-SGD "
             "| MB/step/rank | compute (ms) | ideal (ms) | samples/s | codec (ms) | bound (ms) | step/bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(rows, key=lambda r: (r["dnn"], int(r["nworkers"]), _bw_key(r["bandwidth"]), label(r) != "ssgd",
                                       label(r)))
    for r in rows:
        s = sp.get(id(r))
        lines.append(
            f"| {r['dnn']} bs{r['bs']}{' L' + r['seq_len'] if r.get('seq_len') else ''} | {r['nworkers']} "
            f"| {r['bandwidth']} | {label(r)} | {_f(r['iter_time_s']) * 1e3:.0f} ± {_f(r['iter_ci95_s']) * 1e3:.0f} "
            f"| {'%.2fx' % s if s else '–'} | {int(r['bytes_sent']) / 1e6:.1f} "
            f"| {_f(r['compute_time_s']) * 1e3:.0f} | {_f(r['ideal_time_s']) * 1e3:.0f} "
            f"| {_f(r['throughput']):.2f} | {_ms(r.get('codec_s'))} | {_ms(r.get('bound_s'))} "
            f"| {_or_dash(r.get('step_over_bound'), '.2f')} |")
    return "\n".join(lines) + "\n"


def _or_dash(x, spec: str) -> str:
    """``x`` formatted, or '–' where the row has none (a CSV from before perf.py's codec columns:
    codec (ms) = codec_s, bound (ms) = max(compute + codec, wire), step/bound)."""
    v = _f(x)
    return "–" if math.isnan(v) else format(v, spec)


def _ms(seconds) -> str:
    """Seconds as ms: whole from 10 ms, one decimal below (a 2 ms codec is not '0' or '2')."""
    v = _f(seconds) * 1e3
    return _or_dash(v, ".0f" if v >= 10 or v == 0 else ".1f")


def _groups(rows):
    g = defaultdict(list)
    for r in rows:
        g[(r["dnn"], r["bs"], r.get("seq_len", ""), r["nworkers"], r["threshold_mb"])].append(r)
    return g


def plot_perf(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = latest_ok(rows)
    sp = speedups(rows)
    sp_ci = speedup_ci(rows)
    groups = _groups(rows)
    if not groups:
        return []
    files = []
    for what in ("step_time", "speedup"):
        fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.5), squeeze=False)
        for ax, (key, grp) in zip(axes[0], sorted(groups.items())):
            bws = sorted({r["bandwidth"] for r in grp}, key=_bw_key)
            labels = sorted({label(r) for r in grp}, key=lambda s: (s != "ssgd", s))
            shown = {label(r): display_name(r) for r in grp}
            width = 0.8 / max(1, len(labels))
            for j, lab in enumerate(labels):
                xs, ys, es, ideal = [], [], [], []
                for i, bw in enumerate(bws):
                    r = next((r for r in grp if r["bandwidth"] == bw and label(r) == lab), None)
                    if r is None:
                        continue
                    x = i - 0.4 + width * (j + 0.5)
                    if what == "step_time":
                        xs.append(x)
                        ys.append(_f(r["iter_time_s"]) * 1e3)
                        es.append(_f(r["iter_ci95_s"], 0) * 1e3)
                        ideal.append(_f(r["ideal_time_s"]) * 1e3)
                    elif id(r) in sp:
                        xs.append(x)
                        ys.append(sp[id(r)])
                        es.append(sp_ci[id(r)])
                if not xs:
                    continue
                if what == "step_time":
                    ax.bar(xs, ys, width, yerr=[0 if math.isnan(e) else e for e in es], label=shown[lab], capsize=2)
                    ax.scatter(xs, ideal, marker="_", s=200, color="black", zorder=3,
                               label="ideal max(compute, bytes/bw)" if j == 0 else None)
                else:
                    ax.bar(xs, ys, width, yerr=es, label=shown[lab], capsize=2)
            ax.set_xticks(range(len(bws)))
            ax.set_xticklabels([_bw_text(b) for b in bws])
            dnn, bs, seq, n, thr = key
            batch = f"batch {bs} x {seq} tokens" if seq else f"batch {bs}"
            ax.set_title(f"{dnn}, {batch} per rank, {n} ranks, {_f(thr):g} MB buckets")
            ax.set_xlabel("link bandwidth (emulated)")
            if what == "step_time":
                ax.set_ylabel("step time (ms)")
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="gray", lw=0.8)
                ax.set_ylabel("speed-up over DDP S-SGD")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"{what}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def plot_mnist(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = defaultdict(list)
    for r in rows:
        runs[(r["opt"], r.get("bandwidth", ""), r.get("nworkers", ""))].append(r)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for (_opt, bw, n), rs in sorted(runs.items()):
        rs = sorted(rs, key=lambda r: int(r["epoch"]))
        t = [_f(r["elapsed_s"]) for r in rs]
        lab = f"{display_name(rs[0])} ({n} ranks{', ' + bw if bw and bw != 'none' else ''})"
        a1.plot(t, [_f(r["train_loss"]) for r in rs], marker="o", label=lab)
        a2.plot(t, [100 * _f(r["test_acc"]) for r in rs], marker="o", label=lab)
    a1.set_xlabel("wall time (s)")
    a1.set_ylabel("training loss")
    a1.set_yscale("log")
    a2.set_xlabel("wall time (s)")
    a2.set_ylabel("test accuracy (%)")
    a1.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "loss_vs_time.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", help="perf.py CSV")
    ap.add_argument("--mnist", default=None, help="mnist.py per-epoch CSV")
    ap.add_argument("--out", default=None, help="folder for PNGs and summary.md (default: the CSV's)")
    ap.add_argument("--no-plots", action="store_true", help="only the markdown table")
    a = ap.parse_args(argv)
    if not a.csv and not a.mnist:
        ap.error("give a perf CSV and/or --mnist CSV")
    out = a.out or os.path.dirname(os.path.abspath(a.csv or a.mnist))
    os.makedirs(out, exist_ok=True)
    files = []
    if a.csv:
        rows = load(a.csv)
        table = summary_table(rows)
        with open(os.path.join(out, "summary.md"), "w") as f:
            f.write(table)
        print(table)
        files.append(os.path.join(out, "summary.md"))
        if not a.no_plots:
            files += plot_perf(rows, out)
    if a.mnist and not a.no_plots:
        files += plot_mnist(load(a.mnist), out)
    print("wrote " + ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
