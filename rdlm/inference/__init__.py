"""Inference: `generate` and the decode engine under it, the OpenAI-compatible server, perplexity and accuracy
against r. The engine's parts live in rooms, each importing only from the rooms below it:

    exits/       the exit criteria (paper section 6.1) and the one exit state and rule of a token (`ExitTrack`)
    params.py    a request's parameters (`GenerationConfig`) and their checks; events.py: what a step gives back
    execution/   the model side of a step: the one code that calls the model (`ModelCalls`), the recurrent KV
                 cache, s_0 noise, CUDA graphs and the CPU compiler
    scheduling/  the scheduler side: requests, the scheduler, and the plan it hands the runner
    runner/      the runner side: the step runner that carries a plan out, its rows, static steps, lockstep
                 tokens, prompt chunks, rounds (speculative, the parallel sampler) and sampling
    batching.py  the engine (`ContinuousBatch`): schedule -> execute -> update
    generate.py, evaluate.py   what callers use: generation and streaming; negative log-likelihood against r
    server/      `rdlm serve`: the app and its worker, the HTTP guard, the OpenAI request and response schema

docs/code-map.md says what each module holds.
"""
