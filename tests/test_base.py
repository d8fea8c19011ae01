"""Pure pieces of the core, no ranks: bucket planning, State checkpoints, the local Comm."""

import pytest
import torch

from bitscom.buckets import plan_buckets
from bitscom.compressors import Compression, drive, get, names
from bitscom.compressors.base import BucketLayout, Comm, State


def _params(*specs):
    return [(f"p{i}", torch.zeros(n, dtype=dt)) for i, (n, dt) in enumerate(specs)]


def test_plan_reverse_order_threshold_and_dtypes():
    f32, f16 = torch.float32, torch.float16
    params = _params((10, f32), (20, f32), (5, f16), (30, f32), (7, f16))
    layouts = plan_buckets(params, threshold_bytes=200)  # 50 fp32 elements
    described = [[s.name for s in l.slots] for l in layouts]
    # reverse registration order; fp16 never shares with fp32; p3 (120 B) + p1 (80 B) = 200 fits
    assert described == [["p4", "p2"], ["p3", "p1"], ["p0"]]
    assert [l.dtype for l in layouts] == [f16, f32, f32]
    assert [s.offset for s in layouts[1].slots] == [0, 30]
    assert [[s.name for s in l.slots] for l in plan_buckets(params, 0)] == [["p4"], ["p3"], ["p2"], ["p1"], ["p0"]]
    assert len(plan_buckets(params, 10 ** 9)) == 2
    with pytest.raises(ValueError, match="-1"):
        plan_buckets(params, -1)


def test_plan_is_deterministic():
    params = _params(*[(n, torch.float32) for n in (3, 9, 27, 81, 243)])
    a = [l.describe() for l in plan_buckets(params, 400)]
    b = [l.describe() for l in plan_buckets(params, 400)]
    assert a == b


class _Inner(State):
    def __init__(self):
        self.residual = torch.zeros(3)


class _Outer(State):
    def __init__(self):
        self.step = 0
        self.q = torch.zeros(2, 2)
        self.gen = torch.Generator().manual_seed(1)
        self.inner = _Inner()
        self._scratch = torch.zeros(5)


def test_state_round_trip_with_nested_state_and_generator():
    s = _Outer()
    s.step, view = 7, s.q.view(-1)
    s.q += 1.5
    s.inner.residual += 2
    expected_draw = torch.rand(4, generator=torch.Generator().manual_seed(1).set_state(s.gen.get_state()))
    saved = s.state_dict()
    assert "_scratch" not in saved
    s.q.zero_(), s.inner.residual.zero_(), torch.rand(10, generator=s.gen)
    s.step = 0
    s.load_state_dict(saved)
    assert s.step == 7 and torch.equal(view, torch.full((4,), 1.5)), "views into loaded tensors stay valid"
    assert torch.equal(s.inner.residual, torch.full((3,), 2.0))
    assert torch.equal(torch.rand(4, generator=s.gen), expected_draw)


def test_state_load_rejects_other_shapes():
    s = _Outer()
    saved = s.state_dict()
    saved["q"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'q'.*\(3, 3\).*\(2, 2\)"):
        s.load_state_dict(saved)


def test_single_process_compressors_are_identity():
    flat = torch.randn(100)
    layout = BucketLayout.for_tensor(flat)
    for name in names():
        comp = get(name, **({"inner": "topk"} if name == "exclude" else {}))  # a wrapper needs one
        out = flat.clone()
        comm = Comm()
        drive(comp.reduce(out, layout, comp.init_state(layout), comm), comm)
        assert comm.bytes_sent == 0
        if name in ("none",):
            assert torch.equal(out, flat)
        elif name in ("fp16", "bf16"):
            assert torch.allclose(out, flat, rtol=1e-2, atol=1e-2)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown compressor 'nope'.*fp16"):
        get("nope")
    with pytest.raises(TypeError, match="bad settings for compressor 'fp16'"):
        get("fp16", rank=3)
    assert get("ssgd") == Compression.none
