"""scripts/sdp4bit.py: the benchmark runs end to end on 2 spawned ranks and writes its files."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sdp4bit  # noqa: E402


def test_text_and_model():
    data = sdp4bit.load_text()
    assert data.numel() > 100_000 and int(data.max()) < 256
    model = sdp4bit.GPT(d=32, layers=1, heads=2, seq=16)
    x, y = sdp4bit.batch(data, 0, 3, 16)
    assert model(x).shape == (3, 16, 256) and y.shape == (3, 16)


def test_benchmark_runs_and_writes_csv(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "sdp4bit.py"), "--spawn", "2", "--local-size", "1",
           "--steps", "3", "--eval-every", "3", "--d-model", "32", "--layers", "1", "--heads", "2",
           "--seq", "16", "--batch", "2", "--groups", "Baseline,SDP4Bit", "--out", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["group"] for r in rows] == ["Baseline", "SDP4Bit"]
    assert all(r["replicas_identical"] == "True" for r in rows)
    assert int(rows[1]["weight_bytes"]) < int(rows[0]["weight_bytes"]) / 5
    assert int(rows[1]["grad_bytes"]) < int(rows[0]["grad_bytes"]) / 5
    with open(tmp_path / "sdp4bit.csv") as f:
        assert len(list(csv.DictReader(f))) == 6
