"""Write a small random Llama as a transformers checkpoint directory (config.json, model.safetensors,
tokenizer.json): something to try `rdlm retrofit` on without downloading a model.

    python examples/make_tiny_llama.py out/tiny-llama --tokenizer runs/tok

The model is rdlm's fixed-depth baseline (`rdlm.model.retrofit.plain_config`: 6 layers, h = 128, grouped-query
attention) saved in the Llama layout (`save_as_llama`); transformers' LlamaForCausalLM loads it. Its
vocabulary is the given tokenizer's, so the retrofitted model can train on data made with that tokenizer.
"""

import argparse
import shutil
from pathlib import Path

import torch

from rdlm import RecurrentDepthLM
from rdlm.data.tokenizer import Tokenizer
from rdlm.model.retrofit import plain_config, save_as_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="out/tiny-llama", help="directory to write")
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory (e.g. runs/tok)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(args.tokenizer)
    torch.manual_seed(0)
    config = plain_config(core_layers=args.layers, hidden_size=128, num_heads=4, num_kv_heads=2,
                          intermediate_size=384, vocab_size=tokenizer.vocab_size, context_length=256,
                          rope_base=10000.0)
    out = save_as_llama(RecurrentDepthLM(config), args.out)
    source = Path(args.tokenizer)
    shutil.copy2(source / "tokenizer.json" if source.is_dir() else source, out / "tokenizer.json")
    print(f"wrote {out}: a {args.layers}-layer Llama, vocabulary {tokenizer.vocab_size}")


if __name__ == "__main__":
    main()
