"""`rdlm serve`'s settings (`ServeConfig`): the batch's shape, the queue, the request limits and where the batch
runs (rdlm.inference.server.worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rdlm.inference.params import GenerationConfig


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "rdlm"
    max_batch: int = 8  # rows decoded together
    max_queue: int = 64  # requests waiting for a row before the server answers 503
    max_length: int | None = None  # tokens per row (prompt + completion); default: the model's context
    num_slots: int = 32  # core cache slots per token: the largest r without a cache budget
    prefill_chunk: int = 256  # prompt token-iterations per step (and the longest chunk of a prompt)
    coda_every: int = 8  # core iterations a done row may wait for others to run the coda with
    exit_sync_every: int = 4  # core iterations between the batch's looks at the exit flags (rows found done
    # then leave its calls: rdlm.inference.batching)
    defaults: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=256))
    retry_after: int = 1  # seconds, in the Retry-After of a 503
    api_key: str | None = None  # when set, /v1/ requests need "Authorization: Bearer <api_key>"
    max_request_bytes: int = 1 << 20  # larger request bodies are answered 413 before they are parsed
    max_num_steps: int = 256  # the most core iterations per token a request may ask for
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
    body_timeout: float = 30.0  # seconds a request may take to send its body after its headers
    profile: bool = False  # time each phase of the batch's steps (/metrics: rdlm_batch_phase_seconds)
    compile: bool | None = None  # the batch's static core step (None: on with CUDA; rdlm.inference.batching)
    engine_process: bool | None = None  # the batch in a process of its own (None: where it pays; engine_process)
