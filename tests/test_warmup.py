"""WarmUp(inner, start_iter): one warm-up rule composed around any compressor, the same bytes
and bitwise the same results as the ``start_iter=`` settings it replaces (issue 32)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import pytest
import torch

import bitscom
from bitscom.compressors import ACPSGD, MomentumCorrection, PowerSGD, SignSGD, TopK, WarmUp, get
from bitscom.cost import layout_of

PAIRS = [("TopK(start_iter=2)", "WarmUp(TopK(), 2)"),
         ("SignSGD(start_iter=2)", "WarmUp('signsgd', start_iter=2)"),
         ("PowerSGD(rank=2, start_iter=2)", "WarmUp(PowerSGD(rank=2, start_iter=0), 2)"),
         ("ACPSGD(start_iter=3)", "WarmUp(ACPSGD(), 3)"),
         ("MomentumCorrection(TopK(start_iter=1))", "MomentumCorrection(WarmUp(TopK(), 1))")]


def _train(rank, world, exprs):
    out = {}
    for expr in exprs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(16, 24), act=torch.nn.Tanh(),
                                                fc2=torch.nn.Linear(24, 4)))
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                           compression=eval(expr), fusion_threshold_mb=0.001)
        sent = []
        for step in range(6):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sent.append(opt.comm_stats()["step_bytes_sent"])
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[expr] = (sent, hashlib.sha256(flat.numpy().tobytes()).hexdigest())
        opt.close()
    return out


def test_wrapper_equals_the_start_iter_setting_bitwise_and_warms_up_any_compressor(pools):
    exprs = [e for pair in PAIRS for e in pair] + ["WarmUp('lowbit', start_iter=2)", "get('lowbit')"]
    res0, res1 = pools.run(2, _train, exprs, timeout=120)
    assert res0 == res1                                        # replicas bitwise identical
    for old, new in PAIRS:
        assert res0[old] == res0[new], (old, new)
    warm, plain = res0["WarmUp('lowbit', start_iter=2)"][0], res0["get('lowbit')"][0]
    dense = res0["TopK(start_iter=2)"][0][0]
    assert warm[:2] == [dense, dense] and warm[2:] == plain[2:] and plain[0] < dense


def test_state_counts_steps_and_round_trips():
    comp = WarmUp("topk", start_iter=1)
    layout = layout_of(64)
    state = comp.init_state(layout)
    state.step = 3
    state.inner.step = 2
    again = comp.init_state(layout)
    again.load_state_dict(state.state_dict())
    assert again.step == 3 and again.inner.step == 2
    assert WarmUp("fp16", start_iter=4) == WarmUp(get("fp16"), 4)


@pytest.mark.parametrize("kwargs, error, match", [
    ({}, ValueError, "WarmUp needs an inner compressor"),
    ({"inner": "topk", "start_iter": -1}, ValueError, "WarmUp start_iter must be an int >= 0, got -1"),
    ({"inner": "topk", "start_iter": 1.5}, ValueError, "got 1.5"),
    ({"inner": MomentumCorrection()}, ValueError, "MomentumCorrection\\(WarmUp"),
])
def test_bad_settings_name_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        WarmUp(**kwargs)


def test_the_start_iter_settings_still_check_their_value():
    for cls in (TopK, SignSGD, PowerSGD, ACPSGD):
        with pytest.raises(ValueError, match="start_iter must be an int >= 0, got -2"):
            cls(start_iter=-2)
