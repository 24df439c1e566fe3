"""What a quantization spec says (rdlm.model.quantize, docs/quantization.md): which scheme each part of the
loop gets, and the int4 group size; its text form (`--quantize`) and its JSON form (config.json)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PARTS = ("prelude", "core", "coda", "head")
SCHEMES = ("none", "int8", "int4", "w8a8")
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
DEFAULT_GROUP_SIZE = 128
CONFIG_KEY = "rdlm_quantization"
SUFFIXES = ("qweight", "scales", "zeros")


class QuantizationError(ValueError):
    """A quantization spec or stored quantized tensor that cannot be used (one line naming it)."""


@dataclass(frozen=True)
class QuantSpec:
    """Which parts are quantized and how. `QuantSpec.parse("int8")`, `parse("core=int4,prelude=int8")`,
    `parse("int4,head=int8")` (a bare scheme sets every part; `part=scheme` items override it; "+" and ":"
    may stand for "," and "=", e.g. in lm-eval's model_args: `quantize=int4+head:int8`)."""

    prelude: str = "none"
    core: str = "none"
    coda: str = "none"
    head: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        for part in PARTS:
            if getattr(self, part) not in SCHEMES:
                raise QuantizationError(
                    f"quantization of {part}: unknown scheme {getattr(self, part)!r} "
                    f"(expected one of {', '.join(SCHEMES)})"
                )
        if self.group_size not in GROUP_SIZES:
            raise QuantizationError(
                f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}"
            )

    @classmethod
    def parse(cls, text: str, group_size: int = DEFAULT_GROUP_SIZE) -> QuantSpec:
        values: dict[str, str] = {}
        named: set[str] = set()
        # "," and "=" as written; "+" and ":" also, for places where commas separate arguments (lm-eval)
        items = [item.strip() for item in str(text).replace("+", ",").replace(":", "=").split(",")]
        if not text or not all(items):
            raise QuantizationError(
                f"empty item in quantization spec {text!r} (e.g. 'int8' or 'core=int4,prelude=int8,coda=none')"
            )
        for number, item in enumerate(items):
            if "=" not in item:
                if number > 0:  # it would set every part again, undoing what the items before it said
                    raise QuantizationError(
                        f"quantization spec {text!r}: the scheme for every part ({item!r}) "
                        "comes first, e.g. 'int4,core=int8'"
                    )
                values.update(dict.fromkeys(PARTS, item))
                continue
            part, scheme = (s.strip() for s in item.split("=", 1))
            if part not in PARTS:
                raise QuantizationError(
                    f"quantization spec {text!r}: unknown part {part!r} (expected {', '.join(PARTS)})"
                )
            if part in named:  # the last would win, silently
                raise QuantizationError(f"quantization spec {text!r}: part {part!r} is named twice")
            named.add(part)
            values[part] = scheme
        return cls(**values, group_size=group_size)

    @property
    def active(self) -> bool:
        return any(getattr(self, part) != "none" for part in PARTS)

    def __str__(self) -> str:
        schemes = [getattr(self, part) for part in PARTS]
        text = (
            schemes[0] if len(set(schemes)) == 1 else ",".join(f"{p}={s}" for p, s in zip(PARTS, schemes, strict=True))
        )
        return text + (f" (group {self.group_size})" if "int4" in schemes else "")

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Any, source: str = "config.json") -> QuantSpec:
        if not isinstance(raw, dict) or set(raw) - {f.name for f in fields(cls)}:
            raise QuantizationError(
                f"{source}: {CONFIG_KEY} must be an object with keys "
                f"{', '.join(f.name for f in fields(cls))}, got {raw!r}"
            )
        return cls(**raw)


def as_spec(value: QuantSpec | str | None, group_size: int = DEFAULT_GROUP_SIZE) -> QuantSpec | None:
    """A spec from a spec, its text or None (None and all-"none" mean no quantization)."""
    spec = QuantSpec.parse(value, group_size) if isinstance(value, str) else value
    return spec if spec is not None and spec.active else None
