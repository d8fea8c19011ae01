"""The FSDP2 / HSDP measurement tools (scripts/fsdp_bench.py, scripts/fsdp_report.py) and the
plain-FSDP2 weights path of examples/hsdp_gpt.py that they drive, on 2 gloo ranks.

Reference: stock FSDP2 (the ``exact`` group) in the same run, same init and batches."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("scripts", "examples"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import fsdp_report  # noqa: E402


def _bench(rank, world, out):
    import fsdp_bench
    return fsdp_bench.main(["--mesh", "1x2", "--dim", "32", "--layers", "2", "--steps", "6", "--lr", "3e-3",
                            "--curve-every", "3", "--groups", "exact,w8,wd4,g4w8", "--out", out])


def test_plain_fsdp2_weight_groups_train_like_exact_and_send_fewer_bytes(pools, tmp_path):
    """8-bit blockwise and 4-bit difference all-gathers: held-out loss within 1% of stock FSDP2
    after 6 AdamW steps, the all-gather bytes below the bf16 baseline, the same rows on every rank."""
    out = str(tmp_path / "bench")
    results = pools.run(2, _bench, out, timeout=300)
    def same(rows):                                            # timing and rank 0's curve aside
        return [{k: v for k, v in r.items() if k not in ("seconds_per_step", "curve")} for r in rows]
    assert same(results[0]) == same(results[1])               # every rank reports the same numbers
    rows = {r["group"]: r for r in results[0]}
    assert rows["exact"]["all_gather_bytes_per_step"] == 0     # stock FSDP2: no bitscom handle
    for name in ("w8", "wd4", "g4w8"):
        r = rows[name]
        assert abs(r["held_out_loss"] / rows["exact"]["held_out_loss"] - 1) < 0.01, (name, r)
        assert 0 < r["all_gather_bytes_per_step"] < r["all_gather_fp_bytes_per_step"], (name, r)
    # 4-bit differences send fewer bytes than 8-bit blocks
    assert rows["wd4"]["all_gather_bytes_per_step"] < rows["w8"]["all_gather_bytes_per_step"]
    summary = {s["group"]: s for s in fsdp_report.main([out, "--out", str(tmp_path / "report")])}
    assert set(summary) == {"w8", "wd4", "g4w8"}
    w8 = rows["w8"]
    assert summary["w8"]["counted_bytes_x_fewer"] == pytest.approx(
        w8["all_gather_fp_bytes_per_step"] / w8["all_gather_bytes_per_step"], abs=0.01)
    assert os.path.exists(tmp_path / "report" / "fsdp_gpt_summary.csv")
    with open(os.path.join(out, "fsdp_curve.csv")) as f:
        assert len(f.read().strip().splitlines()) == 1 + 4 * 2    # header + 4 groups x steps 3 and 6


def test_report_compares_each_group_with_exact_of_the_same_seed_and_mesh():
    """Ratios against the exact run of the same seed; the worst seed is the one furthest from 0."""
    def row(group, seed, loss, inter, wire, secs):
        return {"group": group, "seed": str(seed), "mesh": "2x2", "steps": "300", "held_out_loss": str(loss),
                "inter_bytes_per_step": str(inter), "inter_fp32_bytes_per_step": "800",
                "all_gather_bytes_per_step": "0", "all_gather_fp_bytes_per_step": "0",
                "wire_tx_bytes_per_node_step": str(wire), "seconds_per_step": str(secs)}
    rows = [row("exact", 0, 2.0, 800, 1000, 2.0), row("hsdp4ef", 0, 2.02, 100, 125, 1.0),
            row("exact", 1, 4.0, 800, 1000, 2.0), row("hsdp4ef", 1, 3.96, 200, 250, 1.5)]
    (s,) = fsdp_report.summarize(rows)
    assert s["seeds"] == 2 and s["loss_diff_pct_mean"] == pytest.approx(0.0, abs=1e-9)
    assert s["loss_diff_pct_worst"] in (pytest.approx(1.0), pytest.approx(-1.0))
    assert s["counted_bytes_x_fewer"] == pytest.approx(6.0)        # mean of 8x and 4x
    assert s["wire_bytes_x_fewer"] == pytest.approx(6.0)
    assert s["step_time_ratio"] == pytest.approx(0.625)


def test_report_tail_compares_the_last_50_steps_of_training_loss():
    """The steadier metric: summed logged training loss after step end-50, against exact's."""
    row = {"seed": "0", "mesh": "2x2", "steps": "300", "held_out_loss": "1.0", "inter_bytes_per_step": "1",
           "inter_fp32_bytes_per_step": "8", "all_gather_bytes_per_step": "0", "all_gather_fp_bytes_per_step": "0",
           "wire_tx_bytes_per_node_step": "1", "seconds_per_step": "1"}
    rows = [dict(row, group="exact"), dict(row, group="hsdp4ef")]
    curves = [{"mesh": "2x2", "seed": "0", "group": g, "step": str(step),
               "train_loss": str(early if step <= 250 else late)}
              for g, early, late in (("exact", 5.0, 1.0), ("hsdp4ef", 7.5, 1.02)) for step in range(10, 301, 10)]
    (s,) = fsdp_report.summarize(rows, curves)
    assert s["tail_train_diff_pct_mean"] == pytest.approx(2.0)      # only steps 260..300 count
