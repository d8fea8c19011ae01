"""Bad inputs to the cost model, the scripts' command lines, ``python -m bitscom`` and
``bitscom.fsdp.compress`` get a clear error (issue 35): the right exception type, and a message
that names the parameter, the bad value (its repr) and what is allowed. Each case here used to
pass silently, give a wrong number, or fail with a message naming none of these."""

import math
import os
import subprocess
import sys

import pytest
import torch

import bitscom
from bitscom.cost import (Link, LocalTransport, Topology, choose_fusion_threshold_mb, fit_link, layout_of,
                          predict_step, ready_times, recorded_rounds, rounds_for, time_codec)
from bitscom.cost.formulas import messages, wire_bytes
from bitscom.runtime import discover

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = math.nan, math.inf
TOPO = Topology.flat(4, Link.from_gbit(1, latency_s=1e-4))
PARAMS = [("w", torch.zeros(1000))]
FP16 = bitscom.compressors.get("fp16")


def _rounds():
    return [rounds_for("none", 100, 4)]


def _raises(exc, call, name, value, allowed):
    with pytest.raises(exc) as err:
        call()
    msg = str(err.value)
    assert name in msg and repr(value) in msg and allowed in msg, msg


# (call, parameter named, bad value, what is allowed): a ValueError for each
COST = {
    "rounds_for numel<0": (lambda: rounds_for("none", -5, 4), "numel", -5, "an int >= 0"),
    "rounds_for numel fractional": (lambda: rounds_for("none", 2.5, 4), "numel", 2.5, "an int >= 0"),
    "rounds_for numel bool": (lambda: rounds_for("none", True, 4), "numel", True, "an int >= 0"),
    "layout_of numel<0": (lambda: layout_of(-5), "numel", -5, "an int >= 0"),
    "layout_of shape fractional": (lambda: layout_of(10, shapes=[(2.5, 4)]), "shapes[0][0]", 2.5, "an int >= 0"),
    "wire_bytes nbytes<0": (lambda: wire_bytes("all_reduce", -1, 4), "nbytes", -1, "an int >= 0"),
    "wire_bytes p=0": (lambda: wire_bytes("all_reduce", 10, 0), "p", 0, "an int >= 1"),
    "messages p=-1": (lambda: messages("all_reduce", -1), "p", -1, "an int >= 1"),
    "ready_times numel<0": (lambda: ready_times([-1, 3], 0.4), "numels[0]", -1, "an int >= 0"),
    "ready_times numel fractional": (lambda: ready_times([3, 1.5], 0.4), "numels[1]", 1.5, "an int >= 0"),
    "ready_times numel bool": (lambda: ready_times([True, 3], 0.4), "numels[0]", True, "an int >= 0"),
    "ready_times backward nan": (lambda: ready_times([1, 3], NAN), "backward_s", NAN, "a finite number >= 0"),
    "ready_times backward<0": (lambda: ready_times([1, 3], -1.0), "backward_s", -1.0, "a finite number >= 0"),
    "predict_step backward nan": (lambda: predict_step(_rounds(), TOPO, backward_s=NAN), "backward_s", NAN,
                                  "a finite number >= 0"),
    "predict_step forward<0": (lambda: predict_step(_rounds(), TOPO, forward_s=-1), "forward_s", -1,
                               "a finite number >= 0"),
    "predict_step optimizer nan": (lambda: predict_step(_rounds(), TOPO, optimizer_s=NAN), "optimizer_s", NAN,
                                   "a finite number >= 0"),
    "predict_step ready<0": (lambda: predict_step(_rounds(), TOPO, ready_s=[-1.0]), "ready_s[0]", -1.0,
                             "a finite number >= 0"),
    "predict_step codec nan": (lambda: predict_step(_rounds(), TOPO, codec_s=[NAN]), "codec_s[0]", NAN,
                               "a finite number >= 0"),
    "predict_step poll nan": (lambda: predict_step(_rounds(), TOPO, poll_s=[NAN]), "poll_s[0]", NAN,
                              "a finite number >= 0"),
    "fit_link world=0": (lambda: fit_link([(1000, 1e-3)], 0), "world", 0, "an int >= 1"),
    "fit_link world=-1": (lambda: fit_link([(1000, 1e-3)], -1), "world", -1, "an int >= 1"),
    "fit_link world fractional": (lambda: fit_link([(1000, 1e-3), (2000, 2e-3)], 2.5), "world", 2.5,
                                  "an int >= 1"),
    "fit_link seconds nan": (lambda: fit_link([(1000, NAN), (2000, 2e-3)], 2), "samples[0] seconds", NAN,
                             "a finite number >= 0"),
    "fit_link seconds<0": (lambda: fit_link([(1000, 1e-3), (2000, -1.0)], 2), "samples[1] seconds", -1.0,
                           "a finite number >= 0"),
    "fit_link nbytes<0": (lambda: fit_link([(-1000, 1.0), (2000, 2e-3)], 2), "samples[0] nbytes", -1000,
                          "an int >= 0"),
    "time_codec world=0": (lambda: time_codec(FP16, layout_of(10), 0), "world", 0, "an int >= 1"),
    "time_codec world=-1": (lambda: time_codec(FP16, layout_of(10), -1), "world", -1, "an int >= 1"),
    "time_codec repeats=0": (lambda: time_codec(FP16, layout_of(10), 2, repeats=0), "repeats", 0, "an int >= 1"),
    "recorded_rounds world=0": (lambda: recorded_rounds(FP16, layout_of(10), 0), "world", 0, "an int >= 1"),
    "LocalTransport size=0": (lambda: LocalTransport(0), "LocalTransport size", 0, "an int >= 1"),
    "Link.seconds nbytes<0": (lambda: Link(0.0, 1e-9).seconds(-1), "nbytes", -1, "a finite number >= 0"),
    "Link.seconds messages nan": (lambda: Link(0.0, 1e-9).seconds(10, NAN), "messages", NAN,
                                  "a finite number >= 0"),
    "choose_fusion backward nan": (lambda: choose_fusion_threshold_mb(PARAMS, TOPO, backward_s=NAN), "backward_s",
                                   NAN, "a finite number >= 0"),
    "choose_fusion backward<0": (lambda: choose_fusion_threshold_mb(PARAMS, TOPO, backward_s=-1.0), "backward_s",
                                 -1.0, "a finite number >= 0"),
}


