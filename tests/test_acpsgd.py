"""ACP-SGD: one fused all-reduce per step alternating P/Q, exact on low-rank gradients,
error-feedback invariant, bytes equal to the analytic count, bitwise replicas, accumulation,
unused parameters, exact resume, bad input."""

from __future__ import annotations

import pytest

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import ACPSGD
from test_powersgd import check_resumable, check_steps, drive_steps, make_layout, tol, \
    train_resumable


def test_wire_bytes_alternate():
    layout = make_layout()
    comp = ACPSGD(rank=2, start_iter=1)
    plan = comp.plan(layout)
    p = 4 * (plan.p_numel + plan.uncompressed_numel)
    q = 4 * (plan.q_numel + plan.uncompressed_numel)
    assert p != q
    assert [sent_bytes(comp, layout, 2, s) for s in range(5)] == [4 * layout.numel, p, q, p, q]
    assert sent_bytes(comp, layout, 2) == (p + q) // 2


def test_bad_settings_name_the_value():
    for kwargs, needle in [({"rank": 0}, "0"), ({"rank": -1}, "-1"), ({"rank": True}, "True"),
                           ({"orthogonalization": "svd"}, "svd"), ({"start_iter": -2}, "-2")]:
        with pytest.raises(ValueError, match=needle):
            ACPSGD(**kwargs)
    with pytest.raises(ValueError, match="rank"):
        bitscom.compressors.get("acpsgd", rank=0)


def test_one_allreduce_per_step_alternating(pools):
    comp = ACPSGD(rank=2)
    results = pools.run(2, drive_steps, comp, 4)
    layout = make_layout()
    assert [r["bytes"] for r in results[0]] == [sent_bytes(comp, layout, 2, s) for s in range(4)]
    check_steps(comp, results, 2, first_compressed=0, alternating=True)
    # error feedback pays back everything after each Q step (the P factor then spans the
    # column space): cumulative output = cumulative average input, and the residual is 0
    for step in (1, 3):
        out = sum(results[0][s]["output"] for s in range(step + 1))
        avg = sum((results[0][s]["input"] + results[1][s]["input"]) / 2 for s in range(step + 1))
        assert (out - avg).abs().max() <= tol(avg)
        assert results[0][step]["res_new"].abs().max() <= tol(avg, rel=1e-4)   # vs ~1 after P steps


def test_exact_on_low_rank_without_error_feedback(pools):
    comp = ACPSGD(rank=2, error_feedback=False)
    results = pools.run(2, drive_steps, comp, 4)
    check_steps(comp, results, 2, first_compressed=0, alternating=True)
    for step in range(1, 4):      # one P step finds the column space, then every step is exact
        avg = (results[0][step]["input"] + results[1][step]["input"]) / 2
        assert (results[0][step]["output"] - avg).abs().max() <= tol(avg), step


def test_invariants_on_full_rank_gradients_three_ranks(pools):
    comp = ACPSGD(rank=4, start_iter=1, batch_same_shape=False)
    results = pools.run(3, drive_steps, comp, 4, False)
    check_steps(comp, results, 3, first_compressed=1, alternating=True)


def test_replicas_accumulation_unused_bytes_and_exact_resume(pools):
    # resume at step 3: a Q step, so the checkpoint must carry the reduced P and the residual
    results = pools.run(2, train_resumable, ACPSGD(rank=2), 6, 3)
    check_resumable(results)               # includes bytes_sent == Σ sent_bytes per step
    sent = results[0]["sent"]
    assert sent[0] == sent[2] == sent[4] and sent[1] == sent[3] == sent[5] and sent[0] != sent[1]
