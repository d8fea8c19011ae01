"""OneBitAdam / ZeroOneAdam with overlap=True (issue 34): the 1-bit all-reduce leaves bucket by
bucket from the gradient hooks, with results bitwise those of the implementation before the
overlap (recorded in tests/data/onebit_reference.pt by tests/onebit_scenarios.py), its
checkpoints loading, and gradient edits between backward and step refused on every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import bitscom.face
from bitscom.comm import Comm, drive
from bitscom.lowbit import LowBitState, all_reduce_rounds
from bitscom.lowbit.ranged import check_ranged, owner_ranges, range_rounds
from bitscom.onebit import OneBitAdam, ZeroOneAdam, momentum_codec
import onebit_scenarios as S

TINY = 64 * 4 / 2 ** 20         # 64 fp32 elements: two 32-element blocks per bucket

REFERENCE = torch.load(S.DATA)


def _overlapped_steps(name: str) -> int:
    """Steps whose 1-bit all-reduce leaves from the hooks (each adds the 4-byte agreement)."""
    kind, settings, steps, _, _, _ = S.SCENARIOS[name]
    if kind == "OneBitAdam":
        return steps - settings["freeze_step"]
    interval, counter, n = 1, 0, 0        # ZeroOneAdam's variance-phase schedule
    for t in range(1, settings["var_freeze_step"] + 1):
        if t % interval:
            n += 1
        else:
            counter += 1
            if counter == settings["var_update_scaler"]:
                counter, interval = 0, interval * 2
    return n


def _overlap_args(name):
    return dict(overlap=True, bucket_mb=TINY, backward_passes_per_step=S.SCENARIOS[name][3])


# ------------------------------------------------------------------ the ranged all-reduce

def test_owner_ranges_tile_each_shard_in_whole_blocks():
    for numel, world, block, most in [(1000, 2, 32, 128), (7, 4, 32, 64), (4096, 4, 64, 10), (33, 3, 32, 1 << 20)]:
        pieces = owner_ranges(numel, world, block, most)
        unit = world * block
        N = max(unit, -(-numel // unit) * unit)
        m = N // world
        assert sorted((s, t) for s, t, _ in pieces)[0][0] == 0
        covered = sorted(pieces)
        assert [s for s, _, _ in covered[1:]] == [t for _, t, _ in covered[:-1]] and covered[-1][1] == N
        for s, t, j in pieces:
            assert s % block == 0 and t % block == 0 and j * m <= s < t <= (j + 1) * m
            assert t - s <= max(block, most // block * block)
        assert pieces[0][1] == N            # last piece first (backward fills the end first)


def test_check_ranged_refuses_what_it_does_not_reproduce():
    check_ranged(momentum_codec(32, 1))
    from bitscom.lowbit import LowBitConfig
    with pytest.raises(ValueError, match="hierarchy"):
        check_ranged(LowBitConfig(bitwidth=1, hierarchy="two_level"))


def _ranged_vs_whole(rank, world, n, stage2_bits, most):
    cfg = momentum_codec(32, stage2_bits)
    check_ranged(cfg)
    whole_state, ranged_state = LowBitState(), LowBitState()
    gen = torch.Generator().manual_seed(rank)
    same = []
    for step in range(3):
        x = torch.randn(n, generator=gen) * (10.0 ** (step - 2))
        a, b = x.clone(), x.clone()
        drive(all_reduce_rounds(a, Comm(None), cfg, whole_state))
        k = ranged_state.step
        ranged_state.step += 1
        ranged_state.bind(n)
        for s, t, j in owner_ranges(n, world, 32, most):
            drive(range_rounds(b, s, t, j, Comm(None), cfg, ranged_state, k))
        same.append(torch.equal(a, b))
        same.append(torch.equal(whole_state.residual.residual, ranged_state.residual.residual))
        same.append(torch.equal(whole_state.stage2_residual.residual, ranged_state.stage2_residual.residual))
    return same, a


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n,stage2_bits,most", [(1000, 1, 128), (77, 4, 32), (4096, 1, 1 << 20)])
def test_range_rounds_are_bitwise_the_whole_buffer_all_reduce(pools, world, n, stage2_bits, most):
    results = pools.run(world, _ranged_vs_whole, n, stage2_bits, most, timeout=200)
    for same, _ in results:
        assert all(same), same                   # output, worker and server residuals, 3 steps
    assert all(torch.equal(results[0][1], r[1]) for r in results)


# ------------------------------------------------------------------ the recorded runs

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [n for n, v in S.SCENARIOS.items() if v[4] is None])
def test_overlap_reproduces_the_recorded_runs_bitwise(pools, world, name):
    got = pools.run(world, S.run, name, timeout=300, **_overlap_args(name))
    want = REFERENCE[f"{name}/{world}"]
    for rank, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g["params"], w["params"])
        assert torch.equal(g["exp_avg"], w["exp_avg"])
        # the same bytes, plus the 4-byte agreement that p.grad was not edited, per overlapped step
        assert g["bytes_sent"] == w["bytes_sent"] + 4 * _overlapped_steps(name)
        if w["checkpoint"] is not None:      # the checkpoint the new code writes: the old one's
            _same_state(_older_layout(g["checkpoint"]["state_dict"], rank), w["checkpoint"]["state_dict"],
                        "state_dict")


def _older_layout(state_dict, rank):
    """The recorded checkpoints predate the per-rank key (``["onebit"]["rank<r>"]``): this rank's
    entry laid back beside the envelope, as they hold it."""
    onebit = bitscom.face.own_entry(state_dict["onebit"], rank, map_location="cpu")
    return dict(state_dict, onebit={k: v for k, v in onebit.items() if k != bitscom.face.rank_key(rank)})


def _same_state(a, b, where):
    """Nested state dicts equal, tensors bitwise (the byte counter aside: +4 per overlapped step)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            if k != "bytes_sent":
                _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_without_overlap_clipping_between_backward_and_step_is_unchanged(pools, world):
    got = pools.run(world, S.run, "onebit_clip", timeout=300)
    for g, w in zip(got, REFERENCE[f"onebit_clip/{world}"]):
        assert torch.equal(g["params"], w["params"]) and g["bytes_sent"] == w["bytes_sent"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [n for n, v in S.SCENARIOS.items() if v[5] is not None])
