"""Names of weight dtypes, read in one place: `--dtype` flags, `dtype=` arguments, lm-eval model args
and the transformers integration all go through `resolve_dtype`."""

from __future__ import annotations

from typing import Any

import torch

# Every spelling a caller may use, short and long; "torch.bfloat16" is accepted too (prefix dropped).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}
# Spellings meaning "the checkpoint's own dtype" (transformers says "auto", `rdlm convert` "keep").
KEEP = ("auto", "keep")
# The choices a command line offers (one spelling each, plus the short ones people type).
CHOICES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    """A torch dtype from a name, an alias or a dtype; None for None, "auto" and "keep" (the
    checkpoint's own). Anything else raises ValueError naming the accepted names."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name in KEEP:
        return None
    if name not in DTYPES:
        raise ValueError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)} "
            f"(or {' / '.join(KEEP)} for the checkpoint's own)"
        )
    return DTYPES[name]
