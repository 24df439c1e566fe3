"""Pictures, report and command line of the latent analysis; exit-step counting under exit criteria."""

import base64
import json

import matplotlib.image
import numpy as np
import pytest
import torch

from rdlm import save_pretrained
from rdlm.analysis import AnalysisSettings, Prompt, analyze
from rdlm.analysis.exit_steps import exit_steps
from rdlm.cli import main
from rdlm.inference.exits.criteria import make_exit_criterion
from rdlm.data.tokenizer import train_tokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"



def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    assert image[..., :3].std() > 0.01  # not a blank canvas


def test_analyze_writes_every_picture_and_a_self_contained_report(tiny_model, tmp_path):
    prompts = [Prompt("a", list(range(1, 9)), category="numbers"),
               Prompt("b", list(range(40, 50)), category="letters")]
    settings = AnalysisSettings(num_steps=4, limit_steps=8, plot_tokens=2, num_runs=2,
                                exit_criterion="latent-diff", exit_max_steps=5)
    result = analyze(tiny_model, prompts, tmp_path, settings)
    names = sorted(p.name for p in result.figures)
    assert names == sorted(["trajectories_a.png", "convergence_a.png", "path_independence_a.png",
                            "trajectories_b.png", "convergence_b.png", "path_independence_b.png",
                            "dynamics_counts.png", "exit_steps.png"])
    html = result.report.read_text()
    for fig in result.figures:
        assert_png(fig)
        assert base64.b64encode(fig.read_bytes()).decode() in html  # embedded, not linked
    assert "<img" in html and "src='figures" not in html

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    a = summary["prompts"]["a"]
    assert sum(a["dynamics_counts"].values()) == 8
    assert a["storage"] == ["in memory (0.0 MiB)"]
    assert a["path_independence"]["num_runs"] == 2
    assert a["path_independence"]["relative_spread_initial"] > 0
    exits = summary["exit_steps"]
    assert set(exits["groups"]) == {"numbers", "letters"}
    assert exits["groups"]["letters"]["tokens"] == 10
    assert all(2 <= g["mean"] <= 5 for g in exits["groups"].values())


def test_streamed_analysis_keeps_states_on_disk(tiny_model, tmp_path):
    settings = AnalysisSettings(num_steps=3, limit_steps=3, num_runs=2, stream=True, exit_criterion=None,
                                plot_positions=[0, 3])
    result = analyze(tiny_model, [Prompt("s", [5, 6, 7, 8, 9])], tmp_path, settings)
    states = np.load(tmp_path / "states" / "s.npy")
    assert states.shape == (5, 4, 64)
    assert "streamed to disk" in result.report.read_text()
    assert "exit_steps" not in result.summary
    with pytest.raises(ValueError, match="plot positions"):
        analyze(tiny_model, [Prompt("s", [5, 6])], tmp_path,
                AnalysisSettings(num_steps=3, num_runs=2, exit_criterion=None, plot_positions=[7]))


def test_exit_steps_follow_the_threshold(tiny_model):
    ids = list(range(1, 11))
    always = exit_steps(tiny_model, ids, make_exit_criterion("latent-diff", 1e9), 8)
    never = exit_steps(tiny_model, ids, make_exit_criterion("latent-diff", 0.0), 8)
    assert always.tolist() == [2] * 10     # the first comparison (s_2 vs s_1) passes
    assert never.tolist() == [8] * 10      # capped at max_steps
    # argmax stability needs 5 passing comparisons in a row: no exit before iteration 6.
    stable = exit_steps(tiny_model, ids, make_exit_criterion("argmax-stability"), 12)
    assert stable.min() >= 6
    # A looser threshold never exits later than a stricter one on the same trajectory.
    loose = exit_steps(tiny_model, ids, make_exit_criterion("kl", 1e-2), 16)
    strict = exit_steps(tiny_model, ids, make_exit_criterion("kl", 1e-5), 16)
    assert (loose <= strict).all()


def test_cli_labels_tokens_with_their_text(tmp_path, capsys):
    torch.manual_seed(0)
    from rdlm import build_model

    model = build_model("tiny")
    corpus = ["the cat sat on the mat and the dog sat on the log"] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    save_pretrained(model, tmp_path / "model")
    tokenizer.save(tmp_path / "model" / "tokenizer.json")
    out = tmp_path / "out"
    code = main(["analyze", str(tmp_path / "model"), "--prompt", "the cat sat on the mat", "-r", "4",
                 "--runs", "2", "--exit-criterion", "kl", "--tokens", "2", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "exit steps (kl < 0.0005)" in printed
    summary = json.loads((out / "summary.json").read_text())
    labels = list(summary["prompts"]["p0"]["dynamics"])
    assert labels[0].startswith("0: 'the")  # decoded token text, not an id
    assert (out / "report.html").stat().st_size > 10_000


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["analyze", "tiny", "--prompt", "hello", "--out", str(tmp_path)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["analyze", "tiny", "--prompt-ids", "1,x", "--out", str(tmp_path)]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["analyze", "tiny", "--out", str(tmp_path)]) == 2
    assert "no prompt" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"text": "a", "ids": [1]}\n')
    assert main(["analyze", "tiny", "--prompts-file", str(bad), "--out", str(tmp_path)]) == 2
    assert "p.jsonl:2" in capsys.readouterr().err
    assert main(["analyze", "tiny", "--prompt-ids", "1,2,3", "--exit-criterion", "kll",
                 "-r", "3", "--runs", "2", "--out", str(tmp_path)]) == 2
    assert "did you mean 'kl'" in capsys.readouterr().err


@pytest.mark.parametrize("ids,bad", [("1,2,-5", "-5"), ("1,999999,3", "999999")])
def test_a_token_id_outside_the_vocabulary_is_the_one_named(tmp_path, capsys, ids, bad):
    assert main(["analyze", "tiny", "--prompt-ids", ids, "-r", "3", "--runs", "2", "--out", str(tmp_path)]) == 2
    assert f"token id {bad} is outside the model's vocabulary" in capsys.readouterr().err


def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"ids": [1, 2, 3]}\n{"text": "caf\xe9"}\n')
    assert main(["analyze", "tiny", "--prompts-file", str(bad), "--out", str(tmp_path)]) == 2
    assert "p.jsonl:2: not valid UTF-8" in capsys.readouterr().err
