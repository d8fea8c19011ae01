"""Streaming DiLoCo's overlap (``delay=τ``, ``mix=α``): a float64 reference of the delayed
update rule written here, the compressed path against the compressor driven directly (bitwise),
replicas bitwise identical, ``delay=0`` bitwise equal to the synchronous DiLoCo that shipped
(recorded digests), an exact resume with a reduction in flight, ``sync()`` with reductions in
flight, bad values and cross-rank disagreement."""

import copy
import json
import os

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.compressors import get
from bitscom.compressors.base import Comm, drive
from bitscom.diloco import DiLoCo, DiLoCoConfig
from diloco_digest import CASES, digest_run
from helpers import global_batch, make_model, shard

NAMES = [n for n, _ in make_model(seed=0).named_parameters()]


def _inner(kind, params, lr=0.05):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.5)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def _loss(model, step, rank, world):
    x, y = global_batch(step, world, 4)
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(shard(x, rank, world).to(dtype)), shard(y, rank, world).to(dtype))


def _build(kind="adamw", dtype=torch.float32, **kw):
    model = make_model(seed=0).to(dtype)
    return model, DiLoCo(_inner(kind, model.parameters()), model.named_parameters(), **kw)


def _train(rank, world, steps, kind, dtype, **kw):
    """Per step: this rank's parameters and θ_global; then the stats and the fragments' names."""
    model, opt = _build(kind, dtype, **kw)
    hist = []
    for t in range(steps):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
        hist.append(([p.detach().clone() for p in model.parameters()],
                     [g.detach().clone() for g in opt.global_parameters]))
    frags = [[s.name for b in m for s in opt.bucket_layouts[b].slots] for m in opt.fragment_buckets]
    return hist, opt.comm_stats(), frags


def _reference(world, steps, kind, cfg, frags, mean=None):
    """Streaming DiLoCo with overlap in float64, ``world`` replicas. After inner step t:

    1. each fragment f starting at t (``cfg.due(t)``) records Δ_f = mean_m(θ_global,f − θ_m,f);
    2. each fragment landing at t (``cfg.due(t − τ)``) applies the outer SGD (Nesterov) to
       θ_global,f with that Δ_f, then θ_m,f ← α·θ_m,f + (1 − α)·θ_global,f on every replica.

    The first ``cfg.warmup_steps`` steps average the gradients (S-SGD) instead. ``mean``
    replaces the exact average (default: the plain mean)."""
    mean = mean or (lambda xs: sum(xs) / len(xs))
    base = make_model(seed=0).double()
    models = [copy.deepcopy(base) for _ in range(world)]
    inners = [_inner(kind, m.parameters()) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    buf, pending, out = {}, {}, []
    lr, mom, nest, alpha = cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.mix
    for t in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(models, inners)):
            o.zero_grad()
            _loss(m, t - 1, r, world).backward()
        if cfg.in_warmup(t):
            for n in NAMES:
                g = mean([p[n].grad for p in params])
                for p in params:
                    p[n].grad = g.clone()
        for o in inners:
            o.step()
        if cfg.in_warmup(t):
            glob = {n: params[0][n].detach().clone() for n in NAMES}
        for f in cfg.due(t):
            pending[f] = {n: mean([glob[n] - p[n].detach() for p in params]) for n in frags[f]}
        for f in cfg.lands(t):
            for n, delta in pending.pop(f).items():
                buf[n] = delta.clone() if n not in buf else mom * buf[n] + delta
                glob[n] = glob[n] - lr * (delta + mom * buf[n] if nest else buf[n])
                with torch.no_grad():
                    for p in params:
                        p[n].copy_(alpha * p[n] + (1 - alpha) * glob[n])
        out.append(([[p[n].detach().clone() for n in NAMES] for p in params],
                    [glob[n].clone() for n in NAMES]))
    return out


CONFIGS = [   # (kind, steps, DiLoCo settings)
    ("adamw", 14, dict(sync_every=4, fragments=2, delay=1)),                  # α = 0: replace
    ("adamw", 15, dict(sync_every=4, fragments=2, delay=3, mix=0.5)),         # 2 fragments in flight
    ("sgd", 13, dict(sync_every=5, delay=2, mix=0.3, outer_lr=0.5, outer_momentum=0.8,
                     nesterov=False)),
    ("adamw", 15, dict(sync_every=4, fragments=3, delay=2, mix=0.5, warmup_steps=3)),
]


