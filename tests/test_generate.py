import time
from dataclasses import replace

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained
from rdlm.inference.generate import EngineArgs, GenerationConfig, TokenEvent, generate, sample, stream

PROMPTS = [[5, 17, 99, 3, 42, 7], [250, 11], [1, 2, 3, 4]]


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def greedy_by_recompute(model, prompt, num_steps, n):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = model(ids, num_steps=num_steps, init_scale=0.0).logits[0, -1].argmax()
            out.append(int(token))
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return out


@pytest.mark.parametrize("strategy", ["full", "shared-ge-r"])
@pytest.mark.parametrize("compile", [False, True])
def test_cached_decoding_gives_the_logits_of_a_full_recompute(huginn_tiny_dir, strategy, compile):
    """Each token's log-probabilities (the chosen token's and the top 5), decoded over the cache, equal those
    of a full forward over the prompt and the tokens so far."""
    model = load_pretrained(huginn_tiny_dir).eval()
    r = 4
    # a shared cache with k >= r is the full cache; k < r changes results by design (paper section 6.3)
    extra = dict(cache_strategy="shared", cache_slots=6) if strategy != "full" else {}
    config = GenerationConfig(num_steps=r, max_new_tokens=5, init_scale=0.0, logprobs=5, **extra)
    prompt = [3, 14, 15, 92, 65, 35]
    events = list(stream(model, prompt, config, engine=EngineArgs(compile=compile)))
    ids = torch.tensor([prompt + [e.token for e in events]])
    with torch.inference_mode():
        full = torch.log_softmax(model(ids, num_steps=r, init_scale=0.0).logits[0].float(), dim=-1)
    for j, event in enumerate(events):
        expected = full[len(prompt) - 1 + j]
        assert abs(event.logprob - float(expected[event.token])) < 1e-4, j
        for token, logprob in event.top:
            assert abs(logprob - float(expected[token])) < 1e-4, j


def test_generate_matches_greedy_recompute_and_counts_steps(model):
    result = generate(model, PROMPTS[0], GenerationConfig(num_steps=3, max_new_tokens=6, init_scale=0.0))
    assert result.tokens[0] == greedy_by_recompute(model, PROMPTS[0], 3, 6)
    assert result.iterations == [[3] * 6] and result.finish_reasons == ["length"]


def test_the_old_names_of_iterations_still_read_them_with_a_deprecation_warning(model):
    config = GenerationConfig(num_steps=3, max_new_tokens=2, exit_criterion="latent-diff", exit_threshold=10.0)
    result = generate(model, PROMPTS[0], config)
    with pytest.warns(DeprecationWarning, match="GenerationResult.iterations"):
        assert result.steps == result.iterations
    with pytest.warns(DeprecationWarning, match="mean_iterations"):
        assert result.mean_steps == result.mean_iterations
    event = next(iter(stream(model, PROMPTS[0], config)))
    with pytest.warns(DeprecationWarning, match="TokenEvent.iterations"):
        assert event.steps == event.iterations


@pytest.mark.parametrize("extra", [
    dict(),                                                       # greedy, random s_0
    dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3),
    dict(exit_criterion="kl", exit_threshold=3e-3, num_steps=12),
    dict(exit_criterion="latent-diff", exit_threshold=0.1, num_steps=12, continuous_cot=True),
    dict(cache_strategy="shared", cache_slots=2, num_steps=5),
])
def test_a_batch_gives_the_tokens_of_each_prompt_alone(model, extra):
    config = GenerationConfig(**{"num_steps": 4, "max_new_tokens": 7, "seed": 3, **extra})
    batched = generate(model, PROMPTS, config)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, prompt, config)
        assert batched.tokens[row] == alone.tokens[0], row
        assert batched.iterations[row] == alone.iterations[0], row


def test_adaptive_exit_that_never_fires_equals_fixed_r(model):
    fixed = generate(model, PROMPTS, GenerationConfig(num_steps=6, max_new_tokens=6, seed=1))
    # Scores are never below 0 (a token exits on a score below the threshold); argmax-stability's threshold is
    # a step count, here more than num_steps.
    for name, threshold in (("kl", 0.0), ("latent-diff", 0.0), ("argmax-stability", 100)):
        never = generate(model, PROMPTS, GenerationConfig(num_steps=6, max_new_tokens=6, seed=1,
                                                          exit_criterion=name, exit_threshold=threshold))
        assert never.tokens == fixed.tokens and never.iterations == fixed.iterations


