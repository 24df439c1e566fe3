"""Every inference command takes --threads, and the default does not collapse under contention
(rdlm.resources.default_threads; measured by benchmarks/bench_threads.py)."""

import pytest
import torch

from rdlm.cli import build_parser, main
from rdlm.resources import SMALL_MODEL_PARAMETERS, default_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [["generate", "--model", "m"], ["chat", "--model", "m"], ["serve", "m"],
                                  ["eval", "m", "--text", "t.txt"], ["analyze", "m"], ["info", "m"]])
def test_every_inference_command_takes_threads(argv):
    assert build_parser().parse_args([*argv, "--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--threads", "0"])


def test_generate_runs_on_the_threads_asked_for_and_a_small_model_on_one(restore_threads, capsys):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--max-new-tokens", "1", "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--max-new-tokens", "1"]) == 0
    assert torch.get_num_threads() == 1  # the tiny preset is far under 20M parameters


@pytest.mark.parametrize("load, expected", [(0.1, 4), (1.4, 3), (2.6, 1), (30.0, 1)])
def test_a_large_model_gets_the_cores_the_load_leaves_free(monkeypatch, load, expected):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    assert default_threads(SMALL_MODEL_PARAMETERS) == expected
    assert default_threads(SMALL_MODEL_PARAMETERS - 1) == 1
