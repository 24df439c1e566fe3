"""Write a random `tiny` rdlm model with a trained tokenizer.json to a directory (for trying the
transformers / lm-eval / eval commands without a trained model).

    python examples/make_tiny_model.py [DIR]      (default DIR: out/tiny; works from any directory)
"""

import argparse
from pathlib import Path

import torch

import rdlm
from rdlm.data.tokenizer import train_tokenizer

# The tokenizer's training text sits beside this script, wherever it is run from.
FACTS = Path(__file__).resolve().parent / "lm_eval_task" / "facts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="out/tiny", help="directory to write (default: out/tiny)")
    out = Path(parser.parse_args().out)
    torch.manual_seed(0)
    rdlm.save_pretrained(rdlm.build_model("tiny"), out)
    lines = FACTS.read_text(encoding="utf-8").splitlines(keepends=True) * 20
    train_tokenizer(lines, vocab_size=512).save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