def test_adaptive_exits_save_iterations_per_token_within_bounds(model):
    config = GenerationConfig(num_steps=24, min_steps=3, max_new_tokens=10, exit_criterion="kl",
                              exit_threshold=1e-2)
    result = generate(model, PROMPTS, config)
    flat = [s for row in result.iterations for s in row[1:]]     # the first token comes from the prefill
    assert all(3 <= s <= 24 for s in flat)
    assert min(flat) < 24 and result.mean_iterations < 24


def test_continuous_cot_warm_starts_from_the_previous_final_state(model):
    prompt, r, n = PROMPTS[0], 3, 5
    result = generate(model, prompt, GenerationConfig(num_steps=r, max_new_tokens=n, init_scale=0.0,
                                                      continuous_cot=True))
    # reference by recompute: s_0 of token t+1 is s_r of token t (the prompt starts from zeros)
    ids = torch.tensor([prompt])
    s0 = torch.zeros(1, len(prompt), model.config.hidden_size)
    expected = []
    with torch.no_grad():
        for _ in range(n):
            out = model(ids, num_steps=r, initial_state=s0, return_state=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            expected.append(int(token))
            ids = torch.cat([ids, token], dim=1)
            s0 = torch.cat([s0, out.state[:, -1:]], dim=1)
    assert result.tokens[0] == expected
    plain = generate(model, prompt, GenerationConfig(num_steps=r, max_new_tokens=n, init_scale=0.0))
    assert plain.tokens[0] != expected


def test_sampling_is_seeded_and_reproducible(model):
    config = GenerationConfig(num_steps=2, max_new_tokens=12, temperature=1.0, seed=7)
    a, b = generate(model, PROMPTS, config), generate(model, PROMPTS, config)
    c = generate(model, PROMPTS, GenerationConfig(num_steps=2, max_new_tokens=12, temperature=1.0, seed=8))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    assert set(sample(logits, GenerationConfig(temperature=1.0, top_k=2), gens).tolist()) == {0, 1}
    # top_p 0.7: p = [.64, .24, ...]: the first two cover 0.88 >= 0.7, so only tokens 0 and 1 survive
    assert set(sample(logits, GenerationConfig(temperature=1.0, top_p=0.7), gens).tolist()) == {0, 1}
    assert set(sample(logits, GenerationConfig(temperature=1.0, min_p=0.3), gens).tolist()) == {0, 1}
    seen = torch.zeros(1, 5, dtype=torch.bool)
    seen[0, 0] = True
    assert sample(logits[:1], GenerationConfig(repetition_penalty=2.0), None, seen).item() == 1


def test_stop_tokens_stop_strings_and_max_new_tokens(model):
    free = generate(model, PROMPTS[:2], GenerationConfig(num_steps=2, max_new_tokens=8, init_scale=0.0))
    stop = free.tokens[0][3]
    result = generate(model, PROMPTS[:2], GenerationConfig(num_steps=2, max_new_tokens=8, init_scale=0.0,
                                                           stop_tokens=(stop,)))
    first = free.tokens[0].index(stop)
    assert result.tokens[0] == free.tokens[0][:first + 1] and result.finish_reasons[0] == "stop_token"
    decode = lambda ids: " ".join(f"t{t}" for t in ids)  # noqa: E731
    marker = f"t{free.tokens[1][2]}"
    result = generate(model, PROMPTS[1], GenerationConfig(num_steps=2, max_new_tokens=8, init_scale=0.0,
                                                          stop_strings=(marker,)), decode=decode)
    assert result.finish_reasons == ["stop_string"] and marker not in result.texts[0]
    assert len(result.tokens[0]) == free.tokens[1].index(free.tokens[1][2]) + 1
    for engine in ({}, {"max_latent_iterations": 40}):  # the static batch, the continuous batch
        with pytest.raises(ValueError, match="stop_strings need a decode function"):
            generate(model, PROMPTS[1], GenerationConfig(stop_strings=("x",), **engine))


def test_a_prefill_alone_runs_the_prompts_and_times_them(model):
    """max_new_tokens=0: the prompts are prefilled (their cache written) and nothing is chosen; the time is the
    prefill's, so a prefill can be timed through generate."""
    result = generate(model, [[1, 2, 3], [4, 5]], GenerationConfig(num_steps=4, max_new_tokens=0))
    assert result.tokens == [[], []] and result.finish_reasons == ["length", "length"]
    assert result.prefill_seconds > 0 and result.prompt_tokens == 5


def test_compiling_is_left_out_of_the_phase_it_happened_in(model, monkeypatch):
    """A compile before the first token (the CPU's prompts' iteration) is taken out of the prefill's time, not the
    decode's: a first step that spends 1 s "compiling" leaves both phases positive and short."""
    from rdlm.inference.runner.step_runner import StepRunner

    spent = {"seconds": 0.0}
    execute = StepRunner.execute

    def compiling_first(self, plan):
        if not spent["seconds"]:
            time.sleep(1.0)
            spent["seconds"] = 1.0
        return execute(self, plan)

    monkeypatch.setattr(StepRunner, "execute", compiling_first)
    monkeypatch.setattr(StepRunner, "capture_seconds", property(lambda self: spent["seconds"]))
    result = generate(model, PROMPTS, GenerationConfig(num_steps=2, max_new_tokens=4))
    assert result.compile_seconds == 1.0
    assert 0 < result.decode_seconds < 0.9 and 0 < result.prefill_seconds < 0.9


def test_streaming_iterator_and_callback_see_every_token(model):
    config = GenerationConfig(num_steps=2, max_new_tokens=5)
    events: list[TokenEvent] = []
    result = generate(model, PROMPTS, config, on_token=events.append)
    for row in range(len(PROMPTS)):
        assert [e.token for e in events if e.row == row] == result.tokens[row]
    it = stream(model, PROMPTS, config)
    first = next(it)
    assert isinstance(first, TokenEvent) and first.token == result.tokens[0][0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_model_s_distribution_at_each_token(model, temperature):
    # from s_0 = 0, the logits of a full recompute of prompt + tokens so far are the ones each token was read from
    config = GenerationConfig(num_steps=3, max_new_tokens=5, init_scale=0.0, logprobs=4, temperature=temperature)
    events: list[TokenEvent] = []
    result = generate(model, PROMPTS[0], config, on_token=events.append)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        for event in events:
            logp = torch.log_softmax(model(ids, num_steps=3, init_scale=0.0).logits[0, -1].float(), dim=-1)
            assert event.logprob == pytest.approx(float(logp[event.token]), abs=1e-5)
            best = logp.topk(4)
            assert [t for t, _ in event.top] == best.indices.tolist()
            assert [v for _, v in event.top] == pytest.approx(best.values.tolist(), abs=1e-5)
            ids = torch.cat([ids, torch.tensor([[event.token]])], dim=1)
    assert result.logprobs == [[e.logprob for e in events]]
    if temperature == 0:
        assert all(e.top[0] == (e.token, e.logprob) for e in events)
    assert generate(model, PROMPTS[0], GenerationConfig(num_steps=3, max_new_tokens=2)).logprobs is None


@pytest.mark.parametrize("extra", [dict(), dict(exit_criterion="kl", exit_threshold=3e-3)])
def test_a_depth_budget_bounds_the_response_s_iterations(model, extra):
    config = GenerationConfig(num_steps=8, max_new_tokens=6, seed=1, **extra)
    free = generate(model, PROMPTS, config)
    # a budget that binds nowhere gives every row its tokens and steps unchanged
    loose = generate(model, PROMPTS, replace(config, max_latent_iterations=1000, target_mean_iterations=8))
    assert loose.tokens == free.tokens and loose.iterations == free.iterations
    capped = generate(model, PROMPTS, replace(config, max_latent_iterations=20))
    for steps in capped.iterations:
        assert sum(steps) <= 20 and min(steps) >= 1 and len(steps) == 6
    paced = generate(model, PROMPTS, replace(config, target_mean_iterations=3.5))
    for steps in paced.iterations:
        assert all(sum(steps[:n]) <= 3.5 * n for n in range(1, len(steps) + 1)) and min(steps) >= 1
    # a budget smaller than one iteration per token ends the response when it is spent
    short = generate(model, PROMPTS[0], replace(config, max_latent_iterations=4))
    assert sum(short.iterations[0]) == 4 and short.finish_reasons == ["length"] and len(short.tokens[0]) < 6


def test_depth_cap_keeps_an_iteration_for_each_later_token():
    config = GenerationConfig(num_steps=8, prefill_steps=5, max_new_tokens=4, max_latent_iterations=12)
    assert config.depth_cap(0, 0) == 5              # the first token is the prompt's depth, under 12 - 3
    assert config.depth_cap(1, 5) == 5              # 7 left, 2 tokens after this one
    assert config.depth_cap(3, 11) == 1 and config.depth_cap(3, 12) == 0
    paced = GenerationConfig(num_steps=8, target_mean_iterations=2.5)
    assert [paced.depth_cap(n, spent) for n, spent in ((0, 0), (1, 2), (2, 5), (3, 6))] == [2, 3, 2, 4]


def test_bad_generation_arguments_are_named(model):
    with pytest.raises(ValueError, match="unknown exit criterion"):
        GenerationConfig(exit_criterion="klx")
    with pytest.raises(ValueError, match="cache_slots"):
        GenerationConfig(cache_strategy="shared")
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(ValueError, match="target_mean_iterations must be a finite number >= 1"):
        GenerationConfig(target_mean_iterations=0.5)
    with pytest.raises(ValueError, match="max_latent_iterations must be an integer >= 1"):
        GenerationConfig(max_latent_iterations=0)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        GenerationConfig(logprobs=21)
    with pytest.raises(ValueError, match="logprobs come with the sequential sampler"):
        GenerationConfig(logprobs=1, draft_steps=2, num_steps=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [1, 10_000])
    with pytest.raises(ValueError, match="context length"):
        generate(model, [1, 2], GenerationConfig(max_new_tokens=1000))


# --------------------------------------------------------------------------------------------------
# Command line

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rdlm import save_pretrained
    from rdlm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["the cat sat on the mat. the dog sat on the log. " * 10], vocab_size=280)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=tok.vocab_size)), path)
    tok.save(path)
    return path


