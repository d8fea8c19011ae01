"""bitscom.validate: one wording for number, flag and choice errors, naming the value."""

import math

import pytest

from bitscom.validate import choice, flag, number


@pytest.mark.parametrize("kwargs, value, message", [
    (dict(minimum=1, integer=True), 0, "x must be an int >= 1, got 0"),
    (dict(minimum=1, integer=True), True, "x must be an int >= 1, got True"),
    (dict(minimum=1, integer=True), 1.5, "x must be an int >= 1, got 1.5"),
    (dict(minimum=0, maximum=1, inclusive=(False, True)), 0, "x must be a number in (0, 1], got 0"),
    (dict(minimum=0, maximum=1, inclusive=(True, False)), 1.0, "x must be a number in [0, 1), got 1.0"),
    (dict(minimum=0, maximum=1), math.nan, "x must be a number in [0, 1], got nan"),
    (dict(minimum=0, finite=True), math.inf, "x must be a finite number >= 0, got inf"),
    (dict(minimum=0, inclusive=False), "3", "x must be a number > 0, got '3'"),
])
def test_number_refuses_naming_the_value_and_the_range(kwargs, value, message):
    with pytest.raises(ValueError) as err:
        number("x", value, **kwargs)
    assert str(err.value) == message


def test_good_values_pass_through_and_flags_and_choices_name_what_is_allowed():
    assert number("x", 3, minimum=1, integer=True) == 3
    assert number("x", 0.5, minimum=0, maximum=1) == 0.5
    assert flag("f", False) is False
    assert choice("c", "qr", ("auto", "qr")) == "qr"
    with pytest.raises(TypeError, match=r"f must be a bool \(True or False\), got 'no'"):
        flag("f", "no")
    with pytest.raises(ValueError, match=r"c must be one of \('a', 'b'\), got 1"):
        choice("c", 1, ("a", "b"))
    with pytest.raises(ValueError, match="got True"):
        choice("c", True, (1, 2))        # True == 1, but it is not the int 1


def test_numbers_names_the_bad_item_and_instance_names_value_and_type():
    from bitscom.validate import instance, numbers
    assert numbers("c", [1, 2.5], nonempty=True, minimum=0, inclusive=False) == (1, 2.5)
    with pytest.raises(ValueError) as err:
        numbers("c", [1, "2"], minimum=0, inclusive=False)
    assert str(err.value) == "c[1] must be a number > 0, got '2'"
    with pytest.raises(ValueError) as err:
        numbers("c", [], nonempty=True, minimum=0, finite=True)
    assert str(err.value) == "c must be a non-empty sequence of finite numbers >= 0, got []"
    with pytest.raises(TypeError) as err:
        numbers("c", "25", integer=True)      # a string is no sequence of numbers
    assert str(err.value) == "c must be a sequence of ints, got '25'"
    assert instance("x", 3, int, "an int") == 3
    with pytest.raises(TypeError) as err:
        instance("x", True, int, "an int bit width")   # a bool is no int here
    assert str(err.value) == "x must be an int bit width, got True (bool)"


def test_real_is_a_float_checked_by_number_and_no_number_at_all_is_a_type_error():
    from bitscom.validate import real
    assert real("x", 2, minimum=0) == 2.0 and isinstance(real("x", 2), float)
    for bad, shown in (("2", "'2' (str)"), (True, "True (bool)"), (None, "None (NoneType)")):
        with pytest.raises(TypeError) as err:
            real("x", bad, minimum=0)
        assert str(err.value) == f"x must be a number, got {shown}"
    with pytest.raises(ValueError) as err:
        real("x", -1, minimum=0, finite=True)
    assert str(err.value) == "x must be a finite number >= 0, got -1.0"


def test_instance_shows_a_long_repr_short_and_on_one_line():
    from bitscom.validate import instance

    class Model:
        def __repr__(self):
            return "Model(\n" + "  (layer): Linear()\n" * 200 + ")"

    with pytest.raises(TypeError) as err:
        instance("optimizer", Model(), int, "a torch.optim.Optimizer")
    msg = str(err.value)
    assert msg.startswith("optimizer must be a torch.optim.Optimizer, got Model( (layer)") and msg.endswith(" (Model)")
    assert "\n" not in msg and "..." in msg and len(msg) < 140, msg


def test_the_why_of_a_bound_ends_the_message():
    """Where a bound has a reason the user needs, the error says it after the value."""
    from bitscom.lowbit import LowBitConfig
    from bitscom.onebit.config import OneBitConfig
    with pytest.raises(ValueError, match=r"got 3; 32 = full-precision float32$"):
        LowBitConfig(bitwidth=3)
    with pytest.raises(TypeError, match=r"got 'yes'; pick a mode with error_feedback_mode="):
        LowBitConfig(error_feedback="yes")
    with pytest.raises(ValueError, match=r"freeze_step must be an int >= 1, got 0; the exact warm-up"):
        OneBitConfig(freeze_step=0)
    with pytest.raises(ValueError, match=r"^x must be a number >= 0, got -1$"):
        number("x", -1, minimum=0)                     # no why: nothing appended
