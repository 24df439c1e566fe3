"""rdlm.checks: the one integer check (bools refused, one wording) and the checks a config declares."""

import argparse

import pytest

from rdlm.checks import Integer, Number, OneOf, check_int, is_int


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
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0$"):
        Number("in (0, 1]", lambda p: 0 < p <= 1)("top_p", 0)
    for bad in (float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match=r"^top_p must be a finite number, got "):
            Number("in (0, 1]", lambda p: 0 < p <= 1)("top_p", bad)
    with pytest.raises(ValueError, match=r"^cache_strategy must be 'full' or 'shared', got 'half'$"):
        OneOf(("full", "shared"))("cache_strategy", "half")
