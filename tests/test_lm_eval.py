import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from rdlm.integrations.lm_eval import RDLMEvalModel  # noqa: E402
from tests.hf_helpers import tiny_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0,
     "text": "The capital of France is Paris."},
    {"question": "Two plus two is", "choices": ["four", "six"], "answer": 0, "text": "Two plus two is four."},
    {"question": "Ravens are", "choices": ["black", "white"], "answer": 0, "text": "Ravens are black birds."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("lm") / "model")


def instance(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i, metadata=("t", i, 1))


def manual_loglikelihood(lm, context, continuation):
    ctx, cont = lm._encode_pair(context, continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids[:, :-1], num_steps=lm.num_steps, init_scale=0.0).logits, -1)
    picked = logp[0, -len(cont):]
    return picked.gather(-1, torch.tensor(cont)[:, None]).sum().item(), bool((picked.argmax(-1) ==
                                                                                 torch.tensor(cont)).all())


def test_loglikelihood_matches_the_forward_pass_in_any_batch_size(model_dir):
    requests = [instance("loglikelihood", (d["question"], " " + c), i)
                for i, d in enumerate(DOCS) for c in d["choices"]]
    lm1 = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, init_scale=0.0, batch_size=1)
    lm4 = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, init_scale=0.0, batch_size=4)
    one, four = lm1.loglikelihood(requests, disable_tqdm=True), lm4.loglikelihood(requests, disable_tqdm=True)
    for req, a, b in zip(requests, one, four):
        expected = manual_loglikelihood(lm1, *req.args)
        assert a[0] == pytest.approx(expected[0], abs=1e-4) and a[1] == expected[1]
        assert b[0] == pytest.approx(expected[0], abs=1e-4) and b[1] == expected[1]
    deeper = RDLMEvalModel(pretrained=str(model_dir), num_steps=12, init_scale=0.0)
    assert deeper.loglikelihood(requests[:1], disable_tqdm=True)[0][0] != pytest.approx(one[0][0], abs=1e-6)