@pytest.mark.parametrize("case", list(COST))
def test_cost_model_refuses_bad_counts_sizes_and_times(case):
    call, name, value, allowed = COST[case]
    _raises(ValueError, call, name, value, allowed)


@pytest.mark.parametrize("candidates, exc, name", [
    (["25"], ValueError, "candidates[0]"),         # was: "Exceeds the limit (4300 digits)"
    ([], ValueError, "candidates"),                 # was: a bare AssertionError
    ([INF], ValueError, "candidates[0]"),           # was: OverflowError
    ([NAN], ValueError, "candidates[0]"),
    ([8, -1], ValueError, "candidates[1]"),
    ([0], ValueError, "candidates[0]"),
    ([True], ValueError, "candidates[0]"),          # True would plan 1 MiB buckets
    (25, TypeError, "candidates"),                  # was: 'int' object is not iterable
    ("25", TypeError, "candidates"),                # a string is no sequence of numbers
])
def test_fusion_candidates_must_be_a_nonempty_sequence_of_finite_positive_numbers(candidates, exc, name):
    bad = candidates[-1] if isinstance(candidates, list) and candidates else candidates
    allowed = "finite number > 0" if name.endswith("]") else "non-empty sequence of finite numbers > 0"
    _raises(exc, lambda: choose_fusion_threshold_mb(PARAMS, TOPO, candidates=candidates), name, bad, allowed)
    # ... also where no prediction runs (no parameters, one rank): was max() of the bad list
    _raises(exc, lambda: choose_fusion_threshold_mb([], Topology(1), candidates=candidates), name, bad, allowed)