@pytest.mark.parametrize("kind,steps,kw", CONFIGS)
def test_exact_overlap_matches_float64_reference(pools, kind, steps, kw):
    res = pools.run(2, _train, steps, kind, torch.float64, compression=None, **kw)
    cfg = DiLoCoConfig(**kw)
    frags = res[0][2]
    ref = _reference(2, steps, kind, cfg, frags)
    for t in range(steps):
        for r in range(2):
            for n, got, want in zip(NAMES, res[r][0][t][0], ref[t][0][r]):
                assert torch.allclose(got, want, rtol=1e-11, atol=1e-13), \
                    f"rank {r} step {t + 1} {n}: max err {(got - want).abs().max():.3g}"
            for got, want in zip(res[r][0][t][1], res[0][0][t][1]):
                assert torch.equal(got, want), f"θ_global differs on rank {r} at step {t + 1}"
    _check_landed_replicas(res, cfg, frags, steps)
    # the delay matters: the same run without it ends elsewhere
    sync_cfg = DiLoCoConfig(**{k: v for k, v in kw.items() if k not in ("delay", "mix")})
    plain = _reference(2, steps, kind, sync_cfg, frags)
    assert not torch.allclose(plain[-1][0][0][0], ref[-1][0][0][0], rtol=1e-6)
    stats = res[0][1]
    landed = sum(len(cfg.lands(t)) for t in range(1, steps + 1))
    assert stats["fragment_syncs"] == landed
    per_fragment = {f: sum(dict(make_model().named_parameters())[n].numel() for n in names) * 8
                    for f, names in enumerate(frags)}          # an exact float64 all-reduce
    warmup = cfg.warmup_steps * sum(per_fragment.values())   # one gradient all-reduce per step
    assert stats["bytes_sent"] == warmup + sum(per_fragment[f] for t in range(1, steps + 1)
                                               for f in cfg.lands(t))


def _check_landed_replicas(res, cfg, frags, steps):
    """With α = 0 a landed fragment is θ_global: bitwise identical on every rank."""
    if cfg.mix != 0.0:
        return
    for t in range(1, steps + 1):
        for f in cfg.lands(t):
            for n in frags[f]:
                i = NAMES.index(n)
                a, b = res[0][0][t - 1][0][i], res[1][0][t - 1][0][i]
                assert torch.equal(a, b), f"{n} differs across ranks after landing at {t}"


def _direct(rank, world, steps, H, F, delay, mix):
    """DiLoCo with 4-bit lowbit (error feedback) and overlap next to the same rule written
    with the compressor driven directly, each reduction finished when it lands: bitwise."""
    comp = get("lowbit", bitwidth=4, error_feedback=True)
    cfg = DiLoCoConfig(H, fragments=F, delay=delay, mix=mix)
    model, opt = _build(sync_every=H, fragments=F, delay=delay, mix=mix, compression=comp)
    twin = make_model(seed=0)
    inner = _inner("adamw", twin.parameters())
    tw = dict(twin.named_parameters())
    layouts = opt.bucket_layouts
    states = [comp.init_state(l) for l in layouts]
    glob = [torch.cat([tw[s.name].detach().reshape(-1) for s in l.slots]) for l in layouts]
    buf, pending, in_flight_seen = [None] * len(layouts), {}, []
    group = bitscom.runtime.world_group()
    for t in range(1, steps + 1):
        for m, o in ((model, opt), (twin, inner)):
            _loss(m, t - 1, rank, world).backward()
            o.step()
            o.zero_grad()
        for f in cfg.due(t):
            pending[f] = [glob[b] - torch.cat([tw[s.name].detach().reshape(-1) for s in layouts[b].slots])
                          for b in opt.fragment_buckets[f]]
            if f not in cfg.lands(t):        # launched, not waited: its all-gather is not issued yet
                in_flight_seen.append(opt._reducer.reducers[f].in_flight)
        for f in cfg.lands(t):
            for b, flat in zip(opt.fragment_buckets[f], pending.pop(f)):
                comm = Comm(group)
                drive(comp.reduce(flat, layouts[b], states[b], comm), comm)
                buf[b] = flat.clone() if buf[b] is None else buf[b].mul(0.9).add(flat)
                glob[b] = glob[b].add(flat.add(buf[b], alpha=0.9), alpha=-0.7)
                with torch.no_grad():
                    for s in layouts[b].slots:
                        new = glob[b][s.offset:s.end].view(s.shape)
                        tw[s.name].copy_(new) if mix == 0 else tw[s.name].mul_(mix).add_(new, alpha=1 - mix)
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"step {t}: {n} differs from the compressor run directly"
    return [g.clone() for g in opt.global_parameters], in_flight_seen, opt.comm_stats()


