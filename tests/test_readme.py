"""The README's command blocks are the commands users run: every `rdlm` command in them parses with
today's command line (a renamed or removed flag fails here), and (slow) the CPU blocks run in order."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rdlm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def commands(block: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [" ".join(re.sub(r"(^|\s)#.*$", "", line).split()) for line in text.splitlines()]
    return [line for line in lines if line]


def rdlm_argv(line: str) -> list[str] | None:
    """The arguments after `rdlm` (or `python -m rdlm`, `torchrun ... -m rdlm`) in a command line."""
    words = shlex.split(line.replace("$STDLIB", "/stdlib"))
    for i, word in enumerate(words):
        if word.endswith("/rdlm") or word == "rdlm":
            if i and words[i - 1] == "-m" or word == "rdlm" or word.endswith("bin/rdlm"):
                return words[i + 1:]
    return None


def test_the_readme_has_the_blocks_this_test_reads():
    found = [argv for block in readme_blocks() for line in commands(block) if (argv := rdlm_argv(line))]
    assert len(found) >= 20
    assert {argv[0] for argv in found} >= {"demo", "train", "generate", "serve", "eval", "analyze", "convert",
                                            "data", "tokenizer", "chat", "lm-eval"}


def test_every_rdlm_command_in_the_readme_parses():
    parser = build_parser()
    checked = 0
    for block in readme_blocks():
        for line in commands(block):
            argv = rdlm_argv(line)
            if argv is None or "..." in argv or argv[0] == "lm-eval":   # lm-eval: the harness's own flags
                continue
            argv = [a for a in argv if not a.startswith(">")]
            try:
                args = parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"README command does not parse: rdlm {' '.join(argv)}")
            assert args.func is not None
            checked += 1
    assert checked >= 18


@pytest.mark.slow
def test_the_readme_cpu_walkthrough_runs(tmp_path):
    """From raw text to a trained, fine-tuned, converted, evaluated and analysed model, as the README says
    (the blocks that need a GPU, a server, minutes of training or a benchmark are left to their own tests)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    (tmp_path / ".venv").symlink_to(sys.prefix)   # the README's `.venv/bin/...`: this environment
    wanted = ("rdlm tokenizer train", "rdlm data prepare", "rdlm train --model tiny --set vocab_size=1024 "
              "--set context_length=64 --data runs/shards --out-dir runs/tiny", "> runs/chat.jsonl",
              "rdlm train --model runs/tiny",
              "examples/make_tiny_model.py", "rdlm eval out/tiny --text", "rdlm convert", "rdlm analyze",
              "STDLIB=")
    ran = []
    for block in readme_blocks():
        for line in commands(block):
            if any(w in line for w in wanted) and "..." not in line:
                line = line.replace("--limit-steps 256", "--limit-steps 64")
                script = 'STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()[\'stdlib\'])")\n' + line
                done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=900)
                assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
                ran.append(line)
    assert len(ran) >= 8
    assert (tmp_path / "runs" / "tiny" / "checkpoints").is_dir() and (tmp_path / "out" / "analysis").is_dir()