def test_rolling_loglikelihood_sums_disjoint_windows(model_dir):
    lm = RDLMEvalModel(pretrained=str(model_dir), num_steps=2, init_scale=0.0, max_length=8)
    text = " ".join([DOCS[2]["text"]] * 5)
    ids = lm.tok_encode(text, add_special_tokens=False)
    assert len(ids) > 16  # several windows
    (total,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (text,))], disable_tqdm=True)
    # Window by window, each predicted token conditioned on at most 8 tokens: the same as scoring each
    # token of the text after BOS with the preceding (up to 8) tokens as context.
    expected = 0.0
    full = [lm.prefix_token_id] + ids
    with torch.no_grad():
        start = 0
        while start < len(ids):
            end = min(start + 8, len(ids))
            window = full[max(0, end - 8):end]
            logp = torch.log_softmax(lm.model(torch.tensor([window]), num_steps=2, init_scale=0.0).logits, -1)
            targets = ids[start:end]
            picked = logp[0, -len(targets):].gather(-1, torch.tensor(targets)[:, None])
            expected += picked.sum().item()
            start = end
    assert total == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_greedy_and_stops_at_the_stop_string(model_dir):
    lm = RDLMEvalModel(pretrained=str(model_dir), num_steps=2, init_scale=0.0)
    (free,) = lm.generate_until([instance("generate_until", ("Ravens are", {"max_gen_toks": 6}))],
                                disable_tqdm=True)
    ids = torch.tensor([lm.tok_encode("Ravens are")])
    with torch.no_grad():
        for _ in range(6):
            nxt = lm.model(ids, num_steps=2, init_scale=0.0).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if nxt.item() == lm.eot_token_id:
                break
    assert free == lm.tok_decode(ids[0, len(lm.tok_encode("Ravens are")):].tolist())
    assert free, "the tiny model should produce some text"
    stop = free[len(free) // 2]
    (cut,) = lm.generate_until([instance("generate_until", ("Ravens are", {"max_gen_toks": 6,
                                                                            "until": [stop]}))], disable_tqdm=True)
    assert cut == free[:free.index(stop)]


def test_bad_model_arguments_are_named(model_dir):
    with pytest.raises(ValueError, match="unknown model argument.*num_step"):
        RDLMEvalModel(pretrained=str(model_dir), num_step=3)
    with pytest.raises(ValueError, match="exit_threshold needs an exit_criterion"):
        RDLMEvalModel(pretrained=str(model_dir), exit_threshold=0.1)
    with pytest.raises(ValueError, match="dtype"):
        RDLMEvalModel(pretrained=str(model_dir), dtype="int8")


def write_tasks(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (directory / "mc.yaml").write_text(
        "task: rdlm_test_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (directory / "ppl.yaml").write_text(
        "task: rdlm_test_ppl\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: '{{text}}'\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    (directory / "gen.yaml").write_text(
        "task: rdlm_test_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n")
    return directory


@pytest.mark.slow  # the harness's own command line (a minute)
def test_harness_command_line_runs_all_request_types_offline(model_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rdlm", "lm-eval", "--model", "rdlm", "--model_args",
           f"pretrained={model_dir},num_steps=2,init_scale=0", "--tasks", "rdlm_test_mc,rdlm_test_ppl,rdlm_test_gen",
           "--include_path", str(tasks), "--batch_size", "auto", "--device", "cpu", "--output_path", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert 0.0 <= results["rdlm_test_mc"]["acc,none"] <= 1.0
    assert results["rdlm_test_ppl"]["word_perplexity,none"] > 1.0
    assert "exact_match,none" in results["rdlm_test_gen"]
    # The harness's accuracy is what our loglikelihood gives: recompute it from the model directly.
    lm = RDLMEvalModel(pretrained=str(model_dir), num_steps=2, init_scale=0.0)
    correct = 0
    for d in DOCS:
        # The harness scores target_delimiter (" ") + choice as the continuation.
        scores = [manual_loglikelihood(lm, d["question"], " " + c)[0] for c in d["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert results["rdlm_test_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))


def test_generate_until_batches_and_takes_exit_criterion_and_cache_budget(model_dir):
    prompts = ["Ravens are", "Two plus two is", "The capital of France is"]
    requests = [instance("generate_until", (p, {"max_gen_toks": 5, "until": ["\n\n"]}), i)
                for i, p in enumerate(prompts)]
    lm1 = RDLMEvalModel(pretrained=str(model_dir), num_steps=6, init_scale=0.0, batch_size=1)
    lm3 = RDLMEvalModel(pretrained=str(model_dir), num_steps=6, init_scale=0.0, batch_size=3)
    assert lm1.generate_until(requests, disable_tqdm=True) == lm3.generate_until(requests, disable_tqdm=True)
    adaptive = RDLMEvalModel(pretrained=str(model_dir), num_steps=6, init_scale=0.0, exit_criterion="kl",
                             exit_threshold=1e-3, kv_cache_budget=2)
    config = adaptive.generation_config(requests[0].args[1])
    assert config.exit_criterion == "kl" and config.cache_strategy == "shared" and config.cache_slots == 2
    texts = adaptive.generate_until(requests, disable_tqdm=True)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    with pytest.raises(ValueError, match="exit"):
        RDLMEvalModel(pretrained=str(model_dir), exit_criterion="no-such-criterion")


def test_scores_are_a_function_of_the_request_at_the_default_init_scale(model_dir):
    requests = [instance("loglikelihood", (d["question"], " " + c), i)
                for i, d in enumerate(DOCS) for c in d["choices"]]
    scores = {}
    for batch_size in (1, 8, "auto"):
        lm = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, batch_size=batch_size)  # init_scale=1
        scores[batch_size] = [s for s, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    assert lm.batch_size == 64  # "auto" on the CPU: max_batch_size
    for batch_size in (8, "auto"):
        assert scores[batch_size] == pytest.approx(scores[1], abs=1e-5)
    # Across calls, and in any order: the same request gets the same s_0.
    again = [s for s, _ in lm.loglikelihood(requests[::-1], disable_tqdm=True)][::-1]
    assert again == pytest.approx(scores["auto"], abs=1e-5)
    assert lm.loglikelihood(requests[:1], disable_tqdm=True)[0][0] == pytest.approx(scores[1][0], abs=1e-5)
    zero = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, init_scale=0.0)
    assert [s for s, _ in zero.loglikelihood(requests, disable_tqdm=True)] != pytest.approx(scores[1], abs=1e-3)
    other_seed = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, seed=1)
    assert [s for s, _ in other_seed.loglikelihood(requests, disable_tqdm=True)] != pytest.approx(scores[1], abs=1e-3)
    # Text generation too.
    prompts = [instance("generate_until", (d["question"], {"max_gen_toks": 5}), i) for i, d in enumerate(DOCS)]
    one = RDLMEvalModel(pretrained=str(model_dir), num_steps=3, batch_size=1).generate_until(prompts, disable_tqdm=True)
    assert lm.generate_until(prompts, disable_tqdm=True) == one


@pytest.mark.slow  # imports the harness's registry in a fresh interpreter
def test_importing_rdlm_lm_eval_keeps_the_harness_models():
    code = ("import rdlm.integrations.lm_eval\nfrom lm_eval.api.registry import get_model, model_registry\n"
            "assert get_model('rdlm').__name__ == 'RDLMEvalModel'\n"
            "names = set(model_registry.keys())\nassert {'hf', 'vllm', 'dummy', 'rdlm'} <= names, names\n"
            "assert get_model('dummy').__name__ == 'DummyLM'\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_nan_weights_raise_instead_of_scoring_a_coin_flip(tmp_path):
    from rdlm import load_pretrained, save_pretrained

    nan_dir = tiny_model_dir(tmp_path / "model")
    model = load_pretrained(nan_dir)
    with torch.no_grad():
        model.coda[0].mlp.out.weight.fill_(float("nan"))
    save_pretrained(model, nan_dir)
    lm = RDLMEvalModel(pretrained=str(nan_dir), num_steps=2)
    requests = [instance("loglikelihood", ("the cat", " sat"), 0)]
    with pytest.raises(FloatingPointError, match=f"non-finite logits in request 0; weights may be NaN: {nan_dir}"):
        lm.loglikelihood(requests, disable_tqdm=True)


@pytest.mark.parametrize("args", [dict(batch_size=0), dict(max_batch_size=0)])
def test_a_zero_batch_size_is_refused_not_replaced(model_dir, args):
    with pytest.raises(ValueError, match=f"{next(iter(args))} must be >= 1, got 0"):
        RDLMEvalModel(pretrained=str(model_dir), **args)


@pytest.mark.slow  # loads the harness's task registry
def test_the_shipped_example_task_loads_without_warnings(caplog):
    """examples/lm_eval_task defines each metric's aggregation and direction, so lm-eval guesses nothing."""
    import logging

    from lm_eval.tasks import TaskManager

    root = Path(__file__).resolve().parents[1]
    with caplog.at_level(logging.WARNING):
        tasks = TaskManager(include_path=str(root / "examples" / "lm_eval_task")).load(["rdlm_facts"])
    assert "rdlm_facts" in str(tasks)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("aggregation" in w or "higher_is_better" in w for w in warnings), warnings
