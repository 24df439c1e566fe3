"""Checks of values a user gives (a config field, a keyword, a flag, a file's entry), each with one wording.

`check_int` is the one integer check: Python's `bool` is an `int` (`isinstance(True, int)` holds), so every
count in rdlm (iterations, slots, rows, tokens, threads) refuses True and False here, in one place.
`Integer`, `Number` and `OneOf` are checks a config declares beside its fields (GenerationConfig's):
called with the field's name and value, they raise a ValueError that names it.

A bottom module: it imports nothing of rdlm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


def is_int(value: Any, minimum: int | None = None, below: int | None = None) -> bool:
    """Whether `value` is an integer (a bool is not one) in [minimum, below) (an open end: None)."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (minimum is None or value >= minimum) and (below is None or value < below))


def check_int(name: str, value: Any, minimum: int = 1, *, error: type[Exception] = ValueError,
              note: str = "") -> int:
    """`value` when it is an integer >= `minimum`; else `error` with "{name} must be an integer >= {minimum}
    {note}, got {value!r}" (an empty `name`: argparse names the flag itself)."""
    if not is_int(value, minimum):
        subject = f"{name} must" if name else "must"
        raise error(f"{subject} be an integer >= {minimum}{note}, got {value!r}")
    return value


@dataclass(frozen=True)
class Integer:
    """An integer >= `minimum` (`check_int`), at most `most`; `says` words both bounds in one message."""
    minimum: int = 1
    most: int | None = None
    says: str | None = None

    def __call__(self, name: str, value: Any) -> None:
        if self.says is None:
            check_int(name, value, self.minimum)
            if self.most is not None and value > self.most:
                raise ValueError(f"{name} must be at most {self.most}, got {value}")
        elif not is_int(value, self.minimum, None if self.most is None else self.most + 1):
            raise ValueError(f"{name} must be {self.says}, got {value!r}")


@dataclass(frozen=True)
class Number:
    """A finite number (NaN passes every comparison: it is refused first, as are infinity and bools),
    then within the bounds `within` tests and `says` words."""
    says: str = ""
    within: Callable[[float], bool] | None = None

    def __call__(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.within is not None and not self.within(value):
            raise ValueError(f"{name} must be {self.says}, got {value}")


@dataclass(frozen=True)
class OneOf:
    """One of a few names."""
    choices: tuple[str, ...]

    def __call__(self, name: str, value: Any) -> None:
        if value not in self.choices:
            raise ValueError(f"{name} must be {' or '.join(map(repr, self.choices))}, got {value!r}")
