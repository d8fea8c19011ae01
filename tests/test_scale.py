"""scripts/scale.py: the scale predictions run, have their columns, and obey the cost model's
monotonic facts (no timing: everything here is arithmetic on the model's own output)."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
pytest.importorskip("bitscom.cost")
import scale  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return scale.predict(["resnet50"], (8, 64, 1024), (1, 10, 100), list(scale.COMPRESSORS))


def _cell(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def test_quick_mode_writes_csv_and_plot(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "scale.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = list(csv.DictReader(open(tmp_path / "scale_speedup.csv")))
    assert list(out[0]) == scale.FIELDS
    assert {r["model"] for r in out} == {"resnet50", "bert_base"}
    assert {r["compressor"] for r in out} == set(scale.COMPRESSORS)
    assert len(out) == 2 * 3 * 2 * len(scale.COMPRESSORS)
    assert all(r["speedup_vs_ssgd"] == "1" for r in out if r["compressor"] == "ssgd")
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / "scale_speedup.png") > 1000


def test_buckets_cover_the_real_model():
    named = scale._meta_params("resnet50")
    assert sum(p.numel() for _, p in named) == 25_557_032            # torchvision's count
    shapes = scale.bucket_shapes(named)
    assert sum(len(b) for b in shapes) == len(named)
    assert sum(int(p.numel()) for _, p in named) == sum(
        int(__import__("math").prod(s)) for b in shapes for s in b)


def test_more_bandwidth_never_slows_ssgd(rows):
    for world in (8, 64, 1024):
        steps = [float(_cell(rows, world=world, gbit=g, compressor="ssgd")[0]["step_s"]) for g in (1, 10, 100)]
        assert steps[0] >= steps[1] >= steps[2]
        assert steps[2] >= float(_cell(rows, world=world, gbit=100, compressor="ssgd")[0]["compute_s"])


def test_all_gather_bytes_grow_with_ranks_but_allreduce_bytes_do_not(rows):
    for comp in ("topk", "signsgd"):
        # every rank hands the same payload; what it receives (the wire time) grows with ranks
        comm = [float(_cell(rows, world=w, gbit=10, compressor=comp)[0]["comm_s"]) for w in (8, 64, 1024)]
        assert comm[0] < comm[1] < comm[2]
        received = [int(_cell(rows, world=w, gbit=10, compressor=comp)[0]["bytes_per_rank"]) * (w - 1)
                    for w in (8, 64, 1024)]
        assert received[0] < received[1] < received[2]
    ssgd = {int(_cell(rows, world=w, gbit=10, compressor="ssgd")[0]["bytes_per_rank"]) for w in (8, 64, 1024)}
    assert ssgd == {25_557_032 * 4}


def test_speedup_is_ssgd_step_over_own_step(rows):
    for r in rows:
        base = _cell(rows, world=r["world"], gbit=r["gbit"], compressor="ssgd")[0]
        assert float(r["speedup_vs_ssgd"]) == pytest.approx(float(base["step_s"]) / float(r["step_s"]), rel=1e-3)


def test_step_model_overlap():
    # compute 3 s: fwd 1, bwd 2; buckets 1+1 overlap the backward, the last (0.5) never does
    assert scale.step_seconds(3.0, [1.0, 1.0, 0.5], 0.25) == pytest.approx(1 + 2 + 0.5 + 0.25)
    assert scale.step_seconds(3.0, [4.0, 0.5], 0.0) == pytest.approx(1 + 4 + 0.5)


def test_auto_never_costs_more_than_the_plain_all_reduce_or_a_candidate_column():
    # ``auto`` takes, per bucket, the candidate with the least codec + communication time: its
    # total can be no larger than that of any column it could have chosen everywhere (the plain
    # all-reduce, fp16, 4-bit low-bit, whose codec constants are the same in both tables).
    rows = scale.predict(["bert_base"], (8, 1024), (1, 100), ["ssgd", "fp16", "lowbit", "auto"])
    for world in (8, 1024):
        for gbit in (1, 100):
            cell = {r["compressor"]: r for r in _cell(rows, world=world, gbit=gbit)}
            auto = float(cell["auto"]["comm_s"]) + float(cell["auto"]["codec_s"])
            for c in ("ssgd", "fp16", "lowbit"):
                assert auto <= float(cell[c]["comm_s"]) + float(cell[c]["codec_s"]) * (1 + 1e-9), (world, gbit, c)
            assert cell["auto"]["bytes_per_rank"] <= cell["ssgd"]["bytes_per_rank"]
    # it does pick: at 1 Gbit/s on 8 ranks the all-reduce is ~8x slower than 4-bit
    one = {r["compressor"]: r for r in _cell(rows, world=8, gbit=1)}
    assert one["auto"]["bytes_per_rank"] < one["fp16"]["bytes_per_rank"]


def test_figure_is_the_readable_six_panel_one(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    rows = scale.predict(["bert_base", "gpt_1.3b"], (8, 64), (1, 10, 100), ["ssgd", "lowbit", "auto"])
    scale.plot(rows, str(tmp_path / "f.png"))
    h, w = matplotlib.image.imread(str(tmp_path / "f.png")).shape[:2]
    assert w >= 1200 and h >= 700          # 2 x 3 panels at 110 dpi, titles readable
