"""LoRA adapters in every inference path (rdlm.model.lora): a batch whose rows run different adapters gives
each row the tokens of its adapter alone, in the engine, the command line (`--lora`) and `rdlm serve --lora
NAME=DIR` with the official openai client; and the refusals, each naming what is wrong.

The independent side of every comparison is the adapter merged into the base's weights (`merge_adapter`: a
plain model, no LoRA layer, no routing). Its arithmetic differs from base + update in the last bits, so
tokens and exit steps are compared, never floats."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained, save_pretrained  # noqa: E402
from rdlm.cli import main  # noqa: E402
from rdlm.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from rdlm.inference.execution import cpu_compile  # noqa: E402
from rdlm.inference.batching import ContinuousBatch  # noqa: E402
from rdlm.inference.generate import GenerationConfig, generate  # noqa: E402
from rdlm.model.lora import LoraSpec, add_lora, lora_layers, merge_adapter  # noqa: E402
from rdlm.model.lora_files import load_adapter, resolve_adapter_dir, save_adapter  # noqa: E402
from rdlm.model.lora_serving import load_adapters, read_adapters  # noqa: E402

GREEDY = GenerationConfig(num_steps=4, max_new_tokens=6, init_scale=0.0)
PROMPTS = ([1, 2, 3], [40, 41, 42, 43, 44], [7, 9])


def make_adapters(base: Path, out: Path, names: tuple[str, ...], seed: int) -> dict[str, Path]:
    """Adapters `names` on the model in `base`, saved under `out`: lora_B drawn at random (a fresh adapter's
    is zero, which would change nothing), so each changes the tokens."""
    model = load_pretrained(base).eval()
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        add_lora(model, LoraSpec(rank=4, alpha=8.0), name)
        for _, layer in lora_layers(model):
            if name in layer.lora_B:
                torch.nn.init.normal_(layer.lora_B[name].weight, std=0.2, generator=generator)
    return {name: save_adapter(model, out / name, name, base_source=str(base)) for name in names}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    tok = train_tokenizer(["the cat sat on the mat. the dog sat on the log. 1 2 3 4 5 6 7 8 9. " * 10],
                          vocab_size=300)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=tok.vocab_size)), path)
    tok.save(path)
    return path


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, Path]:
    return make_adapters(base_dir, tmp_path_factory.mktemp("adapters"), ("a", "b"), seed=1)


@pytest.fixture(scope="module")
def alone(base_dir, adapters):
    """The model each adapter name runs alone: the base (None), or the base with that adapter merged."""
    models = {None: load_pretrained(base_dir).eval()}
    for name, path in adapters.items():
        model = load_pretrained(base_dir).eval()
        load_adapter(model, path)
        models[name] = merge_adapter(model)
    return models


@pytest.fixture
def served(base_dir, adapters):
    """The base with both adapters loaded (none active: a request without an adapter runs the base)."""
    model = load_pretrained(base_dir).eval()
    load_adapters(model, read_adapters(adapters))
    return model


def expected(alone, prompt, config) -> tuple[list[int], list[int]]:
    """(tokens, iterations per token) of the prompt alone on its adapter's merged model."""
    result = generate(alone[config.adapter], [prompt], replace(config, adapter=None))
    return result.tokens[0], result.iterations[0]


def run_batch(model, requests, max_batch=None, **engine) -> list[tuple[list[int], list[int]]]:
    """Every (prompt, config) in one continuous batch (of `max_batch` rows: the others wait for one, then
    prefill while the first decode): each one's (tokens, iterations per token)."""
    batch = ContinuousBatch(model, max_batch=max_batch or len(requests), max_length=64, num_slots=16, **engine)
    ids = [batch.add(prompt, config) for prompt, config in requests]
    out: dict[int, tuple[list[int], list[int]]] = {i: ([], []) for i in ids}
    while batch.busy:
        for event in batch.step():
            out[event.request][0].append(event.token)
            out[event.request][1].append(event.iterations)
        assert not batch.take_failures()
    return [out[i] for i in ids]


# ------------------------------------------------------------------------------------------------
# The engine


def test_the_adapters_change_the_tokens(alone):
    """(Else every comparison below would pass with the adapters ignored.)"""
    outputs = [expected(alone, PROMPTS[0], replace(GREEDY, adapter=name))[0] for name in (None, "a", "b")]
    assert len({tuple(tokens) for tokens in outputs}) == 3


