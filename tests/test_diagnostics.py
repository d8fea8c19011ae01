"""Unknown names and settings are answered with what was probably meant; the library logs its
plan at DEBUG through the "bitscom" logger (and stays silent otherwise)."""

import logging
import warnings

import pytest
import torch

import bitscom


@pytest.mark.parametrize("call,words", [
    (lambda: bitscom.compressors.get("powersdg"), ["'powersdg'", "did you mean 'powersgd'"]),
    (lambda: bitscom.compressors.get("powersgd", rnak=2), ["'rnak'", "did you mean 'rank'", "takes ['rank'"]),
    (lambda: bitscom.compressors.get("topk", ratoi=0.1), ["did you mean 'ratio'"]),
    (lambda: bitscom.compressors.get("lowbit", bitwdith=2), ["'bitwdith'", "did you mean 'bitwidth'"]),
    (lambda: bitscom.LowBitGroup(error_feedbak=True), ["did you mean 'error_feedback'"]),
])
def test_misspelled_names_get_a_suggestion(call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)


def test_no_suggestion_for_a_name_nothing_resembles():
    with pytest.raises(ValueError) as info:
        bitscom.compressors.get("zzzzzz")
    assert "did you mean" not in str(info.value) and "registered names" in str(info.value)


def _build():
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "single process" warning
        bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), compression="fp16")


def test_the_plan_is_logged_at_debug_only(caplog):
    with caplog.at_level(logging.INFO, logger="bitscom"):
        _build()
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="bitscom"):
        _build()
    [record] = [r for r in caplog.records if r.name == "bitscom"]
    assert "DistributedOptimizer on rank 0 of 1" in record.message
    assert "bucket0" in record.message and "FP16Compressor" in record.message
