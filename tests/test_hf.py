import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

import rdlm.integrations.hf  # noqa: E402,F401  (registers the Auto classes)
from rdlm import load_pretrained  # noqa: E402
from rdlm.integrations.hf import RavenConfig, RavenForCausalLM, load_tokenizer, padding_attention_mask  # noqa: E402
from tests.conftest import assert_within_bf16_roundoff  # noqa: E402
from tests.hf_helpers import tiny_model_dir  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402


@pytest.mark.numerics  # logits computed by the authors' code elsewhere (CI reruns it with other CPU kernels)
def test_auto_classes_load_a_dir_with_the_reference_auto_map_without_remote_code(huginn_tiny_dir):
    raw = json.loads((huginn_tiny_dir / "config.json").read_text())
    assert "auto_map" in raw  # the fixture names the authors' remote code
    config = AutoConfig.from_pretrained(huginn_tiny_dir)
    assert isinstance(config, RavenConfig) and config.n_embd == 64
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    assert isinstance(model, RavenForCausalLM)
    expected = load_file(huginn_tiny_dir / "expected_outputs.safetensors")
    with torch.no_grad():
        for r in (1, 4, 16):
            logits = model(expected["input_ids"], num_steps=r, init_scale=0.0).logits
            assert (logits - expected[f"logits_zero_state_r{r}"]).abs().max() < 1e-4


def test_config_round_trips_to_rdlm_config(huginn_tiny_dir):
    from rdlm.model.huginn import read_config

    config = AutoConfig.from_pretrained(huginn_tiny_dir)
    assert config.to_rdlm() == read_config(huginn_tiny_dir)
    assert RavenConfig.from_rdlm(config.to_rdlm()).to_rdlm() == config.to_rdlm()


def test_dtype_argument_casts(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, dtype=torch.bfloat16)
    assert model.model.embedding.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'floaty'"):
        RavenForCausalLM.from_pretrained(huginn_tiny_dir, dtype="floaty")