def test_cli_generate_ids_matches_the_api(model, capsys):
    from rdlm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--prompt-ids", "9", "-r", "3",
                 "--max-new-tokens", "5", "--init-scale", "0", "--stats"]) == 0
    out, err = capsys.readouterr()
    torch.manual_seed(0)  # `tiny` as a preset is a fresh random model: rebuild the same one
    from rdlm import build_model

    fresh = build_model("tiny")
    expected = generate(fresh, [[1, 2, 3], [9]], GenerationConfig(num_steps=3, max_new_tokens=5, init_scale=0.0))
    lines = out.strip().splitlines()
    assert lines[0] == ",".join(map(str, [1, 2, 3] + expected.tokens[0]))
    assert lines[1] == ",".join(map(str, [9] + expected.tokens[1]))
    assert "iterations per token [0]: 3 3 3 3 3" in err


def test_cli_generate_takes_a_depth_budget(capsys):
    from rdlm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "-r", "8", "--max-new-tokens", "5",
                 "--max-latent-iterations", "12", "--stats"]) == 0
    err = capsys.readouterr().err
    steps = [int(n) for n in err.split("iterations per token [0]:")[1].split("\n")[0].split()]
    assert steps == [8, 1, 1, 1, 1]  # the first token is the prompt's depth; one kept for each later token
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--target-mean-iterations", "0.5"]) != 0
    assert "target_mean_iterations must be a finite number >= 1" in capsys.readouterr().err