@pytest.mark.parametrize("F,delay,mix", [(1, 2, 0.0), (2, 1, 0.5), (2, 3, 0.25)])
def test_lowbit_overlap_matches_compressor_run_directly(pools, F, delay, mix):
    res = pools.run(2, _direct, 13, 4, F, delay, mix)
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b), "θ_global differs across ranks"
    assert res[0][1] and all(res[0][1]), "a reduction was finished inside the step that started it"
    assert res[0][2]["fragment_syncs"] >= 2


# ------------------------------------------------------------ delay=0 is what shipped, bitwise

DIGESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "diloco_sync_digest.json")


@pytest.mark.parametrize("name", sorted(CASES))
def test_delay_zero_is_the_synchronous_diloco_bitwise(pools, name):
    """Recorded from the code before the overlap existed (tests/diloco_digest.py): parameters,
    θ_global and bytes after a few steps, on both ranks, with ``delay=0`` passed explicitly.
    Floating-point results may differ on another torch build; the recording names its version."""
    with open(DIGESTS) as f:
        recorded = json.load(f)
    if recorded["torch"] != torch.__version__.split("+")[0]:
        pytest.skip(f"digests recorded with torch {recorded['torch']}, this is {torch.__version__}")
    got = pools.run(2, digest_run, name, delay=0)
    assert got == recorded["cases"][name]


# ---------------------------------------------------------------- resume with a flight in flight

def _resume(rank, world, total, cut, path):
    kw = dict(sync_every=4, fragments=2, delay=2, mix=0.5,
              compression=bitscom.compressors.LowBit(bitwidth=4, error_feedback=True))

    def run(model, opt, start, stop, save=None):
        for t in range(start, stop):
            _loss(model, t, rank, world).backward()
            opt.step()
            opt.zero_grad()
            if save is not None and t + 1 == cut:
                in_flight = sorted(opt._flights)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, save)
                save = in_flight
        return [p.detach().clone() for p in model.parameters()], opt.comm_stats(), save

    plain = run(*_build(**kw), 0, total)                      # never checkpointed
    saved = run(*_build(**kw), 0, total, f"{path}.{rank}")    # state_dict() mid-flight
    model, opt = _build(**kw)
    ckpt = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    resumed = run(model, opt, cut, total)
    return plain, saved, resumed, [g.clone() for g in opt.global_parameters]


