"""Write a random `tiny` rdlm model with a trained tokenizer.json to a directory (for trying the
transformers / lm-eval / eval commands without a trained model). Usage: python examples/make_tiny_model.py DIR"""

import sys

import torch

import rdlm
from rdlm.data.tokenizer import train_tokenizer

out = sys.argv[1] if len(sys.argv) > 1 else "out/tiny"
torch.manual_seed(0)
rdlm.save_pretrained(rdlm.build_model("tiny"), out)
lines = [line for line in open("examples/lm_eval_task/facts.jsonl")] * 20
train_tokenizer(lines, vocab_size=512).save(out)
print(f"wrote {out}")
