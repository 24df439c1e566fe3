"""rdlm.checks: the one integer check (bools refused, one wording) and the checks a config declares."""

import argparse

import pytest

from rdlm.checks import Integer, InvalidValue, Number, OneOf, check_int, figure, is_int


@pytest.mark.parametrize("value", [0, -3, True, False, 2.0, "2", None])
def test_check_int_refuses_what_is_not_an_integer_at_least_the_minimum(value):
    with pytest.raises(ValueError, match=rf"^rows must be an integer >= 1, got {value!r}$"):
        check_int("rows", value)


def test_check_int_returns_the_value_and_takes_a_minimum_a_note_and_an_error_class():
    assert check_int("rows", 3) == 3 and check_int("rows", 0, 0) == 0
    with pytest.raises(KeyError, match=r"seq_len must be an integer >= 2 \(None: all\), got 1"):
        check_int("seq_len", 1, 2, error=KeyError, note=" (None: all)")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be an integer >= 0, got -1$"):
        check_int("", -1, 0, error=argparse.ArgumentTypeError)   # argparse puts the flag in front


def test_is_int_bounds_are_half_open_and_a_bool_is_never_an_integer():
    assert is_int(0) and is_int(-5) and not is_int(True) and not is_int(1.0)
    assert is_int(3, 3, 4) and not is_int(4, 3, 4) and not is_int(2, 3)


def test_declared_checks_name_the_field_in_their_messages():
    Integer(0, 20)("logprobs", 20)
    with pytest.raises(ValueError, match=r"^logprobs must be at most 20, got 21$"):
        Integer(0, 20)("logprobs", 21)
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 2\*\*63\), got -1$"):
        Integer(0, 2**63 - 1, "an integer in [0, 2**63)")("seed", -1)
    with pytest.raises(ValueError, match=r"^top_p must be a finite number > 0 and <= 1, got 0$"):
        Number(0, 1, open_low=True)("top_p", 0)
    for bad in (float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match=r"^top_p must be a finite number, got "):
            Number(0, 1, open_low=True)("top_p", bad)
    with pytest.raises(ValueError, match=r"^cache_strategy must be 'full' or 'shared', got 'half'$"):
        OneOf(("full", "shared"))("cache_strategy", "half")


def test_declared_bounds_hold_for_any_size_of_number_and_say_themselves():
    """An integer of any size is compared exactly (never converted to a float that overflows), and each
    check states its interval as the documentation's tables give it."""
    with pytest.raises(InvalidValue, match=r"^min_steps must be at most 2\*\*16, got ") as caught:
        Integer(1, 2**16)("min_steps", 2**63)
    assert caught.value.name == "min_steps"
    with pytest.raises(InvalidValue, match=r"^temperature must be a finite number >= 0 and <= 1e6, got "):
        Number(0, 1e6)("temperature", 10**400)
    Number(0, 1e6)("temperature", 10**6)
    assert Integer(0, 2**63 - 1).bounds == "[0, 2**63 - 1]" and Integer(1).bounds == "[1, inf)"
    assert Number(0, 1, open_low=True).bounds == "(0, 1]" and Number(0, 1, open_high=True).bounds == "[0, 1)"
    assert figure(1e6) == "1e6" and figure(2**36) == "2**36" and figure(1000.0) == "1000"
