"""Shared by the transformers / lm-eval / eval tests: a tiny model directory with a tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import torch

from rdlm import RDLMConfig, RecurrentDepthLM, save_pretrained
from rdlm.data.tokenizer import train_tokenizer

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Two plus two is four. Three plus three is six.",
    "Ravens are black birds. Huginn and Muninn are the ravens of Odin.",
] * 20


def write_tokenizer(directory: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer.json with the Huginn special tokens, trained by rdlm."""
    return train_tokenizer(CORPUS, vocab_size=vocab_size).save(directory)


def tiny_model_dir(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))
    save_pretrained(model, directory)
    write_tokenizer(directory)
    return directory
