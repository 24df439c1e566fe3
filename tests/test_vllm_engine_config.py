"""The vLLM plugin is safe by default: it registers only names no other model holds, its config hook makes
vLLM's defaults give rdlm's tokens with an exit criterion, and what it cannot serve exactly is refused by name
(rdlm.integrations.vllm, .engine_config, .adaptive.decoding_tokens). Runs where vLLM is installed."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines
vllm = pytest.importorskip("vllm", reason="the vLLM plugin's tests run where vLLM is installed (.venv-vllm)")

import torch  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.model_executor.models.config import MODELS_CONFIG_MAP  # noqa: E402

from rdlm.integrations import vllm as plugin  # noqa: E402
from rdlm.integrations.vllm import adaptive  # noqa: E402
from rdlm.integrations.vllm.options import RecurrenceOptionError  # noqa: E402
from tests.vllm_models import (  # noqa: E402
    ENGINE,
    NEW_TOKENS,
    models,  # noqa: F401  (a fixture)
    prompts_for,
    rdlm_logprobs,
    rdlm_tokens,
    served,
)

EXITS = {"rdlm_num_steps": 12, "rdlm_exit_criterion": "latent-diff", "rdlm_exit_threshold": 0.3}
DEFAULTS = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}  # vLLM's defaults otherwise


def test_a_name_vllm_holds_keeps_vllms_model():
    """An architecture vLLM (or another plugin) already holds keeps its model and gets no rdlm hook;
    rdlm's own name always serves rdlm's model; registering again changes nothing."""
    saved = ModelRegistry.models.get("OuroForCausalLM"), MODELS_CONFIG_MAP.get("OuroForCausalLM")
    try:
        ModelRegistry.register_model("OuroForCausalLM", "vllm.model_executor.models.llama:LlamaForCausalLM")
        MODELS_CONFIG_MAP.pop("OuroForCausalLM", None)
        served_names = plugin.register()
        assert "OuroForCausalLM" not in served_names and "RdlmForCausalLM" in served_names
        assert ModelRegistry.models["OuroForCausalLM"].module_name == "vllm.model_executor.models.llama"
        assert "OuroForCausalLM" not in MODELS_CONFIG_MAP
        assert plugin.register() == served_names  # idempotent
    finally:
        ModelRegistry.models.pop("OuroForCausalLM")
        if saved[0] is not None:
            ModelRegistry.models["OuroForCausalLM"] = saved[0]
        if saved[1] is not None:
            MODELS_CONFIG_MAP["OuroForCausalLM"] = saved[1]
    # this vLLM ships no Ouro (it removed its own in 0.26): rdlm serves the name
    assert "OuroForCausalLM" in plugin.register()


def test_rdlm_s_own_architecture_name_serves_any_checkpoint(models):
    """hf_overrides={"architectures": ["RdlmForCausalLM"]} asks for rdlm's model whatever the checkpoint
    names (the way to serve Ouro with rdlm's model on a vLLM that ships its own)."""
    from rdlm.model.huginn import read_config

    prompts = prompts_for(read_config(models["ouro"]).vocab_size, lengths=(7, 33), seed=21)
    got, stats = served(models["ouro"], prompts, architectures=["RdlmForCausalLM"], rdlm_num_steps=3)
    assert stats.vllm_config.model_config.architecture == "RdlmForCausalLM"
    assert got == rdlm_tokens(models["ouro"], prompts, num_steps=3)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_exits_under_vllms_defaults_give_rdlm_tokens_in_a_two_turn_chat(models, compiled):
    """vLLM's defaults left on (prefix caching, chunked prefill, and in the slow case compilation: the exit
    forward compiled, about 8 minutes here; the eager case runs in CI): with
    an exit criterion the config hook turns off what would change the answers (on an accelerator CUDA graphs
    too), and a two-turn chat gives `rdlm generate`'s tokens and log-probabilities for every prompt (the same
    threshold exits after fewer than r iterations: test_vllm.py's exit tests). The lengths fill vLLM's CPU
    blocks (128 tokens): the first turn's 121-token prompt and its first 7 replies make a full block, which
    prefix caching would hand the second turn with the replies' exited cache entries (seen without the hook,
    eager: a log-probability 4e-4 off); the 128-token prompt sent again would be cached whole."""
    settings = dict(num_steps=12, exit_criterion="latent-diff", exit_threshold=0.3)
    first = prompts_for(512, lengths=(121, 128), seed=23)
    replies = rdlm_tokens(models["huginn"], first[:1], **settings)  # (vLLM's are asserted equal below)
    follow_up = prompts_for(512, lengths=(9,), seed=24)[0]
    second = [first[0] + replies[0] + follow_up, first[1]]
    engine = DEFAULTS if compiled else ENGINE
    got, stats = served(models["huginn"], [first, second], engine=engine, **EXITS)  # both turns, one engine
    config = stats.vllm_config
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill
    assert got == rdlm_tokens(models["huginn"], first + second, **settings)
    want = rdlm_logprobs(models["huginn"], first + second, **settings)
    # fp32 round-off of the same sums through other kernels (seen: under 1e-6 per token)
    assert max(abs(a - b) for g, w in zip(stats.logprobs, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4


def test_fixed_depth_keeps_vllms_defaults(models):
    """Without an exit criterion every token runs r iterations whatever vLLM batches: the hook leaves prefix
    caching and chunked prefill on, and a prompt sent twice (its blocks cached) gets the same tokens."""
    prompts = prompts_for(512, lengths=(40,), seed=25)
    got, stats = served(models["huginn"], [prompts, prompts], rdlm_num_steps=4)
    assert stats.vllm_config.cache_config.enable_prefix_caching
    assert got == rdlm_tokens(models["huginn"], prompts, num_steps=4) * 2


def test_speculative_decoding_with_exits_is_refused_by_name(models):
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(Exception, match="rdlm_exit_criterion cannot run with speculative decoding"):
        vllm.LLM(str(models["huginn"]), hf_overrides=EXITS, speculative_config=speculative, **ENGINE)
    gc.collect()


def test_decoded_tokens_are_read_from_the_attention_metadata(monkeypatch):
    """A request with one new token after earlier ones is decoding; a prompt (or a one-token prompt) is not;
    without metadata (vLLM's warm-up) there is nothing to read; metadata without query_start_loc and seq_lens
    is refused by name instead of running every token to r."""

    def context(metadata):
        monkeypatch.setattr(adaptive, "get_forward_context", lambda: SimpleNamespace(attn_metadata=metadata))

    positions = torch.tensor([5, 0, 1, 2, 9, 0])  # a decode, a 3-token prompt, a decode, a 1-token prompt
    context(SimpleNamespace(query_start_loc=torch.tensor([0, 1, 4, 5, 6]), seq_lens=torch.tensor([6, 3, 10, 1])))
    assert adaptive.decoding_tokens(positions, "kv.1").tolist() == [True, False, False, False, True, False]
    context({"kv.1": SimpleNamespace(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([4]))})
    assert adaptive.decoding_tokens(positions[:1], "kv.1").tolist() == [True]
    context(None)
    assert adaptive.decoding_tokens(positions, "kv.1") is None
    context(SimpleNamespace(seq_lens=torch.tensor([6])))
    with pytest.raises(RecurrenceOptionError, match="query_start_loc and seq_lens.*SimpleNamespace lacks them"):
        adaptive.decoding_tokens(positions, "kv.1")


def test_a_model_served_without_the_hook_is_refused_by_name(monkeypatch):
    """The model checks what the hook sets: served under a name without rdlm's hook, with vLLM's defaults and
    an exit criterion, it names each setting to turn off (CUDA graphs on an accelerator: the CPU has none)."""
    from rdlm.integrations.vllm import model
    from rdlm.integrations.vllm.model import check_exit_settings

    monkeypatch.setattr(model.current_platform, "is_cpu", lambda: False)
    config = SimpleNamespace(
        speculative_config=None,
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        model_config=SimpleNamespace(enforce_eager=False),
    )
    with pytest.raises(RecurrenceOptionError, match="prefix caching.*chunked prefill.*CUDA graphs"):
        check_exit_settings(config)
    config.cache_config.enable_prefix_caching = config.scheduler_config.enable_chunked_prefill = False
    config.model_config.enforce_eager = True
    check_exit_settings(config)
    config.speculative_config = object()
    with pytest.raises(RecurrenceOptionError, match="speculative decoding"):
        check_exit_settings(config)
    monkeypatch.setattr(model.current_platform, "is_cpu", lambda: True)
    config.speculative_config, config.model_config.enforce_eager = None, False
    check_exit_settings(config)  # the CPU captures no graphs


def test_the_hook_makes_room_for_a_whole_prompt(models):
    """With chunked prefill off every prompt must fit one step: the hook raises max_num_batched_tokens to the
    longest prompt the model takes, so a prompt longer than the default batch runs (and gives rdlm's tokens).
    Eager: what the hook sets does not depend on compiling (which the two-turn chat above keeps on), and a
    compiled exit forward takes minutes to compile on a small CPU."""
    engine = {**ENGINE, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    prompts = prompts_for(512, lengths=(150,), seed=26)
    got, stats = served(models["huginn"], prompts, engine=engine, **EXITS)
    assert stats.vllm_config.scheduler_config.max_num_batched_tokens == ENGINE["max_model_len"]
    assert got == rdlm_tokens(models["huginn"], prompts, num_steps=12, exit_criterion="latent-diff",
                              exit_threshold=0.3)
    assert len(got[0]) == NEW_TOKENS
