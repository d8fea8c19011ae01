"""Summary table and plots of a convergence suite (``convergence.py`` writes the CSVs).

    python scripts/conv_report.py results/convergence     # rewrite summary.md and the PNGs

Statistics: each (task, variant) is compared with S-SGD *seed by seed* (same seed = same
initial weights and data order), so the reported Δ is the mean of paired differences, and
the spread is the half-range (max − min)/2 over seeds of the metric itself. The whole-run
byte ratio is Σ fp32 bytes / Σ bytes sent over every step of every seed, warm-up included,
both counted by the optimizer.
"""
from __future__ import annotations

import csv
import os
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BYTES_TARGET = {"none": 1.0, "fp16": 1.9, "bf16": 1.9, "lowbit": 3.5, "powersgd": 4.0,
                "acpsgd": 4.0, "topk": 8.0, "signsgd": 8.0}
ACC_MARGIN_PP = 0.5
LOSS_MARGIN = 0.02
EF_MODES = ["lowbit-ef_none", "lowbit-ef", "lowbit-ef21", "lowbit-ef21_plus"]
SR_SET = ["ssgd", "lowbit-rtn", "lowbit-sr"]
DEFAULTS = ["ssgd", "fp16", "bf16", "lowbit", "powersgd", "acpsgd", "topk", "signsgd"]