def test_rows_of_different_adapters_with_exits_and_budgets_each_get_their_adapters_tokens(served, alone):
    """Rows at different depths, with exit criteria and a depth budget, each with its own adapter (or the base),
    decoded iteration by iteration, the later ones prefilled in the same calls as the first ones' iterations:
    each row's tokens and exit steps are its adapter's alone."""
    requests = [
        (PROMPTS[0], replace(GREEDY, adapter=None)),
        (PROMPTS[0], replace(GREEDY, adapter="a")),
        (PROMPTS[1], replace(GREEDY, adapter="b", num_steps=6)),
        (PROMPTS[1], replace(GREEDY, adapter="a", num_steps=12, exit_criterion="kl", exit_threshold=5e-3)),
        (PROMPTS[2], replace(GREEDY, adapter="b", num_steps=8, max_latent_iterations=30)),
        (PROMPTS[2], replace(GREEDY, adapter=None, num_steps=10, exit_criterion="latent-diff", exit_threshold=0.2)),
    ]
    got = run_batch(served, requests, max_batch=4)
    for (prompt, config), result in zip(requests, got, strict=True):
        assert result == expected(alone, prompt, config), config.adapter
    assert any(min(steps) < 12 for _, steps in got[3:4]), "the kl row never exited early: the test reads no exit"


def test_a_request_cancelled_in_a_prompt_chunk_leaves_the_others_their_adapters(served, alone):
    """A chunk of prompts prefills beside a decoding row, an iteration a step, and loses a request on the way:
    the rows that stay keep their own adapters."""
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    requests = [(PROMPTS[0], replace(GREEDY, adapter="b", max_new_tokens=12))]
    requests += [(prompt, replace(GREEDY, adapter=name)) for prompt, name in zip(prompts, ("a", "b", None), strict=True)]
    batch = ContinuousBatch(served, max_batch=4, max_length=64, num_slots=16, prefill_chunk=60)  # 3 x 20 tokens
    out: dict[int, list[int]] = {}

    def step() -> None:
        for event in batch.step():
            out.setdefault(event.request, []).append(event.token)

    ids = [batch.add(*requests[0])]
    while not out:  # the first request decodes
        step()
    ids += [batch.add(prompt, config) for prompt, config in requests[1:]]
    step()  # the chunk's first iteration
    assert set(out) == {ids[0]}, "the chunk ended in one step: the test cancels no request inside it"
    batch.cancel(ids[2])
    while batch.busy:
        step()
    for j in (0, 1, 3):
        assert out[ids[j]] == expected(alone, *requests[j])[0]


def test_a_token_in_lockstep_routes_each_row(served, alone):
    """Rows with the same depth settings run each token's iterations in one call (rdlm.inference.runner.lockstep):
    its calls cover rows of different adapters."""
    requests = [(PROMPTS[i % 3], replace(GREEDY, adapter=name)) for i, name in enumerate((None, "a", "b", "a"))]
    for (prompt, config), result in zip(requests, run_batch(served, requests), strict=True):
        assert result == expected(alone, prompt, config)


def test_the_static_step_routes_each_row_and_the_cpu_does_not_compile_adapters(served, alone, monkeypatch):
    """The static step (fixed-shape calls over every row, what CUDA captures) reads each row's adapter from a
    device tensor; on the CPU a model with adapters is never compiled, and runs the static step eagerly."""
    requests = [(PROMPTS[1], replace(GREEDY, adapter=name)) for name in ("b", None, "a")]
    batch = ContinuousBatch(served, max_batch=3, max_length=64, num_slots=16, compile=True)
    assert batch.step_runner.static and batch.step_runner.static_step.compiled is None
    assert not cpu_compile.compile_pays(1, 10**6, rounds=False, adapters=True)
    assert not cpu_compile.server_compiles(1, adapters=True)
    got = run_batch(served, requests, compile=True)
    for (prompt, config), result in zip(requests, got, strict=True):
        assert result == expected(alone, prompt, config)


def test_rounds_route_their_rows_too(served, alone):
    """A parallel sampler's wave and a speculative round run in calls of their own row: each its adapter's."""
    wave = replace(GREEDY, adapter="a", num_steps=8, sampler="parallel", inner_recurrence=4)
    requests = [(PROMPTS[0], wave), (PROMPTS[1], replace(GREEDY, adapter="b"))]
    for (prompt, config), (tokens, _) in zip(requests, run_batch(served, requests), strict=True):
        assert tokens == expected(alone, prompt, config)[0]
    drafted = replace(GREEDY, adapter="b", num_steps=6, draft_steps=2)
    assert generate(served, [PROMPTS[2]], drafted).tokens[0] == expected(alone, PROMPTS[2], drafted)[0]


def test_generate_takes_an_adapter_by_name_and_the_active_one_by_default(served, alone, base_dir, adapters):
    config = replace(GREEDY, adapter="b")
    assert generate(served, [PROMPTS[0]], config).tokens[0] == expected(alone, PROMPTS[0], config)[0]
    single = load_pretrained(base_dir).eval()
    load_adapter(single, adapters["a"])  # the active adapter: what a request that names none runs
    assert generate(single, [PROMPTS[0]], GREEDY).tokens[0] == expected(alone, PROMPTS[0],
                                                                          replace(GREEDY, adapter="a"))[0]


