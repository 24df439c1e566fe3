"""The scripts in examples/ run from any working directory."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_make_tiny_model_runs_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), "model"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import rdlm
    from rdlm.data.tokenizer import Tokenizer

    model = rdlm.load_model(str(tmp_path / "model"))
    tokenizer = Tokenizer.from_dir(tmp_path / "model")
    assert model.config.name == "tiny" and tokenizer.vocab_size <= model.config.vocab_size
    assert tokenizer.decode(tokenizer.encode("Paris")) == "Paris"
