"""The Ray Train recipe of docs/integrations.md: ``python ray_train.py`` starts Ray
(``num_cpus=2``, no dashboard, usage stats off) and two TorchTrainer runs of 2 CPU workers:
gloo (DistributedOptimizer, then Ray's DDP with bitscom's comm hook) and the "lowbit" backend
registered by a worker setup hook (plain DDP, no hook)."""

import time

import pytest

from launch import records, run_self_launching
from references import FP32_BYTES, NUMEL, SHAPES, lowbit_bytes, powersgd_bytes

pytest.importorskip("ray.train")

HEADER_BYTES = 16          # the lowbit backend's agreement header per collective (docs/lowbit.md)


def _run(name, text):
    return records("\n".join(line for line in text.splitlines() if line.startswith(f"{name}: RESULT")))


def _trained_alike(found) -> int:
    """Replicas bitwise equal, the loss lowered; returns the bytes sent, the same on both ranks."""
    (_, before, after, sent, dense, digest0), (_, before1, after1, sent1, dense1, digest1) = found
    assert digest0 == digest1, "replicas differ after training"
    assert (before, after) == (before1, after1)
    assert after < before, f"training did not lower the loss: {before} -> {after}"
    assert dense == dense1 == FP32_BYTES and sent == sent1
    return sent


def test_ray_train_workers_adopt_rays_group_and_compress():
    start = time.monotonic()
    out = run_self_launching("ray_train.py", timeout=420, env={"RAY_USAGE_STATS_ENABLED": "0"})
    print(f"ray_train.py took {time.monotonic() - start:.1f} s")
    optimizer = _trained_alike(_run("optimizer", out))
    assert optimizer == lowbit_bytes(NUMEL, 2, bits=4) == 1980          # 4.79x fewer than fp32
    hook = _trained_alike(_run("ddp_hook", out))
    assert hook == powersgd_bytes(SHAPES, rank=2) == 2064                # 4.60x fewer
    backend = _trained_alike(_run("backend=lowbit", out))
    assert backend == lowbit_bytes(NUMEL, 2, bits=4) + HEADER_BYTES      # 4.75x fewer
    assert min(FP32_BYTES / sent for sent in (optimizer, hook, backend)) > 4.5
