"""scripts/gpu_paths_check.py, the checks a lent GPU runs for the newer faces, run here on 2 gloo
CPU ranks so that the script a GPU session depends on is the code CI keeps green."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_paths_check.py")
CHECKS = ["OneBitAdam overlap", "ZeroOneAdam overlap", "DiLoCo streaming", "FSDP2 gradients=32",
          "FSDP2 4-bit grads, 8-bit w"]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           SCRIPT, *args], env=env, capture_output=True, text=True, timeout=240)


def test_every_path_passes_on_two_cpu_ranks():
    proc = _run("--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in CHECKS:
        assert re.search(rf"^{re.escape(name)}\s+ok\s+median step\s+[\d.]+ ms", proc.stdout, re.M), \
            f"{name!r} missing or not ok:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout


def test_unknown_check_is_named():
    proc = subprocess.run([sys.executable, SCRIPT, "--checks", "onebit,bogus"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 2 and "bogus" in proc.stderr and "onebit" in proc.stderr