@pytest.mark.parametrize("cut", [4, 5, 6])   # f0 launched at 4 (f1 landed); in flight; f1 launched at 6
def test_resume_with_a_reduction_in_flight_is_bitwise(pools, tmp_path, cut):
    res = pools.run(2, _resume, 13, cut, str(tmp_path / "ckpt"))
    for r, (plain, saved, resumed, _glob) in enumerate(res):
        assert saved[2], f"rank {r}: nothing was in flight at the checkpoint (step {cut})"
        for a, b, c in zip(plain[0], saved[0], resumed[0]):
            assert torch.equal(a, b), f"rank {r}: state_dict() changed the run"
            assert torch.equal(a, c), f"rank {r}: the resumed run differs"
        assert plain[1] == saved[1] == resumed[1], (plain[1], saved[1], resumed[1])
    for a, b in zip(res[0][3], res[1][3]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- sync() with reductions in flight

def _sync_in_flight(rank, world, steps, kw):
    model, opt = _build(dtype=torch.float64, compression=None, **kw)
    for t in range(steps):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    flying, before = sorted(opt._flights), opt.comm_stats()
    opt.sync()
    after = opt.comm_stats()
    params = [p.detach().clone() for p in model.parameters()]
    opt.sync()                                   # nothing left to do: no bytes, no change
    again = opt.comm_stats()
    same = all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    named = dict(model.named_parameters())
    is_global = all(torch.equal(g[s.offset:s.end].view(s.shape), named[s.name])
                    for g, l in zip(opt.global_parameters, opt.bucket_layouts) for s in l.slots)
    return flying, before, after, again, same, params, is_global


@pytest.mark.parametrize("steps,kw,expect_syncs", [
    (9, dict(sync_every=4, fragments=2, delay=2, mix=0.5), (1, 2)),   # f0 in flight from 8; both stale
    (8, dict(sync_every=4, delay=1), (1, 0)),          # launched at 8, no step since: it lands only
])
def test_sync_lands_flights_then_syncs_what_is_stale(pools, steps, kw, expect_syncs):
    res = pools.run(2, _sync_in_flight, steps, kw)
    flying, before, after, again, same, params, model_is_global = res[0]
    assert flying, "nothing was in flight before sync()"
    landed, synced = expect_syncs
    assert after["fragment_syncs"] - before["fragment_syncs"] == landed + synced
    assert again["bytes_sent"] == after["bytes_sent"] and again["syncs"] == after["syncs"] and same
    assert model_is_global
    for a, b in zip(params, res[1][5]):
        assert torch.equal(a, b), "ranks differ after sync()"


# ---------------------------------------------------------------- errors

def _single(**kw):
    model = make_model(seed=0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiLoCo(torch.optim.AdamW(model.parameters()), model.named_parameters(), **kw)


@pytest.mark.parametrize("kw,err,match", [
    ({"delay": -1}, ValueError, r"delay must be an int >= 0, got -1"),
    ({"delay": 1.5}, ValueError, r"delay must be an int >= 0, got 1.5"),
    ({"delay": 4, "sync_every": 4}, ValueError, r"delay must be < sync_every=4 .*got 4"),
    ({"mix": 0.5}, ValueError, r"mix=0.5 needs delay > 0"),
    ({"mix": 1.5, "delay": 1}, ValueError, r"mix must be a finite number in \[0, 1\], got 1.5"),
    ({"mix": -0.1, "delay": 1}, ValueError, r"mix must be a finite number in \[0, 1\], got -0.1"),
    ({"mix": "half", "delay": 1}, TypeError, r"mix must be a number, got 'half'"),
])
def test_bad_overlap_settings(kw, err, match):
    with pytest.raises(err, match=match):
        _single(**kw)


def _disagree(rank, world, which):
    kw = {"sync_every": 4, "delay": 1}
    if rank == 1:
        kw["delay"] = 2 if which == "setting" else -1
    try:
        _build(**kw)
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("which", ["setting", "bad value"])
def test_delay_disagreement_errors_on_every_rank(pools, which):
    for m in pools.run(2, _disagree, which):
        assert "RuntimeError" in m and "DiLoCo settings" in m, m
        assert ("delay=2" in m) if which == "setting" else ("delay must be an int >= 0" in m), m


def test_single_process_overlap_runs():
    opt = _single(sync_every=4, delay=2, mix=0.5, compression=None)
    params = opt.param_groups[0]["params"]
    for _ in range(10):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    stats = opt.comm_stats()
    assert stats["syncs"] == 2 and stats["bytes_sent"] == 0    # launched at 4, 8; landed at 6, 10
    assert DiLoCoConfig(sync_every=4, fragments=2, delay=1).lands(5) == [0]


def test_checkpoint_from_before_the_overlap_loads():
    """A checkpoint written before ``delay``/``mix`` existed (its config repr lacks them, no
    flights, no fresh flags) loads into ``delay=0`` and is refused by ``delay > 0``."""
    opt = _single(sync_every=4, compression=None)
    params = opt.param_groups[0]["params"]
    for _ in range(4):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    sd = opt.state_dict()
    old = sd["diloco"]
    assert old.pop("flights") == [] and old.pop("fresh") == [True]
    old["config"] = old["config"].replace(", delay=0, mix=0.0", "")
    fresh = _single(sync_every=4, compression=None)
    fresh.load_state_dict(sd)
    assert fresh.comm_stats()["inner_steps"] == 4 and fresh._fresh == [True]
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        _single(sync_every=4, compression=None, delay=1).load_state_dict(sd)


def test_overlap_benchmark_script_runs_and_sends_the_same_bytes():
    """scripts/diloco_overlap.py end to end on 2 tiny ranks: its table, and the overlap's
    bytes equal the synchronous run's with the same fragments."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "diloco_overlap.py"), "--steps", "10",
                          "--hidden", "16", "--sync-every", "4", "--fragments", "2", "--delay", "1",
                          "--compression", "none"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["none"]]
    assert [(r[1], r[2]) for r in rows] == [("1", "0"), ("2", "0"), ("2", "1")], out.stdout
    assert rows[1][-1] == rows[2][-1], out.stdout


def _lossless(rank, world):
    kw = dict(sync_every=4, fragments=2, delay=2, mix=0.5)
    exact = _train(rank, world, 13, "adamw", torch.float32, compression=None, **kw)
    sparse = _train(rank, world, 13, "adamw", torch.float32, compression=get("topk", ratio=1.0), **kw)
    return exact, sparse


def test_lossless_compressed_overlap_equals_the_exact_one_bitwise(pools):
    """Top-k keeping every entry is lossless (2 ranks: 0 + a + b = a + b): the overlap through
    a compressor's rounds gives the exact path's parameters, bitwise, at every step."""
    for r, (exact, sparse) in enumerate(pools.run(2, _lossless)):
        for t, ((pe, ge), (ps, gs)) in enumerate(zip(exact[0], sparse[0])):
            for a, b in zip(pe + ge, ps + gs):
                assert torch.equal(a, b), f"rank {r} step {t + 1}"
        assert exact[1]["fragment_syncs"] == sparse[1]["fragment_syncs"] > 0
