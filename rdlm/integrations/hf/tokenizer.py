"""The tokenizer class registered for "huginn_raven": a tokenizer.json with Huginn's special tokens and
chat template by default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from rdlm.data.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS


class RavenTokenizerFast(PreTrainedTokenizerFast):
    """A tokenizer.json with Huginn's special tokens and chat template by default
    (BOS first, then <|begin_header|>ROLE<|end_header|>\\n\\nTEXT<|end_turn|> per turn, assistant "Huginn";
    docs/checkpoint-format.md#tokenizer)."""

    # No __init__ of its own: transformers 5 then loads tokenizer.json as it is, instead of rebuilding
    # the pipeline from vocab and merges.

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> RavenTokenizerFast:
        return cls._with_huginn_defaults(super().from_pretrained(*args, **kwargs))

    @classmethod
    def _with_huginn_defaults(cls, tokenizer: RavenTokenizerFast) -> RavenTokenizerFast:
        vocab = tokenizer.get_vocab()
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the special token(s) {', '.join(missing)}")
        tokenizer.bos_token = tokenizer.bos_token or BOS
        tokenizer.eos_token = tokenizer.eos_token or EOS
        tokenizer.pad_token = tokenizer.pad_token or PAD
        tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
        return tokenizer


def load_tokenizer(path: str | os.PathLike) -> RavenTokenizerFast:
    """The tokenizer of a model directory (or a tokenizer.json file itself)."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json")
    return RavenTokenizerFast._with_huginn_defaults(RavenTokenizerFast(tokenizer_file=str(file)))
