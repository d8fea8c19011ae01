"""Bytes per step of every registered compressor and the common wrappers, against a table
recorded from the code before the compressor/cost refactor of issue 32 (tests/data/bytes_table.json).

Why: refactors of the compressors (one warm-up wrapper, the cost model learning rounds from a
local run) and of the layers under them (one Channel, one Face) must not change what goes on
the wire. One 2-rank gloo run trains a fixed model with fixed buckets for a few steps per
configuration (steps before and after ``start_iter`` included) and compares
``DistributedOptimizer.comm_stats()["step_bytes_sent"]`` per step with the table, exactly. The
replicas must be bitwise identical across ranks; where the platform (torch version, CPU
capability) is the one the table was recorded on, the parameters' hash must match too.

Re-record (only on purpose, after a change meant to alter the bytes)::

    BITSCOM_RECORD_BYTES_TABLE=1 python -m pytest -q tests/test_bytes_table.py
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict

import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bytes_table.json")
STEPS = 6

# Expressions evaluated in the worker with ``C`` = bitscom.compressors (and Auto, Link, SGD_ALL).
CONFIGS = [
    "'none'", "'fp16'", "'bf16'",
    "C.get('lowbit')", "C.get('lowbit', bitwidth=2, error_feedback=True)",
    "C.get('lowbit', bitwidth=8, stochastic_rounding=True, hadamard=True)",
    "C.PowerSGD(start_iter=0)", "C.PowerSGD()", "C.PowerSGD(rank=2, start_iter=2)",
    "C.PowerSGD(start_iter=2, error_feedback=False)",
    "C.ACPSGD()", "C.ACPSGD(start_iter=2)", "C.ACPSGD(rank=2, start_iter=3)",
    "C.TopK()", "C.TopK(start_iter=2)", "C.TopK(per_tensor=True, ratio=0.1)",
    "C.TopK(error_feedback=False, start_iter=1, selection='sampled')",
    "C.SignSGD()", "C.SignSGD(start_iter=2)", "C.SignSGD(majority_vote=True)",
    "C.SignSGD(block_size=None, start_iter=1)",
    "C.Exclude('topk')", "C.Exclude(C.PowerSGD(start_iter=2), patterns=('*.bias',))",
    "C.MomentumCorrection()", "C.MomentumCorrection(C.SignSGD(start_iter=2))",
    "C.MomentumCorrection(C.Exclude(C.TopK(start_iter=1)))",
    "Auto(link=Link(0.0, 1e-6), codec_seconds=lambda c, l, w: 0.0)",
    "Auto(candidates=SGD_ALL, link=Link(0.0, 1e-6), codec_seconds=lambda c, l, w: 0.0)",
]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(32, 48), norm=torch.nn.LayerNorm(48), act=torch.nn.Tanh(),
        fc2=torch.nn.Linear(48, 24), fc3=torch.nn.Linear(24, 8)))


def _platform() -> str:
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"


def _run_all(rank, world):
    import bitscom
    from bitscom import compressors as C  # noqa: F401  (used by the expressions)
    from bitscom.cost.auto import SGD_ALL, Auto  # noqa: F401
    from bitscom.cost import Link  # noqa: F401
    out = {}
    for expr in CONFIGS:
        model = _model()
        comp = eval(expr)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           model.named_parameters(), compression=comp,
                                           fusion_threshold_mb=0.006)
        sent = []
        for step in range(STEPS):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sent.append(int(opt.comm_stats()["step_bytes_sent"]))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[expr] = {"bytes": sent, "params": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
                     "buckets": len(opt.bucket_layouts)}
        opt.close()
    return out


def test_bytes_per_step_match_the_recorded_table(pools):
    results = pools.run(2, _run_all, timeout=120)
    for expr in CONFIGS:
        assert results[0][expr]["params"] == results[1][expr]["params"], f"{expr}: replicas differ"
    measured = {"platform": _platform(), "steps": STEPS, "world": 2, "table": results[0]}
    if os.environ.get("BITSCOM_RECORD_BYTES_TABLE"):
        os.makedirs(os.path.dirname(DATA), exist_ok=True)
        with open(DATA, "w") as f:
            json.dump(measured, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(DATA) as f:
        recorded = json.load(f)
    assert sorted(recorded["table"]) == sorted(CONFIGS), "the table and CONFIGS list differ"
    for expr in CONFIGS:
        got, want = measured["table"][expr], recorded["table"][expr]
        assert got["buckets"] == want["buckets"], expr
        assert got["bytes"] == want["bytes"], f"{expr}: bytes per step changed"
        if recorded["platform"] == measured["platform"]:
            assert got["params"] == want["params"], f"{expr}: the trained parameters changed"
