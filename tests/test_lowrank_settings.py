"""PowerSGD / ACP-SGD settings: the switches are bools only (issue 9's unclear errors)."""

import pytest

from bitscom.compressors import ACPSGD, PowerSGD


@pytest.mark.parametrize("cls", [PowerSGD, ACPSGD])
@pytest.mark.parametrize("name,value", [("error_feedback", "no"), ("warm_start", 0),
                                        ("batch_same_shape", None), ("error_feedback", 1)])
def test_switches_must_be_bools(cls, name, value):
    with pytest.raises(TypeError, match=f"{name} must be a bool.*got {value!r}"):
        cls(**{name: value})


@pytest.mark.parametrize("cls", [PowerSGD, ACPSGD])
def test_bools_are_accepted(cls):
    comp = cls(error_feedback=False, warm_start=False, batch_same_shape=False)
    assert comp.error_feedback is False and comp.warm_start is False