def _read(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def _metric_kind(task_rows):
    """'test_acc' (higher better) for classification tasks, 'eval_loss' for the LM."""
    return "eval_loss" if task_rows and task_rows[0]["task"].endswith("lm") else "test_acc"


def summarize(runs):
    """{task: [row dicts]} with mean, spread, paired Δ vs S-SGD, ratio, verdict per variant."""
    by = defaultdict(list)
    for r in runs:
        by[(r["task"], r["variant"])].append(r)
    out = defaultdict(list)
    for task in sorted({r["task"] for r in runs}):
        metric = _metric_kind([r for r in runs if r["task"] == task])
        base = {int(r["seed"]): float(r["final_metric"]) for r in by.get((task, "ssgd"), [])}
        variants = [v for (t, v) in by if t == task]
        order = {v: i for i, v in enumerate(DEFAULTS)}
        variants.sort(key=lambda v: (order.get(v, len(order)), v))
        for v in variants:
            rows = by[(task, v)]
            vals = [float(r["final_metric"]) for r in rows]
            sent = sum(int(r["bytes_sent"]) for r in rows)
            dense = sum(int(r["dense_bytes"]) for r in rows)
            ratio = dense / sent if sent else float("nan")
            paired = [float(r["final_metric"]) - base[int(r["seed"])] for r in rows
                      if int(r["seed"]) in base]
            delta = statistics.mean(paired) if paired else float("nan")
            base_mean = statistics.mean(base[int(r["seed"])] for r in rows
                                        if int(r["seed"]) in base) if paired else float("nan")
            rel = delta / base_mean if paired and metric == "eval_loss" else float("nan")
            name = rows[0]["compressor"]
            acc_ok = (delta >= -ACC_MARGIN_PP) if metric == "test_acc" else (rel <= LOSS_MARGIN)
            bytes_ok = ratio >= BYTES_TARGET.get(name, 1.0) - 1e-9
            out[task].append({
                "variant": v, "compressor": name, "settings": rows[0]["settings"], "n": len(rows),
                "mean": statistics.mean(vals), "spread": (max(vals) - min(vals)) / 2,
                "delta": delta, "rel": rel, "ratio": ratio, "metric": metric,
                "target_ratio": BYTES_TARGET.get(name, 1.0), "acc_ok": acc_ok and paired != [],
                "bytes_ok": bytes_ok,
                "steps_per_s": statistics.mean(float(r["steps_per_s"]) for r in rows),
                "identical": all(r["replicas_identical"] == "1" for r in rows),
                "steps": rows[0]["steps"]})
    return out


def markdown(summary, command=None) -> str:
    lines = ["# Convergence suite: each compressor against S-SGD", ""]
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
    lines += ["Δ: mean over seeds of (variant − S-SGD) with the same seed. Spread: half-range over "
              "seeds. Bytes: whole run (warm-up included), fp32 bytes / bytes sent, counted by the "
              f"optimizer. Targets: classification within {ACC_MARGIN_PP} pp of S-SGD, language model "
              f"within {LOSS_MARGIN:.0%} of its final loss; bytes ≥ the compressor's target.", ""]
    for task, rows in summary.items():
        metric = rows[0]["metric"]
        unit = "test accuracy %" if metric == "test_acc" else "final eval loss (nats/byte)"
        lines += [f"## {task} ({rows[0]['steps']} steps, {rows[0]['n']} seed(s))", "",
                  f"| variant | settings | {unit} | Δ vs S-SGD | bytes vs fp32 (target) | meets | "
                  "steps/s | replicas identical |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if metric == "test_acc":
                delta = f"{r['delta']:+.2f} pp"
            else:
                delta = f"{r['delta']:+.4f} ({r['rel']:+.1%})"
            meets = "—" if r["variant"] == "ssgd" else (
                ("yes" if r["acc_ok"] else "**no (accuracy)**") if r["bytes_ok"] else
                ("**no (bytes)**" if r["acc_ok"] else "**no (both)**"))
            spread = f"{r['mean']:.3f} ± {r['spread']:.3f}" if metric == "eval_loss" else \
                f"{r['mean']:.2f} ± {r['spread']:.2f}"
            lines.append(f"| {r['variant']} | {r['settings'] or 'default'} | {spread} | {delta} | "
                         f"{r['ratio']:.2f}× ({r['target_ratio']:g}×) | {meets} | "
                         f"{r['steps_per_s']:.1f} | {'yes' if r['identical'] else '**NO**'} |")
        lines.append("")
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------------
def _curves(curve_rows):
    """{(task, variant): {step: [(seed, train_loss, bytes, eval_loss, test_acc)]}}"""
    out = defaultdict(lambda: defaultdict(list))
    for r in curve_rows:
        out[(r["task"], r["variant"])][int(r["step"])].append(
            (int(r["seed"]), float(r["train_loss"]), int(r["bytes_sent"]), float(r["eval_loss"]),
             float(r["test_acc"])))
    return out


def _band(ax, xs, ys_by_x, label, **kw):
    import numpy as np
    mean = np.array([np.mean(v) for v in ys_by_x])
    lo = np.array([np.min(v) for v in ys_by_x])
    hi = np.array([np.max(v) for v in ys_by_x])
    line, = ax.plot(xs, mean, label=label, **kw)
    if any(len(v) > 1 for v in ys_by_x):
        ax.fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())


def plot_task(curves, task, variants, metric, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    key = 3 if metric == "eval_loss" else 4
    styles = ["-", "--", ":", "-."]       # > 10 variants: colours repeat, line styles tell apart
    for i, v in enumerate(variants):
        pts = curves.get((task, v))
        if not pts:
            continue
        steps = sorted(pts)
        kw = {"linestyle": styles[(i // 10) % len(styles)], "color": f"C{i % 10}"}
        _band(axes[0], steps, [[p[1] for p in pts[s]] for s in steps], v, **kw)
        _band(axes[1], steps, [[p[key] for p in pts[s]] for s in steps], v, **kw)
        mb = [sum(p[2] for p in pts[s]) / len(pts[s]) / 1e6 for s in steps]
        _band(axes[2], mb, [[p[key] for p in pts[s]] for s in steps], v, **kw)
    axes[0].set(xlabel="step", ylabel="train loss (mean over ranks)", yscale="log")
    ylabel = "eval loss (nats/byte)" if metric == "eval_loss" else "test accuracy %"
    axes[1].set(xlabel="step", ylabel=ylabel)
    axes[2].set(xlabel="MB sent per rank (cumulative)", ylabel=ylabel, xscale="log")
    if metric == "test_acc":            # the interesting part: the last few points
        for ax in axes[1:]:
            ax.set_ylim(bottom=max(ax.get_ylim()[0], 80), top=100)
    for ax in axes:
        ax.grid(alpha=0.3)
    if len(variants) > 10:               # outside the axes, so it hides no curve
        axes[2].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    else:
        axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ef_summary(summary, path):
    """The seed's EF modes × models summary: final loss relative to S-SGD, and throughput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    tasks = [t for t, rows in summary.items() if any(r["variant"] in EF_MODES for r in rows)]
    if not tasks:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(EF_MODES)
    for i, mode in enumerate(EF_MODES):
        rel, thr = [], []
        for t in tasks:
            rows = {r["variant"]: r for r in summary[t]}
            r, base = rows.get(mode), rows.get("ssgd")
            if r and base and r["metric"] == "eval_loss":
                rel.append(r["mean"] / base["mean"])
            elif r and base:
                rel.append(r["delta"])
            else:
                rel.append(np.nan)
            thr.append(r["steps_per_s"] if r else np.nan)
        x = np.arange(len(tasks)) + i * width
        axes[0].bar(x, rel, width, label=mode.replace("lowbit-", ""))
        axes[1].bar(x, thr, width, label=mode.replace("lowbit-", ""))
    for ax in axes:
        ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2)
        ax.set_xticklabels(tasks)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("LM: final loss / S-SGD's;  classifiers: Δ test acc (pp)")
    axes[0].axhline(0, color="k", lw=0.5)
    axes[1].set_ylabel("steps/s (2 gloo ranks, shared CPU: indicative)")
    axes[0].legend(fontsize=8)
    fig.suptitle("low-bit all-reduce (4 bit): error-feedback modes × models")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(out_dir: str, command: str | None = None) -> str:
    runs = _read(os.path.join(out_dir, "runs.csv"))
    if not runs:
        print(f"[conv] no runs in {out_dir}")
        return ""
    summary = summarize(runs)
    if command is None and os.path.exists(os.path.join(out_dir, "command.txt")):
        with open(os.path.join(out_dir, "command.txt")) as f:
            command = f.read().strip()
    text = markdown(summary, command)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[conv] matplotlib missing: summary.md only (pip install matplotlib)")
        print(text)
        return text
    curves = _curves(_read(os.path.join(out_dir, "curves.csv")))
    sets = {"defaults": DEFAULTS, "ef": ["ssgd"] + EF_MODES, "sr": SR_SET}
    for task, rows in summary.items():
        present = [r["variant"] for r in rows]
        metric = rows[0]["metric"]
        shown = set()
        for set_name, members in sets.items():
            vs = [v for v in members if v in present]
            if len(vs) >= 2:
                shown.update(vs)
                title = {"defaults": f"{task}: every compressor at its default vs S-SGD",
                         "ef": f"{task}: low-bit error-feedback modes vs S-SGD",
                         "sr": f"{task}: 4-bit SR vs RTN vs fp32 (S-SGD), end to end"}[set_name]
                plot_task(curves, task, vs, metric, os.path.join(out_dir, f"{task}_{set_name}.png"), title)
        rest = ["ssgd"] + [v for v in present if v not in shown and v != "ssgd"]
        if len(rest) >= 2:
            plot_task(curves, task, rest, metric, os.path.join(out_dir, f"{task}_variants.png"),
                      f"{task}: other variants vs S-SGD")
    plot_ef_summary(summary, os.path.join(out_dir, "ef_modes_summary.png"))
    print(text)
    return text


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(HERE), "results", "convergence"))
