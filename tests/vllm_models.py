"""Tiny random models of every family rdlm reads, with a head size vLLM's CPU attention takes (32: its
smallest), saved in each family's own layout: what the vLLM plugin's tests and benchmark serve. The
conformance fixtures (tests/fixtures) have 16-wide heads, which vLLM's CPU backend refuses. And the plugin
tests' helpers: vLLM's greedy tokens (`served`, which imports vLLM) and `rdlm generate`'s (`rdlm_tokens`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from rdlm.model.huginn import load_pretrained, read_config, save_pretrained
from rdlm.model.lm import RecurrentDepthLM

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# family -> (conformance fixture whose wiring the model takes, head counts that make 32-wide heads)
FAMILIES = {
    "huginn": (FIXTURES / "huginn-tiny", {"num_heads": 2, "num_kv_heads": None}),
    "retrofit-llama": (FIXTURES / "families" / "retrofit-llama-tiny", {"num_heads": 2, "num_kv_heads": 1}),
    "retrofit-olmo": (FIXTURES / "families" / "retrofit-olmo-tiny", {"num_heads": 2, "num_kv_heads": 1}),
    "ouro": (FIXTURES / "families" / "ouro-tiny", {"num_heads": 2, "num_kv_heads": 1}),
}


def make_model(family: str, path: str | Path, seed: int = 0, **changes) -> Path:
    """A random model of `family` (its fixture's wiring, 64 wide with 32-wide heads) saved at `path`. Norm
    weights and biases are random too, so a norm or bias in the wrong place changes the tokens."""
    fixture, heads = FAMILIES[family]
    config = read_config(fixture).replace(head_size=None, **heads, **changes)
    torch.manual_seed(seed)
    model = RecurrentDepthLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return save_pretrained(model, path)


NEW_TOKENS = 8
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=96 << 20,
              skip_tokenizer_init=True, seed=0)


def prompts_for(vocab: int, lengths=(3, 37, 150), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return {family: make_model(family, root / family, seed=1) for family in FAMILIES}


def served(path, prompts, engine: dict | None = None, **overrides) -> tuple[list[list[int]], object]:
    """Greedy tokens vLLM gives for `prompts` (one batch; a list of batches: one after the other in the same
    engine, their tokens concatenated), and the model's exit statistics (with the KV caches it holds, `caches`,
    each token's log-probability, `logprobs`, and the engine config, `vllm_config`). `engine`: vllm.LLM's
    arguments (default ENGINE)."""
    import vllm

    llm = vllm.LLM(str(path), hf_overrides=overrides, **(ENGINE if engine is None else engine))
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False,
                                     logprobs=0)
        batches = prompts if prompts and isinstance(prompts[0][0], list) else [prompts]
        outputs = [o for batch in batches
                   for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        stats = llm.apply_model(lambda model: model.stats)[0]
        stats.caches = llm.apply_model(lambda model: len(model.kv))[0]
        stats.logprobs = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs]
        stats.vllm_config = llm.llm_engine.vllm_config
        return [list(o.outputs[0].token_ids) for o in outputs], stats
    finally:
        del llm
        gc.collect()


def rdlm_tokens(path, prompts, dtype=None, **config) -> list[list[int]]:
    """`rdlm generate`'s greedy tokens, one prompt at a time (batch 1)."""
    from rdlm.inference.generate import generate
    from rdlm.inference.params import GenerationConfig

    model = load_pretrained(path) if dtype is None else load_pretrained(path, dtype=dtype)
    return [generate(model, p, GenerationConfig(max_new_tokens=NEW_TOKENS, **config)).tokens[0] for p in prompts]


def rdlm_logprobs(path, prompts, dtype=None, **config) -> list[list[float]]:
    """`rdlm generate`'s log-probability of each greedy token, one prompt at a time (batch 1)."""
    from rdlm.inference.generate import generate
    from rdlm.inference.params import GenerationConfig

    model = load_pretrained(path) if dtype is None else load_pretrained(path, dtype=dtype)
    results = [generate(model, p, GenerationConfig(max_new_tokens=NEW_TOKENS, logprobs=0, **config)) for p in prompts]
    return [r.logprobs[0] for r in results]
