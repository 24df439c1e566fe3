"""Inference: the recurrent KV cache, exit criteria, `generate` and the decode engine under it,
continuous batching and the OpenAI-compatible server, the parallel sampler, perplexity against r."""