def test_good_inputs_still_predict():
    """The checks refuse nothing the model used to answer correctly (independent numbers)."""
    assert ready_times([100, 300], 0.4) == [0.1, 0.4]
    assert messages("all_reduce", 4) == 6.0 and wire_bytes("all_gather", 10, 4) == 30.0
    assert choose_fusion_threshold_mb(PARAMS, Topology(1), candidates=(0.5, 2)) == 2.0
    assert fit_link([(1000, 1e-3)], 1) == Link(0.0, 0.0)
    assert layout_of(0).numel == 0 and rounds_for("none", 0, 4) == []


# --- python -m bitscom ----------------------------------------------------------------------

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
               "SLURM_NTASKS")


def _run(args, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_vars)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_python_m_bitscom_help_prints_usage_not_the_report():
    p = _run(["-m", "bitscom", "--help"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: python -m bitscom"), p.stdout[:500]
    assert "launcher:" not in p.stdout and "WORLD_SIZE=abc" in p.stdout


@pytest.mark.parametrize("env, var, value, allowed", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE", "abc", "an int >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE", 0, "an int >= 1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK", "x", "an int >= 0"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK", -1, "an int >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1.5"}, "LOCAL_RANK", "1.5", "an int >= 0"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "two"}, "OMPI_COMM_WORLD_SIZE", "two", "an int >= 1"),
])
def test_a_bad_launcher_variable_is_one_line_naming_it(env, var, value, allowed):
    with pytest.raises(ValueError) as err:      # what bitscom.init() raises (it calls discover)
        discover(env)
    assert f"environment variable {var} " in str(err.value) and repr(value) in str(err.value)
    p = _run(["-m", "bitscom"], **env)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert var in lines[0] and repr(value) in lines[0] and allowed in lines[0], lines[0]
    assert p.stdout == ""


# --- scripts/scale.py --compute-ms ----------------------------------------------------------

@pytest.mark.parametrize("entry, allowed", [
    ("resnet50=-1", "> 0"),              # used to predict with a negative compute time
    ("resnet50=abc", "> 0"),
    ("resnet50=inf", "> 0"),
    ("nosuchmodel=5", "'resnet50', 'resnet152'"),   # used to be ignored: the model names
    ("garbage", "MODEL=MS"),             # used to be a traceback: the format, and the models
])
def test_scale_compute_ms_bad_entry_is_a_usage_error_naming_it(entry, allowed, tmp_path):
    p = _run([os.path.join("scripts", "scale.py"), "--quick", "--no-plot", "--out", str(tmp_path),
              "--compute-ms", entry])
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr and p.stderr.startswith("usage: scale.py"), p.stderr[-2000:]
    error = p.stderr.strip().splitlines()[-1]
    assert error.startswith("scale.py: error: ") and "--compute-ms" in error, error
    assert repr(entry) in error and allowed in error, error
    assert not (tmp_path / "scale_speedup.csv").exists()


# --- bitscom.fsdp.compress ------------------------------------------------------------------

@pytest.mark.parametrize("kwarg, value, allowed", [
    ("gradients", 3.5, "(1, 2, 4, 8, 12, 16, 32)"),
    ("gradients", "4", "(1, 2, 4, 8, 12, 16, 32)"),
    ("gradients", True, "(1, 2, 4, 8, 12, 16, 32)"),
    ("weights", 3.5, "(1, 2, 4, 8, 12, 16)"),
    ("weights", "8", "(1, 2, 4, 8, 12, 16)"),
])
def test_fsdp_compress_names_the_bad_setting_its_value_and_the_allowed_widths(kwarg, value, allowed):
    """Checked before the module is looked at: the same TypeError on a plain module."""
    import bitscom.fsdp
    with pytest.raises(TypeError) as err:
        bitscom.fsdp.compress(torch.nn.Linear(2, 2), **{kwarg: value})
    msg = str(err.value)
    assert msg.startswith(f"{kwarg} must be ") and f"got {value!r} ({type(value).__name__})" in msg, msg
    assert allowed in msg and "Config" in msg, msg


def test_hsdp_replicate_names_the_bad_value_and_the_allowed_widths():
    from bitscom.fsdp.replicate import replicate_config
    with pytest.raises(TypeError) as err:
        replicate_config("4")
    msg = str(err.value)
    assert msg.startswith("replicate must be ") and "got '4' (str)" in msg and "(1, 2, 4, 8, 12, 16, 32)" in msg
