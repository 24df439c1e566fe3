"""The runner side of the continuous batch: the step runner that carries out a step's plan (`step_runner`)
and its parts: its record of a request in a row (`row_state`), the rows' exit readings (`row_exits`), the
rows' tensors and static step (`static_step`), tokens in lockstep (`lockstep`), prompts prefilled in chunks
(`prefill`), requests decoded a round at a time (`rounds`: self-speculative decoding in `speculative`, the
parallel sampler's waves in `parallel`), and choosing a token (`sampling`). It calls the model only through
rdlm.inference.execution and reads the scheduler's plan (rdlm.inference.scheduling.plan), never a `Request`."""