def test_an_adapter_the_model_has_not_loaded_is_refused_by_name(served, base_dir):
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'c' \(it has 'a', 'b'\)"):
        ContinuousBatch(served, max_batch=1, max_length=32, num_slots=4).add([1], replace(GREEDY, adapter="c"))
    with pytest.raises(ValueError, match="it has none"):
        generate(load_pretrained(base_dir), [[1]], replace(GREEDY, adapter="a"))
    with pytest.raises(ValueError, match="^adapter must be a name"):
        GenerationConfig(adapter="a.b")


# ------------------------------------------------------------------------------------------------
# The command line


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err.strip()


def ids_out(prompt: list[int], tokens: list[int]) -> str:
    return ",".join(map(str, prompt + tokens))


def test_generate_with_lora_equals_the_merged_model_with_or_without_model(capsys, base_dir, adapters, alone):
    want = ids_out(PROMPTS[1], expected(alone, PROMPTS[1], replace(GREEDY, adapter="a"))[0])
    flags = ["--prompt-ids", "40,41,42,43,44", "-r", 4, "--max-new-tokens", 6, "--init-scale", 0]
    code, out, err = cli(capsys, "generate", "--model", base_dir, "--lora", adapters["a"], *flags)
    assert (code, out) == (0, want) and "LoRA adapter default" in err
    assert cli(capsys, "generate", "--lora", adapters["a"], *flags)[:2] == (0, want)  # the base it records


def test_lora_takes_a_run_directory_or_checkpoint_for_its_newest_adapter(capsys, tmp_path, base_dir, adapters, alone):
    """A LoRA run keeps its adapter in checkpoints/step-N/adapter/: a run directory means its newest complete
    checkpoint's, a checkpoint its own."""
    run = tmp_path / "run"
    for step, name in ((1, "b"), (2, "a")):
        checkpoint = run / "checkpoints" / f"step-{step}"
        shutil.copytree(adapters[name], checkpoint / "adapter")
        (checkpoint / "trainer.json").write_text(json.dumps({"step": step}))
    assert resolve_adapter_dir(run) == run / "checkpoints" / "step-2" / "adapter"
    assert resolve_adapter_dir(run / "checkpoints" / "step-1") == run / "checkpoints" / "step-1" / "adapter"
    want = ids_out(PROMPTS[0], expected(alone, PROMPTS[0], replace(GREEDY, adapter="a"))[0])
    flags = ["--prompt-ids", "1,2,3", "-r", 4, "--max-new-tokens", 6, "--init-scale", 0]
    assert cli(capsys, "generate", "--lora", run, *flags)[:2] == (0, want)


def test_a_qlora_adapter_runs_on_the_quantized_base(capsys, base_dir, adapters):
    model = load_pretrained(base_dir).eval()
    from rdlm.model.quantize import apply

    quantized = apply(model, "int8", 128)
    load_adapter(quantized, adapters["b"])
    want = ids_out(PROMPTS[0], generate(quantized, [PROMPTS[0]], GREEDY).tokens[0])
    flags = ["--prompt-ids", "1,2,3", "-r", 4, "--max-new-tokens", 6, "--init-scale", 0, "--quantize", "int8"]
    assert cli(capsys, "generate", "--model", base_dir, "--lora", adapters["b"], *flags)[:2] == (0, want)


def test_the_command_line_refuses_by_name(capsys, tmp_path, base_dir, adapters):
    flags = ["--prompt-ids", "1,2,3", "-r", 2, "--max-new-tokens", 2]
    # an adapter trained on another base: its fingerprint differs (the shapes agree, so --lora-any-base applies it)
    torch.manual_seed(5)
    other = tmp_path / "other"
    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=load_pretrained(base_dir).config.vocab_size)),
                    other)
    foreign = make_adapters(other, tmp_path, ("f",), seed=2)["f"]
    code, _, err = cli(capsys, "generate", "--model", base_dir, "--lora", foreign, *flags)
    assert code == 2 and "the adapter was trained on another base" in err and "--lora-any-base" in err
    assert cli(capsys, "generate", "--model", base_dir, "--lora", foreign, "--lora-any-base", *flags)[0] == 0
    # a directory that is not there, or holds no adapter
    code, _, err = cli(capsys, "generate", "--model", base_dir, "--lora", tmp_path / "missing", *flags)
    assert code == 2 and "missing: no such adapter directory" in err
    code, _, err = cli(capsys, "generate", "--model", base_dir, "--lora", base_dir, *flags)
    assert code == 2 and "not an adapter directory" in err
    # an adapter that records no base, and no --model
    bare = tmp_path / "bare"
    shutil.copytree(adapters["a"], bare)
    info = json.loads((bare / "rdlm_adapter.json").read_text())
    info["base"]["source"] = None
    (bare / "rdlm_adapter.json").write_text(json.dumps(info))
    config = json.loads((bare / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (bare / "adapter_config.json").write_text(json.dumps(config))
    code, _, err = cli(capsys, "generate", "--lora", bare, *flags)
    assert code == 2 and "does not record its base model: give the base (--model)" in err
    # --lora-any-base alone would do nothing; serve's NAME=DIR malformed, or a name given twice
    code, _, err = cli(capsys, "generate", "--model", base_dir, "--lora-any-base", *flags)
    assert code == 2 and "--lora-any-base would have no effect" in err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(base_dir), "--lora", str(adapters["a"])])
    assert "expected NAME=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(base_dir), "--lora", f"a.b={adapters['a']}"])
    assert "no dots" in capsys.readouterr().err
    code, _, err = cli(capsys, "serve", "--model", base_dir, "--lora", f"x={adapters['a']}", "--lora",
                       f"x={adapters['b']}")
    assert code == 2 and "the name 'x' is given twice" in err