def test_overlap_resumes_from_a_checkpoint_of_the_pre_overlap_code(pools, world, name):
    want = REFERENCE[f"{name}/{world}"]
    checkpoints = [w["checkpoint"] for w in want]
    got = pools.run(world, _resume_own, name, checkpoints, timeout=300)
    for g, w in zip(got, want):
        assert torch.equal(g, w["params"])


def _resume_own(rank, world, name, checkpoints):
    return S.resume(rank, world, name, checkpoints[rank], **_overlap_args(name))


# ------------------------------------------------------------------ it overlaps

def _launched_during_backward(rank, world):
    model = S.Net()
    opt = OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=True, bucket_mb=TINY)
    seen = []
    finish = opt._finish

    def spy():
        seen.append(len(opt._buckets.flights))     # buckets already sent by the hooks
        finish()
    opt._finish = spy
    for t in range(3):
        x, y = S.global_batch(t, world)
        nn.functional.mse_loss(model(S.shard(x, rank, world)), S.shard(y, rank, world)).backward()
        if t >= 1:
            seen.append(len(opt._buckets.flights))  # every bucket, after backward
        opt.step()
        opt.zero_grad()
    return seen


def test_buckets_leave_during_backward(pools):
    for seen in pools.run(2, _launched_during_backward, timeout=120):
        # step 1 is exact (nothing from the hooks); steps 2-3: some buckets left before the end
        # of backward (the last layers'), the rest at its end (the frozen first layer's).
        assert seen[0] == 0
        assert 0 < seen[1] < seen[2] and 0 < seen[3] < seen[4]


# ------------------------------------------------------------------ what cannot overlap

def _edit_between_backward_and_step(rank, world, which, edit_rank):
    model = S.Net()
    opt = ZeroOneAdam(S.param_groups(model), lr=0.01, var_freeze_step=8, var_update_scaler=1, block_size=32,
                      overlap=True, bucket_mb=TINY) if which == "zero_one" else \
        OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=True, bucket_mb=TINY)
    errors = []
    for t in range(4):
        x, y = S.global_batch(t, world)
        nn.functional.mse_loss(model(S.shard(x, rank, world)), S.shard(y, rank, world)).backward()
        if rank == edit_rank or edit_rank == -1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
        try:
            opt.step()
        except RuntimeError as err:
            errors.append((t, str(err)))
        opt.zero_grad()
    return errors


@pytest.mark.parametrize("which", ["onebit", "zero_one"])
@pytest.mark.parametrize("edit_rank", [1, -1], ids=["one-rank-clips", "every-rank-clips"])
def test_clipping_with_overlap_is_one_clear_error_on_every_rank(pools, which, edit_rank):
    results = pools.run(2, _edit_between_backward_and_step, which, edit_rank, timeout=120)
    # exact steps (OneBit 1; ZeroOne 1, 2, 4) step on the clipped gradient as before; the
    # overlapped ones raise, on both ranks, naming the way out
    first = 1 if which == "onebit" else 2
    for errors in results:
        assert errors and errors[0][0] == first
        assert "p.grad changed between backward() and step()" in errors[0][1]
        assert "overlap=False" in errors[0][1]
    assert [t for t, _ in results[0]] == [t for t, _ in results[1]]