def test_cli_generate_text_and_chat_use_the_tokenizer(model_dir, capsys, monkeypatch):
    import io

    from rdlm.cli import main
    from rdlm.data.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    assert main(["generate", "--model", str(model_dir), "--prompt", "the cat", "-r", "2",
                 "--max-new-tokens", "6", "--init-scale", "0"]) == 0
    out = capsys.readouterr().out
    loaded = load_pretrained(model_dir)
    expected = generate(loaded, [tok.encode("the cat", add_bos=True)],
                        GenerationConfig(num_steps=2, max_new_tokens=6, init_scale=0.0,
                                         stop_tokens=(tok.eos_id,)))
    assert out == "the cat" + tok.decode(expected.tokens[0], skip_special_tokens=True) + "\n"

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nthe dog\n"))
    assert main(["chat", "--model", str(model_dir), "-r", "2", "--max-new-tokens", "4", "--init-scale", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("Huginn> ") == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "the dog"}])
    reply = generate(loaded, [prompt], GenerationConfig(num_steps=2, max_new_tokens=4, init_scale=0.0,
                                                        stop_tokens=(tok.end_turn_id, tok.eos_id)))
    assert out.endswith("Huginn> " + tok.decode(reply.tokens[0], skip_special_tokens=True) + "\n")


