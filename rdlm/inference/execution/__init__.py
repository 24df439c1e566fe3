"""The model side of a step: the one code that calls the model (`model_calls`), the recurrent KV cache
(`cache`), the s_0 noise tables (`noise`), CUDA graphs and the step's phase timer (`graphs`), the static step
compiled for the CPU (`cpu_compile`). It knows nothing of requests, plans or rows' parameters."""
