"""Shared by the transformers / lm-eval / eval tests: a tiny model directory with a tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import torch

from rdlm import RDLMConfig, RecurrentDepthLM, save_pretrained

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Two plus two is four. Three plus three is six.",
    "Ravens are black birds. Huginn and Muninn are the ravens of Odin.",
] * 20
SPECIAL_TOKENS = ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>",
                  "<|pad|>"]


def write_tokenizer(directory: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer.json with the Huginn special tokens (ids right after the merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def tiny_model_dir(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))
    save_pretrained(model, directory)
    write_tokenizer(directory)
    return directory