def _with_grad_scaler(rank, world):
    model = S.Net()
    opt = OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=True, bucket_mb=TINY)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    out = []
    for t in range(2):
        x, y = S.global_batch(t, world)
        scaler.scale(nn.functional.mse_loss(model(S.shard(x, rank, world)), S.shard(y, rank, world))).backward()
        try:
            scaler.step(opt)
            out.append("ok")
        except RuntimeError as err:
            out.append(str(err))
        scaler.update()
        opt.zero_grad()
    return out


def test_grad_scaler_with_overlap_is_one_clear_error_on_every_rank(pools):
    for out in pools.run(2, _with_grad_scaler, timeout=120):
        assert out[0] == "ok"                        # the exact step: as without overlap
        assert "cannot step with GradScaler" in out[1] and "overlap=False" in out[1]


def _zero_grad_mid_step(rank, world):
    model = S.Net()
    opt = OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=True, bucket_mb=TINY)
    msgs = []
    for t in range(2):
        x, y = S.global_batch(t, world)
        nn.functional.mse_loss(model(S.shard(x, rank, world)), S.shard(y, rank, world)).backward()
        if t == 1:
            with pytest.raises(RuntimeError, match="call step\\(\\) first") as info:
                opt.zero_grad()
            msgs.append(str(info.value))
        opt.step()
        opt.zero_grad()
    return msgs


def test_zero_grad_while_buckets_are_in_flight_is_refused(pools):
    assert all(len(m) == 1 for m in pools.run(2, _zero_grad_mid_step, timeout=120))


def _extra_backward(rank, world):
    model = S.Net()
    opt = OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=True, bucket_mb=TINY)
    x, y = S.global_batch(0, world)

    def backward():
        nn.functional.mse_loss(model(S.shard(x, rank, world)), S.shard(y, rank, world)).backward()
    backward()
    opt.step()
    opt.zero_grad()
    backward()                                   # step 2: its buckets leave from the hooks
    try:
        backward()
        msg = "no error"
    except RuntimeError as err:
        msg = str(err)
    with pytest.raises(RuntimeError, match="p.grad changed"):   # 2 passes accumulated in p.grad
        opt.step()                               # (and the step's work is finished, not left)
    return msg


def test_more_backward_passes_than_declared_is_a_clear_error(pools):
    for msg in pools.run(2, _extra_backward, timeout=120):
        assert "backward_passes_per_step=1" in msg


SOLO = pytest.mark.filterwarnings("ignore:bitscom.OneBitAdam. neither bitscom.init")


@SOLO
@pytest.mark.parametrize("bad,match", [
    (dict(overlap="yes"), "overlap must be a bool"),
    (dict(bucket_mb=0), "bucket_mb must be a finite number > 0"),
    (dict(backward_passes_per_step=0), "backward_passes_per_step must be an int >= 1"),
])
def test_bad_overlap_settings_name_the_value(bad, match):
    model = S.Net()
    with pytest.raises((TypeError, ValueError), match=match):
        OneBitAdam(S.param_groups(model), **bad)


@SOLO
def test_one_process_overlap_is_plain_adamw_path():
    """A single process sends nothing: overlap=True steps exactly as overlap=False."""
    runs = []
    for overlap in (False, True):
        model = S.Net()
        opt = OneBitAdam(S.param_groups(model), lr=0.01, freeze_step=1, block_size=32, overlap=overlap)
        for t in range(3):
            x, y = S.global_batch(t, 1)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append(S.flat(model))
    assert torch.equal(runs[0], runs[1])


def test_the_timing_script_prints_its_table():
    """scripts/onebit_overlap_bench.py end to end on a tiny model (its numbers are not checked:
    timing never is)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "onebit_overlap_bench.py"), "--width", "32",
                        "--layers", "2", "--steps", "1", "--blocks", "1", "--bucket-mb", "0.001"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == 0, p.stderr
    assert "| overlap | median step (ms)" in p.stdout and "| True |" in p.stdout


def test_changed_compares_bits_so_nan_gradients_pass_through():
    """A NaN gradient is not an 'edit' (NaN must propagate visibly, not become this error);
    None reads as zeros; a scaled gradient is an edit."""
    from bitscom.onebit.overlap import OverlapBuckets
    b = OverlapBuckets([3, 2], numel=5, world=2, block_size=32, max_elements=32, device="cpu")
    g0, g1 = torch.tensor([1.0, float("nan"), -0.0]), None
    b.fill(0, g0)
    b.fill(1, g1)
    assert b.changed([g0, g1]) == []
    assert b.changed([g0 * 0.5, g1]) == [0]
    assert b.changed([g0, torch.ones(2)]) == [1]
    assert b.changed([torch.tensor([1.0, float("nan"), 0.0]), g1]) == [0]    # -0.0 became +0.0