def test_cli_text_without_a_tokenizer_is_a_clean_error(capsys):
    from rdlm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt", "hello"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["temperature", "init_scale", "repetition_penalty", "exit_threshold"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_generation_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        GenerationConfig(**{field: value})


def nan_model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        model.coda[0].mlp.out.weight.fill_(float("nan"))
    model.source = "runs/broken"
    return model


@pytest.mark.parametrize("options", [dict(), dict(temperature=0.8), dict(draft_steps=2),
                                     dict(exit_criterion="kl", min_steps=2), dict(sampler="parallel"),
                                     dict(sampler="parallel", prefill_steps=4)])
def test_non_finite_logits_are_an_error_naming_the_token_and_the_weights(options):
    from rdlm.inference.runner.sampling import NonFiniteLogitsError

    with pytest.raises(NonFiniteLogitsError, match="non-finite logits at new token 1; weights may be NaN: runs/broken"):
        generate(nan_model(), [1, 2, 3], GenerationConfig(num_steps=4, max_new_tokens=3, **options))


def test_chat_names_and_skips_a_line_that_is_not_utf8(model_dir, monkeypatch, capsys):
    import io

    from rdlm.cli import main

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\nhello\n")))
    assert main(["chat", "--model", str(model_dir), "-r", "2", "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert "input line 1 is not UTF-8 (byte 0xe9 at 3); skipped" in captured.err
    assert captured.out.count("Huginn> ") == 1


@pytest.mark.parametrize("options", [dict(), dict(exit_criterion="kl"), dict(draft_steps=2), dict(sampler="parallel")])
def test_a_finished_generation_leaves_no_session_to_the_garbage_collector(model, monkeypatch, options):
    """An engine's batch (the continuous batch with its CUDA graphs on a GPU, and a parallel request's wave
    with it) goes with its last reference, not at a garbage collection that could run inside another
    engine's graph capture and invalidate it: none is kept alive by a reference cycle until the collector
    frees it."""
    import gc
    import weakref

    from rdlm.inference import batching
    from rdlm.inference.runner import parallel

    sessions = []
    for kind in (batching.ContinuousBatch, parallel.ParallelSampler):
        def tracked(self, *args, _init=kind.__init__, **kwargs):
            _init(self, *args, **kwargs)
            sessions.append(weakref.ref(self))

        monkeypatch.setattr(kind, "__init__", tracked)
    gc.collect()
    gc.disable()
    try:
        generate(model, [[1, 2, 3]], GenerationConfig(num_steps=4, max_new_tokens=3, **options))
        for _ in stream(model, [1, 2], GenerationConfig(num_steps=4, max_new_tokens=2, **options)):
            pass
        alive = [ref() is not None for ref in sessions]
    finally:
        gc.enable()
    gc.collect()
    freed_by_the_collector = [was and ref() is None for was, ref in zip(alive, sessions)]
    waves = 2 if options.get("sampler") == "parallel" else 0
    assert len(sessions) == 2 + waves and not any(freed_by_the_collector)


def test_extreme_sampling_values_give_their_limit_not_an_overflow():
    """A temperature far below any useful one chooses greedily (dividing by it would overflow every logit);
    a penalty that takes logits to infinity draws among those alone; neither fails or picks at random."""
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=300)).eval()
    greedy = generate(model, [[1, 2, 3]], GenerationConfig(num_steps=4, max_new_tokens=6)).tokens
    for temperature in (1e-300, 1e-6):
        config = GenerationConfig(num_steps=4, max_new_tokens=6, temperature=temperature, top_p=0.9)   # seed 0: s_0
        assert generate(model, [[1, 2, 3]], config).tokens == greedy
    boosted = GenerationConfig(num_steps=4, max_new_tokens=6, temperature=0.7, repetition_penalty=1e-300, seed=1)
    tokens = generate(model, [[1, 2, 3]], boosted).tokens[0]
    assert all(t in (1, 2, 3) or t in tokens[:i] for i, t in enumerate(tokens))   # only seen tokens, none at random


