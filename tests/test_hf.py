import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

import rdlm.hf  # noqa: E402,F401  (registers the Auto classes)
from rdlm import load_pretrained  # noqa: E402
from rdlm.hf import RavenConfig, RavenForCausalLM, load_tokenizer, padding_attention_mask  # noqa: E402
from tests.hf_helpers import tiny_model_dir  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402


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
    from rdlm.huginn import read_config

    config = AutoConfig.from_pretrained(huginn_tiny_dir)
    assert config.to_rdlm() == read_config(huginn_tiny_dir)
    assert RavenConfig.from_rdlm(config.to_rdlm()).to_rdlm() == config.to_rdlm()


def test_dtype_argument_casts(huginn_tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, dtype=torch.bfloat16)
    assert model.model.embedding.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a torch dtype"):
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
    assert isinstance(tok, rdlm.hf.RavenTokenizerFast)
    assert tok.bos_token == "<|begin_text|>" and tok.eos_token == "<|end_text|>" and tok.pad_token == "<|pad|>"
    text = tok.apply_chat_template([{"role": "user", "content": " Hi there "},
                                    {"role": "assistant", "content": "Hello"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_text|><|begin_header|>user<|end_header|>\n\nHi there<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\nHello<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\n")
    from rdlm.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(d)
    assert text == ours.format_chat([{"role": "user", "content": " Hi there "},
                                     {"role": "assistant", "content": "Hello"}], add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_text|>")
    assert tok.decode(ids) == text


def test_tokenizer_without_special_tokens_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="lacks the special token"):
        load_tokenizer(tmp_path)


def test_unsupported_device_map_is_a_clear_error(huginn_tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="device_map"):
        AutoModelForCausalLM.from_pretrained(huginn_tiny_dir, device_map="auto")
    d = tmp_path / "broken"
    shutil.copytree(huginn_tiny_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(rdlm.CheckpointError, match="no model.safetensors"):
        AutoModelForCausalLM.from_pretrained(d)


def test_generate_with_adaptive_exits_and_cache_budget_goes_through_rdlm_generate(huginn_tiny_dir):
    from rdlm.generate import GenerationConfig, generate

    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_dir)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = model.generate(prompt, max_new_tokens=6, num_steps=16, exit_criterion="kl", exit_threshold=1e-3,
                         kv_cache_budget=4, init_scale=0.0, eos_token_id=None)
    expected = generate(model.model, [prompt[0].tolist()], GenerationConfig(
        max_new_tokens=6, num_steps=16, exit_criterion="kl", exit_threshold=1e-3, cache_strategy="shared",
        cache_slots=4, init_scale=0.0))
    assert out[0, :5].tolist() == prompt[0].tolist() and out[0, 5:].tolist() == expected.tokens[0]
    # Plain fixed-r greedy decoding agrees between transformers' loop and rdlm.generate.
    plain = model.generate(prompt, max_new_tokens=6, num_steps=4, init_scale=0.0, do_sample=False)
    ours = generate(model.model, [prompt[0].tolist()], GenerationConfig(max_new_tokens=6, num_steps=4,
                                                                        init_scale=0.0))
    assert plain[0, 5:].tolist() == ours.tokens[0]


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


def test_bf16_checkpoint_through_transformers_gives_the_reference_logits(huginn_tiny_bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(huginn_tiny_bf16_dir)
    expected = load_file(huginn_tiny_bf16_dir / "expected_outputs.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"], num_steps=4, input_states=expected["input_states"]).logits
    torch.testing.assert_close(logits, expected["logits_given_state_r4"], rtol=0, atol=1e-5)


def test_the_authors_config_spelling_loads_the_same_through_both_readers(tmp_path, huginn_tiny_dir):
    d = tmp_path / "m"
    shutil.copytree(huginn_tiny_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["num_attention_heads"] = raw.pop("n_heads")
    (d / "config.json").write_text(json.dumps(raw))
    assert RavenConfig.from_pretrained(d).to_rdlm() == load_pretrained(d).config == load_pretrained(huginn_tiny_dir).config