def test_save_pretrained_writes_the_huginn_layout(tmp_path, huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    model.save_pretrained(tmp_path / "out")
    again = load_pretrained(tmp_path / "out")
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "huginn_raven"


def test_loss_uses_transformers_label_convention(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        out = model(ids, labels=ids, num_steps=2, init_scale=0.0)
        direct = model.model(ids[:, :-1], num_steps=2, init_scale=0.0, labels=ids[:, 1:]).loss
    torch.testing.assert_close(out.loss, direct)


def test_left_padding_gives_the_unpadded_logits(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    ids = torch.tensor([[11, 12, 13, 14]])
    padded = torch.tensor([[0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = model(ids, num_steps=3, init_scale=0.0).logits
        left = model(padded, attention_mask=mask, num_steps=3, init_scale=0.0).logits
    torch.testing.assert_close(left[:, 2:], plain, atol=1e-5, rtol=1e-5)
    assert padding_attention_mask(mask)[0, 0].diagonal().all()


def test_generate_greedy_matches_a_manual_loop_and_depends_on_num_steps(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    outs = {}
    for r in (1, 8):
        out = model.generate(prompt, max_new_tokens=8, num_steps=r, init_scale=0.0, do_sample=False)
        ids = prompt
        with torch.no_grad():
            for _ in range(8):
                nxt = model.model(ids, num_steps=r, init_scale=0.0).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
        assert torch.equal(out, ids)
        outs[r] = out
    assert not torch.equal(outs[1], outs[8])


def test_tokenizer_special_tokens_and_chat_template(tmp_path):
    d = tiny_model_dir(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(d)
    assert isinstance(tok, rdlm.integrations.hf.RavenTokenizerFast)
    assert tok.bos_token == "<|begin_text|>" and tok.eos_token == "<|end_text|>" and tok.pad_token == "<|pad|>"
    text = tok.apply_chat_template([{"role": "user", "content": " Hi there "},
                                    {"role": "assistant", "content": "Hello"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_text|><|begin_header|>user<|end_header|>\n\nHi there<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\nHello<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\n")
    from rdlm.data.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(d)
    assert text == ours.format_chat([{"role": "user", "content": " Hi there "},
                                     {"role": "assistant", "content": "Hello"}], add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_text|>")
    assert tok.decode(ids) == text


CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": " 2+2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and\n\n3+3?\t"}],
    [{"role": "assistant", "content": ""}, {"role": "tool", "content": "{\"x\": 1}"}],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_transformers_and_rdlm_format_a_chat_identically(tmp_path, chat, add_generation_prompt):
    """One chat format: a transformers tokenizer, rdlm's Tokenizer (chat, serve), lm-eval's model."""
    from rdlm.data.tokenizer import Tokenizer, format_chat

    d = tiny_model_dir(tmp_path / "m")
    theirs = AutoTokenizer.from_pretrained(d).apply_chat_template(chat, tokenize=False,
                                                                   add_generation_prompt=add_generation_prompt)
    ours = Tokenizer.from_dir(d)
    assert ours.format_chat(chat, add_generation_prompt) == theirs == format_chat(chat, add_generation_prompt)
    assert ours.apply_chat_template(chat, add_generation_prompt) == ours.encode(theirs)


def test_tokenizer_without_special_tokens_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="lacks the special token"):
        load_tokenizer(tmp_path)


def test_device_map_on_one_device_loads_and_a_split_is_a_clear_error(huginn_tiny_dir, tmp_path):
    one = "cuda:0" if torch.cuda.device_count() == 1 else "cpu"
    for device_map in ({"": "cpu"}, "cpu", None):  # {"": device}: what lm-eval's own hf model passes
        model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, device_map=device_map)
        assert model.model.embedding.weight.device.type == "cpu"
    if torch.cuda.device_count() <= 1:
        auto = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, device_map="auto")
        assert str(auto.model.embedding.weight.device) == one
    for device_map in ("balanced", {"prelude": "cpu", "coda": "cuda:0"}):
        with pytest.raises(ValueError, match="device_map"):
            AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, device_map=device_map)
    d = tmp_path / "broken"
    shutil.copytree(huginn_tiny_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(rdlm.CheckpointError, match="no model.safetensors"):
        AutoModelForCausalLM.from_pretrained(d)


def test_generate_with_adaptive_exits_and_cache_budget_goes_through_rdlm_generate(huginn_tiny_dir):
    from rdlm.inference.generate import GenerationConfig, generate

    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = model.generate(prompt, max_new_tokens=6, num_steps=16, exit_criterion="kl", exit_threshold=1e-3,
                         kv_cache_budget=4, init_scale=0.0, eos_token_id=None)
    expected = generate(model.model, [prompt[0].tolist()], GenerationConfig(
        max_new_tokens=6, num_steps=16, exit_criterion="kl", exit_threshold=1e-3, cache_strategy="shared",
        cache_slots=4, init_scale=0.0))
    assert out[0, :5].tolist() == prompt[0].tolist() and out[0, 5:].tolist() == expected.tokens[0]
    # Plain fixed-r greedy decoding agrees between transformers' loop and rdlm.inference.generate.
    plain = model.generate(prompt, max_new_tokens=6, num_steps=4, init_scale=0.0, do_sample=False)
    ours = generate(model.model, [prompt[0].tolist()], GenerationConfig(max_new_tokens=6, num_steps=4,
                                                                        init_scale=0.0))
    assert plain[0, 5:].tolist() == ours.tokens[0]
    # a depth budget per row, as rdlm.inference.generate spends it
    budget = model.generate(prompt, max_new_tokens=6, num_steps=8, max_latent_iterations=14, init_scale=0.0,
                            eos_token_id=None)
    within = generate(model.model, [prompt[0].tolist()], GenerationConfig(max_new_tokens=6, num_steps=8,
                                                                          max_latent_iterations=14, init_scale=0.0))
    assert budget[0, 5:].tolist() == within.tokens[0] and sum(within.iterations[0]) <= 14


@pytest.mark.numerics  # logits computed by the authors' code elsewhere (CI reruns it with other CPU kernels)
def test_forward_uses_a_given_initial_state_under_either_name(huginn_tiny_dir):
    # expected logits_given_state_r*: the authors' forward(input_ids, input_states=..., num_steps=r).
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    expected = load_file(huginn_tiny_dir / "expected_outputs.safetensors")
    ids, states = expected["input_ids"], expected["input_states"]
    with torch.no_grad():
        for r in (1, 4, 16):
            for name in ("input_states", "initial_state"):
                logits = model(ids, num_steps=r, **{name: states}).logits
                torch.testing.assert_close(logits, expected[f"logits_given_state_r{r}"], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="not both"):
            model(ids, input_states=states, initial_state=states)


def test_forward_rejects_keywords_it_does_not_know(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="'input_state', 'num_step'"):
        model(ids, num_step=4, input_state=None)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(ids, num_steps=1, output_hidden_states=True)
    with torch.no_grad():  # what transformers' own machinery passes, at values that change nothing
        out = model(ids, num_steps=1, init_scale=0.0, use_cache=False, past_key_values=None,
                    output_attentions=False, return_dict=False)
    assert isinstance(out, tuple)


def test_generate_accepts_the_reference_spelling(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    common = dict(max_new_tokens=6, num_steps=16, init_scale=0.0, eos_token_id=None)
    for criterion, threshold in (("kl", 1e-3), ("argmax-stability", 3), ("minp-kl", "auto")):
        ours = model.generate(prompt, exit_criterion=criterion,
                              exit_threshold=None if threshold == "auto" else threshold, **common)
        theirs = model.generate(prompt, criterion=criterion, exit_threshold=threshold, **common)
        assert torch.equal(ours, theirs)
    plain = model.generate(prompt, do_sample=False, **common)
    assert torch.equal(model.generate(prompt, criterion="none", **common), plain)
    warm = model.generate(prompt, continuous_cot=True, **common)
    assert torch.equal(model.generate(prompt, continuous_compute=True, **common), warm)
    with pytest.raises(ValueError, match="disagree"):
        model.generate(prompt, criterion="kl", exit_criterion="cosine", **common)
    with pytest.raises(ValueError, match="exit_threshold needs an exit criterion"):
        model.generate(prompt, exit_threshold=1e-3, **common)


@pytest.mark.numerics  # logits computed by the authors' code elsewhere (CI reruns it with other CPU kernels)
def test_bf16_checkpoint_through_transformers_gives_the_reference_logits(huginn_tiny_bf16_dir):
    # bfloat16 against the reference's float32 logits of the same weights, within bfloat16 round-off
    # (tests/conftest.py); in float32 the reference's float32 logits to float32 round-off.
    expected = load_file(huginn_tiny_bf16_dir / "expected_outputs.safetensors")
    reference = load_file(huginn_tiny_bf16_dir / "float32_outputs.safetensors")
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_bf16_dir)
    float32 = AutoModelForCausalLM.from_pretrained(huginn_tiny_bf16_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(expected["input_ids"], num_steps=4, input_states=expected["input_states"]).logits
        exact = float32(expected["input_ids"], num_steps=4, input_states=expected["input_states"].float()).logits
    assert_within_bf16_roundoff(logits, reference["logits_given_state_r4"])
    torch.testing.assert_close(exact, reference["logits_given_state_r4"], rtol=0, atol=1e-5)


def test_the_authors_config_spelling_loads_the_same_through_both_readers(tmp_path, huginn_tiny_dir):
    d = tmp_path / "m"
    shutil.copytree(huginn_tiny_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["num_attention_heads"] = raw.pop("n_heads")
    (d / "config.json").write_text(json.dumps(raw))
    assert RavenConfig.from_pretrained(d).to_rdlm() == load_pretrained(d).config == load_pretrained(huginn_tiny_dir).config


# --------------------------------------------------------------------------------------------------
# The ecosystem's contracts: one decode engine behind every entry point, a real Cache, no silent no-ops

@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("hf") / "model")


def cached_greedy(model, ids, new_tokens, cache, **forward):
    """Greedy decoding by hand over forward(past_key_values=...), as tools outside generate do it."""
    tokens = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, **forward)
        for _ in range(new_tokens):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt[0].item())
            out = model(nxt, past_key_values=out.past_key_values, **forward)
    return tokens


def test_generate_pipeline_rdlm_and_the_cache_give_the_same_greedy_tokens_every_time(text_model_dir):
    from rdlm.inference.generate import GenerationConfig, generate
    from rdlm.integrations.hf import RecurrentCache
    from transformers import pipeline

    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    tok = AutoTokenizer.from_pretrained(text_model_dir)
    ids = tok("Ravens are", return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    torch.manual_seed(1)  # s_0 comes from the seed, never from torch's global generator
    first = model.generate(ids, max_new_tokens=8, do_sample=False)
    torch.manual_seed(2)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), first)
    ours = generate(model.model, [ids[0].tolist()], GenerationConfig(max_new_tokens=8, num_steps=8))
    assert first[0, n:].tolist() == ours.tokens[0]
    assert cached_greedy(model, ids, 8, RecurrentCache()) == ours.tokens[0]
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    (text,) = pipe("Ravens are", max_new_tokens=8, do_sample=False, return_full_text=False)
    assert text["generated_text"] == tok.decode(first[0, n:])
    # A left-padded batch decodes each row as if alone.
    batch = tok(["Ravens are", "Two plus two is"], return_tensors="pt", padding=True)
    both = model.generate(**batch, max_new_tokens=8, do_sample=False)
    alone = model.generate(tok("Two plus two is", return_tensors="pt")["input_ids"], max_new_tokens=8,
                           do_sample=False)
    assert both[1, -8:].tolist() == alone[0, -8:].tolist()
    # Another seed draws another s_0.
    with torch.no_grad():
        assert not torch.allclose(model(ids, seed=5, num_steps=2).logits, model(ids, seed=0, num_steps=2).logits)


def test_recurrent_cache_is_a_transformers_cache_over_the_engine_layout(text_model_dir):
    from rdlm.inference.generate import GenerationConfig, generate
    from rdlm.integrations.hf import RecurrentCache
    from transformers import Cache, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    ids = torch.tensor([[5, 9, 14, 3]])
    shared = RecurrentCache(strategy="shared", num_slots=2)
    assert isinstance(shared, Cache)
    tokens = cached_greedy(model, ids, 6, shared, num_steps=5)
    expected = generate(model.model, [ids[0].tolist()], GenerationConfig(
        max_new_tokens=6, num_steps=5, cache_strategy="shared", cache_slots=2))
    assert tokens == expected.tokens[0]
    assert shared.session.cache.core_k.shape[1] == 2 and shared.get_seq_length() == 4 + 6
    with torch.no_grad():
        out = model(ids, use_cache=True, num_steps=3, init_scale=0.0)  # starts a cache and returns it
        assert isinstance(out.past_key_values, RecurrentCache) and out.past_key_values.get_seq_length() == 4
        torch.testing.assert_close(out.logits, model(ids, num_steps=3, init_scale=0.0).logits, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="r of later|needs a cache slot"):
            model(ids[:, :1], past_key_values=out.past_key_values, num_steps=4)
        with pytest.raises(NotImplementedError, match="reorder"):
            out.past_key_values.reorder_cache(torch.tensor([0]))
        with pytest.raises(TypeError, match="RecurrentCache"):
            model(ids, past_key_values=DynamicCache())
        with pytest.raises(ValueError, match="left-padded"):
            model(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]), use_cache=True)
        with pytest.raises(ValueError, match="num_slots must be a positive integer"):
            RecurrentCache(num_slots=0)
        with pytest.raises(ValueError, match="init_scale must be a finite number >= 0"):
            model(ids, past_key_values=RecurrentCache(), num_steps=3, init_scale=-1.0)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model(torch.tensor([[5, 10**6]]), past_key_values=RecurrentCache(), num_steps=3)
        with pytest.raises(ValueError, match=r"exceeds the context length"):
            model(ids, past_key_values=RecurrentCache(max_length=10**6), num_steps=3)
        # Without a cache, a seed makes forward reproducible: the same s_0 rows as the cache's.
        seeded = model(ids, seed=0, num_steps=3).logits
        torch.testing.assert_close(seeded, model(ids, use_cache=True, num_steps=3).logits, atol=1e-5, rtol=1e-5)


def test_generation_config_carries_rdlm_options_and_is_saved(text_model_dir, tmp_path):
    from rdlm.inference.generate import GenerationConfig as RDLMGenerationConfig, generate
    from transformers import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    config = model.generation_config
    assert config.num_steps == model.model.config.mean_recurrence == 8
    assert (config.exit_criterion, config.kv_cache_budget, config.continuous_cot, config.seed) == (None, None, False, 0)
    config.num_steps, config.exit_criterion, config.exit_threshold, config.kv_cache_budget = 6, "kl", 1e-3, 3
    config.continuous_cot = True
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert saved["num_steps"] == 6 and saved["exit_criterion"] == "kl" and saved["kv_cache_budget"] == 3
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.generation_config.num_steps == 6 and again.generation_config.continuous_cot is True
    ids = torch.tensor([[5, 9, 14, 3]])
    expected = generate(model.model, [ids[0].tolist()], RDLMGenerationConfig(
        max_new_tokens=5, num_steps=6, exit_criterion="kl", exit_threshold=1e-3, cache_strategy="shared",
        cache_slots=3, continuous_cot=True, stop_tokens=(model.config.eos_token_id,)))
    assert again.generate(ids, max_new_tokens=5)[0, 4:].tolist() == expected.tokens[0]
    # A generation_config argument and keywords override the model's, as in transformers.
    plain = generate(model.model, [ids[0].tolist()], RDLMGenerationConfig(max_new_tokens=4, num_steps=2))
    fresh = AutoModelForCausalLM.from_pretrained(text_model_dir)
    given = fresh.generate(ids, generation_config=GenerationConfig(max_new_tokens=4, num_steps=2))
    assert given[0, 4:].tolist() == plain.tokens[0]
    keywords = again.generate(ids, max_new_tokens=4, num_steps=2, criterion="none", kv_cache_budget=None,
                              continuous_cot=False)
    assert torch.equal(keywords, given)


def test_rdlm_options_combine_with_streamer_sampling_and_return_dict(text_model_dir):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.ended = True

    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    ids = torch.tensor([[5, 9, 14, 3]])
    streamer = Collect()
    common = dict(max_new_tokens=6, num_steps=8, exit_criterion="kl", continuous_cot=True, kv_cache_budget=2,
                  do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                  seed=3, eos_token_id=None)
    out = model.generate(ids, streamer=streamer, return_dict_in_generate=True, **common)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    assert streamer.ended and streamer.chunks[0] == ids.tolist()
    assert [c[0] for c in streamer.chunks[1:]] == out.sequences[0, 4:].tolist()
    assert torch.equal(model.generate(ids, **common), out.sequences)  # seeded sampling repeats
    assert not torch.equal(model.generate(ids, **{**common, "seed": 4}), out.sequences)
    for refused, match in (({"num_beams": 2}, "num_beams"), ({"output_scores": True}, "output_scores"),
                           ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
                           ({"num_return_sequences": 2}, "num_return_sequences"),
                           ({"logits_processor": [lambda i, s: s]}, "logits_processor"),
                           ({"prefix_allowed_tokens_fn": lambda b, i: [1]}, "prefix_allowed_tokens_fn")):
        with pytest.raises(ValueError, match=match):
            model.generate(ids, max_new_tokens=2, **refused)
    with pytest.raises(ValueError, match="one prompt"):
        model.generate(torch.cat([ids, ids]), max_new_tokens=2, streamer=Collect())


def test_from_pretrained_honours_or_refuses_every_keyword(huginn_tiny_dir):
    # What lm-eval's own `hf` model passes.
    model = AutoModelForCausalLM.from_pretrained(
        huginn_tiny_dir, revision="main", dtype=torch.float32, trust_remote_code=False, gguf_file=None,
        quantization_config=None, subfolder="", device_map={"": "cpu"}, max_memory=None)
    eager = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager"
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        reference = model(ids, num_steps=4, init_scale=0.0).logits
        torch.testing.assert_close(eager(ids, num_steps=4, init_scale=0.0).logits, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sdpa(ids, num_steps=4, init_scale=0.0).logits, reference)
    with pytest.raises(ValueError, match="Flash Attention 2"):  # transformers' Auto class refuses it first
        AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        RavenForCausalLM.from_pretrained(huginn_tiny_dir, attn_implementation="flex_attention")
    with pytest.raises(TypeError, match="load_in_8bit"):
        AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, load_in_8bit=True)
    with pytest.raises(ValueError, match="variant"):
        AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, variant="fp16")
    loaded, info = RavenForCausalLM.from_pretrained(huginn_tiny_dir, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []


def test_save_pretrained_honours_or_refuses_every_keyword(huginn_tiny_dir, tmp_path):
    import os

    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    old = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    finally:
        os.umask(old)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert ((tmp_path / "sharded").stat().st_mode & 0o777) == 0o755
    assert ((tmp_path / "sharded" / "config.json").stat().st_mode & 0o777) == 0o644
    again = load_pretrained(tmp_path / "sharded")
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True)
    with pytest.raises(TypeError, match="save_function"):
        model.save_pretrained(tmp_path / "x", save_function=torch.save)
    with pytest.raises(ValueError, match="safetensors"):
        model.save_pretrained(tmp_path / "x", safe_serialization=False)
    model.save_pretrained(tmp_path / "not-main", is_main_process=False)
    assert not (tmp_path / "hub").exists() and not (tmp_path / "x").exists() and not (tmp_path / "not-main").exists()


def test_gradient_checkpointing_enable_checkpoints_each_core_iteration(huginn_tiny_dir, monkeypatch):
    import rdlm.model.lm

    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir).train()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])

    def grads():
        model.zero_grad()
        model(ids, labels=ids, num_steps=(1, 3), initial_state=torch.zeros(1, 6, 64)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    calls = []
    real = rdlm.model.lm.checkpoint
    monkeypatch.setattr(rdlm.model.lm, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing and model.model.config.activation_checkpointing
    checkpointed = grads()
    assert len(calls) == 3  # the 3 iterations with gradient
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="use_reentrant"):
        model.gradient_checkpointing_enable({"use_reentrant": True})


def test_resize_token_embeddings_resizes_the_tied_head_and_both_configs(text_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(text_model_dir)
    old = model.model.embedding.weight.detach().clone()
    embedding = model.resize_token_embeddings(520)
    assert embedding.weight.shape == (520, 64) and model.get_input_embeddings() is embedding
    assert model.config.vocab_size == model.model.config.vocab_size == 520
    assert torch.equal(embedding.weight[:512], old)
    torch.testing.assert_close(embedding.weight[515], old.mean(0))
    with torch.no_grad():
        assert model(torch.tensor([[515, 3]]), num_steps=2).logits.shape == (1, 2, 520)
    model.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized")
    assert again.config.vocab_size == 520 and again.model.embedding.weight.shape == (520, 64)
    assert model.resize_token_embeddings(500, pad_to_multiple_of=64).num_embeddings == 512
    assert model.config.vocab_size == 512 and torch.equal(model.model.embedding.weight, old)


def test_a_hub_id_fetches_only_json_and_safetensors_with_the_hub_keywords(huginn_tiny_dir, monkeypatch):
    """A repository id goes to huggingface_hub.snapshot_download (faked here: no network) with the JSON and
    safetensors patterns and the hub keywords the caller gave, with the ones transformers' Auto classes pass
    (force_download, proxies=None: the Auto classes themselves first fetch the config from the Hub); a proxies
    mapping, which rdlm would not pass on, is refused by name."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kw: asked.append((repo_id, kw)) or str(huginn_tiny_dir))
    model = RavenForCausalLM.from_pretrained("someone/huginn-tiny", revision="v1", force_download=True, proxies=None,
                                             _from_auto=True)
    assert isinstance(model, RavenForCausalLM)
    (repo, kw), = asked
    assert repo == "someone/huginn-tiny" and kw["allow_patterns"] == ["*.json", "*.safetensors"]
    assert kw["revision"] == "v1" and kw["force_download"] is True and "proxies" not in kw
    with pytest.raises(ValueError, match="proxies"):
        RavenForCausalLM.from_pretrained(huginn_tiny_dir, proxies={"https": "http://proxy:3128"})
