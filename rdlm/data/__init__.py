"""Data: the BPE tokenizer, token shards for training (`rdlm data prepare`), the embedded stdlib corpus."""
