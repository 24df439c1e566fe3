import json
import math

import pytest
import torch

from rdlm import load_pretrained
from rdlm.cli import main
from rdlm.inference.evaluate import DepthSweep, perplexity_vs_steps, plot_sweeps, windows
from tests.hf_helpers import CORPUS, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("eval") / "model")


def test_windows_predict_every_token_once():
    docs = [list(range(10)), [7], list(range(5))]
    pieces = windows(docs, seq_len=4)
    assert pieces == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9], [0, 1, 2, 3, 4]]
    assert sum(len(p) - 1 for p in pieces) == 9 + 0 + 4


def test_perplexity_matches_the_model_loss_and_changes_with_r(model_dir):
    model = load_pretrained(model_dir)
    docs = [list(range(1, 30)), list(range(40, 52))]
    sweep = perplexity_vs_steps(model, docs, [1, 4], seq_len=64, init_scale=0.0)
    assert sweep.num_steps == [1, 4] and sweep.metric == "perplexity" and not sweep.higher_is_better
    with torch.no_grad():
        nll, n = 0.0, 0
        for doc in docs:
            ids = torch.tensor([doc])
            loss = model(ids[:, :-1], num_steps=4, init_scale=0.0, labels=ids[:, 1:]).loss
            nll += loss.item() * (len(doc) - 1)
            n += len(doc) - 1
    assert sweep.values[1] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert sweep.values[0] != pytest.approx(sweep.values[1], rel=1e-6)


def test_plot_writes_a_png(tmp_path):
    sweeps = [DepthSweep("a", "acc", [1, 2, 4], [0.1, 0.3, 0.35]), DepthSweep("b", "acc", [1, 2, 4], [0.2, 0.2, 0.4]),
              DepthSweep("t", "perplexity", [1, 2, 4], [30.0, 12.0, 11.0], higher_is_better=False)]
    path = plot_sweeps(sweeps, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # imports lm-eval and scores a task (a minute)
def test_eval_command_perplexity_and_lm_eval_accuracy(model_dir, tmp_path, capsys, monkeypatch):
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:3]))
    assert main(["eval", str(model_dir), "--text", str(text), "--num-steps", "1,2", "--init-scale", "0",
                 "--out", str(tmp_path / "ppl")]) == 0
    (sweep,) = json.loads((tmp_path / "ppl" / "results.json").read_text())
    assert sweep["metric"] == "perplexity" and sweep["num_steps"] == [1, 2]
    assert all(v > 1 for v in sweep["values"])
    assert (tmp_path / "ppl" / "plot.png").is_file()

    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tests.test_lm_eval import DOCS, write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    assert main(["eval", str(model_dir), "--tasks", "rdlm_test_mc", "--include-path", str(tasks),
                 "--metric", "acc", "--num-steps", "1,3", "--init-scale", "0", "--out", str(tmp_path / "acc")]) == 0
    (sweep,) = json.loads((tmp_path / "acc" / "results.json").read_text())
    assert sweep["task"] == "rdlm_test_mc" and sweep["num_steps"] == [1, 3]
    assert all(v in {k / len(DOCS) for k in range(len(DOCS) + 1)} for v in sweep["values"])
    assert "rdlm_test_mc acc: r=1:" in capsys.readouterr().out


def test_eval_command_errors_are_one_line(model_dir, tmp_path, capsys):
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "x"), "--num-steps", "1,a"]) == 2
    assert "--num-steps" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [(dict(seq_len=0), "seq_len"), (dict(batch_size=0), "batch_size"),
                                           (dict(init_scale=float("nan")), "init_scale")])
def test_zero_and_nan_settings_are_refused(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity_vs_steps(tiny_model, [[1, 2, 3, 4]], [1], **kwargs)


def test_non_finite_logits_are_an_error_not_a_number(tiny_model):
    with torch.no_grad():
        tiny_model.embedding.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="not finite"):
        perplexity_vs_steps(tiny_model, [[1, 2, 3, 4]], [1])


def test_score_targets_sums_each_rows_nll_and_flags_greedy_rows(tiny_model):
    from rdlm.inference.evaluate import score_targets

    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]])
    labels = torch.tensor([[6, 7, 8, 9, 10], [2, 3, 4, -100, -100]])
    with torch.no_grad():
        scores = score_targets(tiny_model, ids, labels, 3, init_scale=0.0)
        logits = tiny_model(ids, num_steps=3, init_scale=0.0).logits
    for row in range(2):
        n = int((labels[row] != -100).sum())
        expected = torch.nn.functional.cross_entropy(logits[row, :n], labels[row, :n], reduction="sum")
        assert scores.nll[row].item() == pytest.approx(expected.item(), rel=1e-6)
        assert int(scores.targets[row]) == n
        assert bool(scores.greedy[row]) == bool((logits[row, :n].argmax(-1) == labels[row, :n]).all())


def test_training_validation_loss_and_perplexity_vs_steps_are_one_computation(tiny_model):
    # The same documents, batched alike, with the same seed for s_0: the training run's validation loss
    # (rdlm.train.monitor) is the log of perplexity_vs_steps at every r.
    from rdlm.data.shards import make_batch
    from rdlm.train.monitor import evaluate

    docs = torch.randint(1, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    sweep = perplexity_vs_steps(tiny_model, docs.tolist(), [1, 3], seq_len=8, batch_size=2)
    metrics = evaluate(tiny_model, [make_batch(docs[:2], None), make_batch(docs[2:], None)], [1, 3])
    assert [math.exp(metrics[f"val_loss_r{r}"]) for r in (1, 3)] == pytest.approx(sweep.values, rel=1e-6)


def test_eval_of_a_model_with_nan_weights_exits_with_one_line(tmp_path, capsys):
    from rdlm import save_pretrained

    model_dir = tiny_model_dir(tmp_path / "model")
    model = load_pretrained(model_dir)
    with torch.no_grad():
        model.coda[0].mlp.out.weight.fill_(float("nan"))
    save_pretrained(model, model_dir)
    (tmp_path / "t.txt").write_text("the cat sat on the mat")
    code = main(["eval", str(model_dir), "--text", str(tmp_path / "t.txt"), "--num-steps", "2",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "not finite at r=2" in err and f"weights may be NaN: {model_dir}" in err


def test_eval_text_that_is_not_utf8_names_the_file(model_dir, tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "latin1.txt")]) == 2
    assert "latin1.txt: not valid UTF-8 at byte 3" in capsys.readouterr().err
    assert main(["eval", str(model_dir), "--text", str(tmp_path / "latin1.jsonl")]) == 2
    assert "latin1.jsonl:1: not valid UTF-8" in capsys.readouterr().err
