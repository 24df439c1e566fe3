"""Checks of values a user gives (a config field, a keyword, a flag, a file's entry), each with one wording.

`check_int` is the one integer check: Python's `bool` is an `int` (`isinstance(True, int)` holds), so every
count in rdlm (iterations, slots, rows, tokens, threads) refuses True and False here, in one place.
`Integer`, `Number` and `OneOf` are checks a config declares beside its fields (GenerationConfig's):
called with the field's name and value, they raise an `InvalidValue` (a ValueError) that names it; the
first two state their bounds (`bounds`) for the documentation's tables.

A bottom module: it imports nothing of rdlm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def is_int(value: Any, minimum: int | None = None, below: int | None = None) -> bool:
    """Whether `value` is an integer (a bool is not one) in [minimum, below) (an open end: None)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or value >= minimum)
        and (below is None or value < below)
    )


def check_int(name: str, value: Any, minimum: int = 1, *, error: type[Exception] = ValueError, note: str = "") -> int:
    """`value` when it is an integer >= `minimum`; else `error` with "{name} must be an integer >= {minimum}
    {note}, got {value!r}" (an empty `name`: argparse names the flag itself)."""
    if not is_int(value, minimum):
        subject = f"{name} must" if name else "must"
        raise error(f"{subject} be an integer >= {minimum}{note}, got {value!r}")
    return value


class InvalidValue(ValueError):
    """A declared check's refusal of one field's value; `name` is the field (a server's error names it)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def figure(value: float) -> str:
    """A bound as a reader takes it in: 2**63 - 1 rather than its 19 digits."""
    if isinstance(value, int) and value >= 2**16:
        for offset, sign in ((0, ""), (1, " - 1")):
            if (value + offset) & (value + offset - 1) == 0:
                return f"2**{(value + offset).bit_length() - 1}{sign}"
    return f"{value:g}".replace("e+0", "e").replace("e+", "e") if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Integer:
    """An integer in [minimum, most] (`check_int`'s wording below the minimum); `says` words both bounds in
    one message. Every integer a request may carry needs a `most`: a value that reaches a tensor must fit it."""

    minimum: int = 1
    most: int | None = None
    says: str | None = None

    def __call__(self, name: str, value: Any) -> None:
        if self.says is None:
            if not is_int(value, self.minimum):
                raise InvalidValue(name, f"{name} must be an integer >= {self.minimum}, got {value!r}")
            if self.most is not None and value > self.most:
                raise InvalidValue(name, f"{name} must be at most {figure(self.most)}, got {value}")
        elif not is_int(value, self.minimum, None if self.most is None else self.most + 1):
            raise InvalidValue(name, f"{name} must be {self.says}, got {value!r}")

    @property
    def bounds(self) -> str:
        """The values it takes, as an interval: [1, 2**16]."""
        return f"[{figure(self.minimum)}, {'inf)' if self.most is None else figure(self.most) + ']'}"


@dataclass(frozen=True)
class Number:
    """A finite number (NaN passes every comparison: it is refused first, as are infinity and bools) in
    [low, high], each end left out with `open_low` / `open_high`; `note` says why, after the bounds."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    note: str = ""

    def __call__(self, name: str, value: Any) -> None:
        # (an int of any size is finite: math.isfinite would overflow converting it)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise InvalidValue(name, f"{name} must be a finite number, got {value!r}")
        low = self.low is None or (value > self.low if self.open_low else value >= self.low)
        high = self.high is None or (value < self.high if self.open_high else value <= self.high)
        if not (low and high):
            raise InvalidValue(name, f"{name} must be a finite number {self.says}{self.note}, got {value}")

    @property
    def says(self) -> str:
        """The bounds in words: ">= 1 and <= 65536" (how a refusal states them)."""
        ends = ([f"{'>' if self.open_low else '>='} {figure(self.low)}"] if self.low is not None else []) + (
            [f"{'<' if self.open_high else '<='} {figure(self.high)}"] if self.high is not None else []
        )
        return " and ".join(ends)

    @property
    def bounds(self) -> str:
        """The values it takes, as an interval: (0, 1]."""
        low = "-inf" if self.low is None else figure(self.low)
        high = "inf" if self.high is None else figure(self.high)
        left = "(" if self.open_low or self.low is None else "["
        right = ")" if self.open_high or self.high is None else "]"
        return f"{left}{low}, {high}{right}"


@dataclass(frozen=True)
class OneOf:
    """One of a few names."""

    choices: tuple[str, ...]

    def __call__(self, name: str, value: Any) -> None:
        if value not in self.choices:
            raise InvalidValue(name, f"{name} must be {' or '.join(map(repr, self.choices))}, got {value!r}")