def test_rows_that_sample_alike_are_chosen_together_in_one_host_read(monkeypatch):
    """A batch's coda over rows whose requests differ in what does not change the sampling call (seed, lengths,
    stop strings, depth) samples them in one call; rows that do differ (logprobs, a temperature) in calls of
    their own; every row gets the token (and scores) it gets alone, and the host reads once in all."""
    from rdlm.inference.runner.sampling import choose_rows, sampling_key

    greedy = GenerationConfig(num_steps=4, max_new_tokens=3)
    configs = [greedy, replace(greedy, seed=5, max_new_tokens=9, stop_strings=("x",), num_steps=8),
               replace(greedy, logprobs=2), GenerationConfig(temperature=0.9, top_k=5, seed=1),
               GenerationConfig(temperature=0.9, top_k=5, seed=2, num_steps=6)]
    assert len({sampling_key(c) for c in configs}) == 3
    logits = torch.randn(len(configs), 50, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")                                   # one broken row fails alone
    seen = torch.zeros(8, 50, dtype=torch.bool)
    rows = torch.tensor([4, 0, 2, 7, 1])

    def generators():
        return [torch.Generator().manual_seed(c.seed) for c in configs]

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    together = choose_rows(logits, configs, generators(), seen, rows, torch.tensor)
    assert len(reads) == 1
    alone = [choose_rows(logits[j : j + 1], [c], [g], seen, rows[j : j + 1], torch.tensor)[0]
             for j, (c, g) in enumerate(zip(configs, generators()))]
    assert together == alone and together[1] is None and together[0] is not None
    assert together[2][1] is not None and len(together[2][1][1]) == 2   # the scores of the row that asked


def test_the_finite_check_flags_exactly_the_rows_with_nan_or_infinity():
    """`all_finite` (two reductions per row) agrees with the elementwise check on rows with NaN, +inf, -inf, the
    largest finite floats and none, so a greedy row chosen without the NaN-scrubbing copy still fails exactly when
    its logits are not finite, and a penalized greedy row still reads its seen tokens."""
    from rdlm.inference.runner.sampling import all_finite, choose_rows

    big = torch.finfo(torch.float32).max
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    logits[1, 7], logits[2, 0], logits[3, 39], logits[4, 5:7] = float("nan"), float("inf"), float("-inf"), big
    logits[5, 9:11] = torch.tensor([-big, float("nan")])
    expected = torch.isfinite(logits).all(dim=-1)
    assert all_finite(logits).tolist() == expected.tolist() == [True, False, False, False, True, False]
    assert all_finite(logits.view(2, 3, 40)).flatten().tolist() == expected.tolist()

    greedy = GenerationConfig(num_steps=4, max_new_tokens=3)
    rows = torch.arange(6)
    chosen = choose_rows(logits, [greedy] * 6, [torch.Generator() for _ in range(6)], torch.zeros(6, 40, dtype=torch.bool),
                         rows, torch.tensor)
    assert [c is not None for c in chosen] == expected.tolist()
    assert chosen[0][0] == int(logits[0].argmax()) and chosen[4][0] == 5   # the first of two equal maxima
    seen = torch.zeros(6, 40, dtype=torch.bool)
    top = int(logits[0].argmax())
    seen[0, top] = True
    penalized = replace(greedy, repetition_penalty=1e6)   # a seen token's logit shrinks: the next best wins
    again = choose_rows(logits[:1], [penalized], [torch.Generator()], seen, rows[:1], torch.tensor)[0]
    assert again is not None and again[0] == int(logits[0].masked_fill(seen[0], float("-inf")).argmax())