def test_eval_and_the_lm_eval_model_take_the_adapter(capsys, tmp_path, base_dir, adapters, alone):
    """`rdlm eval --text` scores the adapted model; the lm-eval model type takes `lora=DIR` (its base from the
    adapter's record without `pretrained`)."""
    from rdlm.inference.evaluate import perplexity_vs_steps

    text = tmp_path / "doc.txt"
    text.write_text("the cat sat on the mat. the dog sat on the log.")
    code, _, _ = cli(capsys, "eval", "--text", text, "--lora", adapters["b"], "--num-steps", "2", "--init-scale", 0,
                     "--out", tmp_path / "out")
    got = json.loads((tmp_path / "out" / "results.json").read_text())
    docs = [Tokenizer.from_dir(base_dir).encode(text.read_text(), add_bos=True)]
    want = perplexity_vs_steps(alone["b"], docs, [2], init_scale=0.0).values[0]
    # float32 round-off of merged weights against base + update, over a few hundred terms per logit: far below 1e-4
    assert code == 0 and got[0]["values"][0] == pytest.approx(want, rel=1e-4)
    pytest.importorskip("lm_eval")
    from rdlm.integrations.lm_eval import RDLMEvalModel

    lm = RDLMEvalModel(lora=str(adapters["a"]), num_steps=4, init_scale=0.0, device="cpu")
    ids = torch.tensor([PROMPTS[1] * 3])
    with torch.no_grad():
        picked = lm.model(ids, num_steps=4, init_scale=0.0).logits.argmax(-1)
        merged = alone["a"](ids, num_steps=4, init_scale=0.0).logits.argmax(-1)
    assert torch.equal(picked, merged)


# ------------------------------------------------------------------------------------------------
# rdlm serve


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_serve_mixed_adapters_share_the_batch_and_each_request_gets_its_adapters_tokens(
    base_dir, adapters, alone, engine_process
):
    """Concurrent requests for the base and two adapters, spoken to with the official openai client: each
    gets the text of its prompt alone on its adapter's merged model (the adapters travel with the model to the
    batch's own process, where it has one); an unknown model is refused, naming the served ones."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from tests.serve_helpers import DEFAULTS, LiveServer

    with LiveServer(base_dir, adapters=adapters, engine_process=engine_process) as live:
        client = live.client()
        assert [m.id for m in client.models.list()] == ["tiny", "a", "b"]
        tok = live.tokenizer
        asks = [(text, name) for text in ("the cat", "the dog sat", "1 2 3") for name in ("tiny", "a", "b")]

        def ask(item):
            text, name = item
            out = client.completions.create(model=name, prompt=text, max_tokens=6, temperature=0,
                                            extra_body={"init_scale": 0})
            return out.model, out.choices[0].text

        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(ask, asks))
        texts = {}
        for (text, name), (model, answer) in zip(asks, answers, strict=True):
            adapter = None if name == "tiny" else name
            config = replace(DEFAULTS, max_new_tokens=6, init_scale=0.0, stop_tokens=(tok.eos_id,), adapter=adapter)
            tokens, _ = expected(alone, tok.encode(text, add_bos=True), config)
            assert (model, answer) == (name, tok.decode(tokens, skip_special_tokens=True)), (text, name)
            texts[text, name] = answer
        assert all(len({texts[t, name] for name in ("tiny", "a", "b")}) > 1 for t, _ in asks)
        with pytest.raises(openai.NotFoundError, match=r"the model 'c' does not exist; this server has 'tiny', 'a', 'b'"):
            client.completions.create(model="c", prompt="the cat", max_tokens=2)
