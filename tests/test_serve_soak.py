"""The load-and-abuse soak (benchmarks/serve_soak.py), short: a server that comes out of a few seconds of
valid, invalid, streamed, cancelled, oversized and hostile requests with no 5xx, no traceback, flat memory
and an empty batch. The full run (minutes) is the script's default."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a soak
def test_a_short_soak_leaves_the_server_clean(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--seconds", "8",
                           "--clients", "4", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(report["checks"].values()) and report["5xx"] == 0 and report["tracebacks"] == 0
    scenarios = {key.split()[0] for key in report["outcomes"]}
    assert len(scenarios) == 17                                   # every kind of request was sent
    assert report["outcomes"].get("over-capacity 503") and report["outcomes"].get("slow-body 408")
    assert report["outcomes"].get("completion 200", 0) >= 1
    assert report["outcomes"].get("smuggling 400 closed") and report["outcomes"].get("unknown-path 404")
    assert report["outcomes"].get("boolean 400") and report["outcomes"].get("not-http 400 json")
    start, end = report["metric_series"]
    assert end - start <= 64 and report["rows_left"] == 0


@pytest.mark.parametrize("flags, message", [
    (["--seconds", "0"], "argument --seconds: must be a number of seconds > 0, got 0"),
    (["--seconds", "-1"], "argument --seconds: must be a number of seconds > 0, got -1"),
    (["--seconds", "nan"], "argument --seconds: must be a number of seconds > 0, got nan"),
    (["--clients", "0"], "argument --clients: must be an integer >= 1, got 0"),
])
def test_a_soak_that_would_exercise_nothing_is_refused(flags, message, capsys):
    from benchmarks.serve_soak import main

    with pytest.raises(SystemExit) as exited:
        main(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err
