"""Jobs that cannot fit or end are refused in one line before any work; long ones are announced.

Every case here must be refused before work starts: a case that slipped through would train, decode or
evaluate for hours, so each CLI case runs in a subprocess with a timeout.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rdlm import RDLMConfig
from rdlm.cli import main
from rdlm.resources import LongRunWarning, ResourceError, check_device, check_memory, check_time, \
    forward_seconds, memory_bytes
from tests.hf_helpers import CORPUS, tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
HUGE = "1000000000"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("resources")
    model = tiny_model_dir(root / "model")
    (root / "text.txt").write_text("\n".join(CORPUS * 4))
    assert main(["data", "prepare", str(root / "text.txt"), "--tokenizer", str(model), "--out",
                 str(root / "shards"), "--context-length", "16", "--val-fraction", "0"]) == 0
    return root


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rdlm", *args], env=ENV, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


SLOW = pytest.mark.slow  # a command's process each (about 10 s on 2 cores); one per command runs in every run
CASES = [
    (["train", "--model", "model", "--data", "shards", "--out-dir", "run", "--set", f"mean_recurrence={HUGE}"],
     "one step would take at least"),
    pytest.param(["train", "--model", "model", "--data", "shards", "--out-dir", "run", "--steps", "1000000000000"],
                 "would take at least", marks=SLOW),
    pytest.param(["train", "--model", "tiny", "--data", "shards", "--out-dir", "run", "--micro-batch-size",
                  "100000000"], "--micro-batch-size 100000000", marks=SLOW),
    (["eval", "model", "--text", "text.txt", "--num-steps", f"1,{HUGE}"], "one batch would take at least"),
    (["analyze", "model", "--prompt-ids", "1,2,3", "--out", "an", "--limit-steps", HUGE],
     "one prompt would take at least"),
    # generate's r is bounded where it is declared (2**16), so these never reach an estimate: the bound refuses them
    (["generate", "--model", "model", "--prompt-ids", "1,2,3", "-r", HUGE], "num_steps must be at most 2**16"),
    pytest.param(["generate", "--model", "model", "--prompt-ids", "1,2,3", "-r", "30000000", "--max-new-tokens", "1"],
                 "num_steps must be at most 2**16", marks=SLOW),
]


@pytest.mark.parametrize("args,fragment", CASES, ids=lambda v: " ".join(v[:1]) if isinstance(v, list) else None)
def test_jobs_that_cannot_fit_or_end_are_refused_in_one_line_before_any_work(workspace, args, fragment):
    proc = run_cli(workspace, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    bound = "must be at most" in fragment  # a declared bound names the value; an estimate says "refused"
    assert len(lines) == 1 and fragment in lines[0] and (bound or "refused" in lines[0]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (workspace / "run" / "checkpoints").exists()


def test_the_estimates_are_lower_bounds_that_grow_with_r_and_tokens():
    config = RDLMConfig.from_preset("tiny")
    one = forward_seconds(config, "cpu", tokens=10, calls=1, num_steps=4)
    assert 0 < one < forward_seconds(config, "cpu", 10, 1, 400) < forward_seconds(config, "cpu", 1000, 1, 400)
    # A small model at a huge r is bounded by its layer calls, whatever its FLOPs.
    assert forward_seconds(config, "cpu", 1, 1, 10**9) > 3600
    assert memory_bytes("cpu") > 2**20
    check_memory(1024, "cpu", "a small thing")
    with pytest.raises(ResourceError, match="a huge thing needs at least .* refused"):
        check_memory(2**70, "cpu", "a huge thing")


def test_a_long_job_is_announced_with_its_estimate_and_runs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_time(10.0, 1.0, "a short job", "step")
        check_time(7200.0, 1.0, "a long job", "step")
    assert [str(w.message) for w in caught] == ["a long job will take at least 2 hours (a lower bound)"]
    assert caught[0].category is LongRunWarning


def test_an_endless_job_is_refused_unless_long_runs_are_allowed(monkeypatch):
    forty_days = 40 * 86400.0
    with pytest.raises(ResourceError, match="would take at least 40 days; refused .*RDLM_ALLOW_LONG_RUNS=1"):
        check_time(forty_days, 1.0, "pretraining", "step")
    monkeypatch.setenv("RDLM_ALLOW_LONG_RUNS", "1")
    with pytest.warns(LongRunWarning, match="pretraining will take at least 40 days"):
        check_time(forty_days, 1.0, "pretraining", "step")


def test_the_cli_shows_a_long_job_warning_as_one_line(capsys):
    from rdlm.cli import one_line_warnings

    show = one_line_warnings("eval", None)
    show(LongRunWarning("this job will take at least 2 hours"), LongRunWarning, "file.py", 1)
    assert capsys.readouterr().err == "rdlm eval: warning: this job will take at least 2 hours\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("command", [
    ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--device", "cuda"],
    ["chat", "--model", "tiny", "--device", "cuda"],
    ["serve", "tiny", "--device", "cuda"],
    ["analyze", "tiny", "--prompt-ids", "1,2,3", "--device", "cuda"],
])
def test_a_cuda_device_without_cuda_is_one_line(command, capsys):
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda:" in err and "use --device cpu" in err


def test_a_device_that_is_not_one_is_named():
    with pytest.raises(ResourceError, match="--device: 'gpu0' is not a device"):
        check_device("gpu0")
    assert check_device("cpu") == torch.device("cpu")
