"""What the decode engine gives back: a token chosen for a request (`BatchEvent`), the engine's interface
(`Engine`, the one engine being rdlm.inference.batching.ContinuousBatch), and what `generate` returns
(`TokenEvent` streamed, `GenerationResult` at the end)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from rdlm.inference.exits.track import at_cap
from rdlm.inference.params import GenerationConfig


@dataclass(frozen=True)
class BatchEvent:
    """A token an engine chose for one of its requests."""

    request: int  # the id `Engine.add` returned
    token: int
    iterations: int  # core iterations run at the position whose logits chose this token
    finish_reason: str | None  # None while the request goes on; "stop_token", "stop_string", "length"
    logprob: float | None = None  # with GenerationConfig.logprobs (TokenEvent's)
    top: tuple[tuple[int, float], ...] | None = None
    cap: int | None = None  # the iterations the token could run: num_steps, or fewer under a depth budget

    @property
    def exited(self) -> bool:
        """The token stopped iterating before its cap (an exit criterion fired)."""
        return self.cap is not None and not at_cap(self.iterations, self.cap)


class Engine(Protocol):
    """Requests in, tokens out, one step at a time: what `generate` drives (docs/inference.md, "Decode
    engine"). `add` queues a request and returns its id (ValueError for what the engine cannot serve),
    `step` runs the next step and returns the tokens it chose, `cancel` drops a request, `busy` says whether
    one is waiting or running, `take_failures` which requests failed alone (their errors) since the last call.
    `ContinuousBatch` (rdlm.inference.batching), the one engine, admits and finishes them one by one and
    ends each with `GenerationConfig.finish_reason`. The numbers below are `GenerationResult`'s,
    zero for an engine that does not do that work."""

    device: torch.device
    cache_bytes: int  # the KV cache's size
    prefill_seconds: float = 0.0  # prefilling the prompts before the first token's step (compiling left out)
    decode_start: float | None = None  # time.perf_counter() when decoding began; None: at the first step
    decode_capture: float = 0.0  # capture_seconds at decode_start (what was compiled before decoding began)

    # read-only: an engine may compute them (ContinuousBatch's properties)
    @property
    def capture_seconds(self) -> float:  # capturing CUDA graphs (rdlm.inference.execution.graphs.StaticSteps)
        return 0.0

    @property
    def drafted(self) -> int:  # self-speculative decoding
        return 0

    @property
    def accepted(self) -> int:
        return 0

    @property
    def core_passes(self) -> int:  # the parallel sampler
        return 0

    @property
    def wave_steps(self) -> int:
        return 0

    def add(self, prompt: list[int], config: GenerationConfig) -> int: ...

    def step(self) -> list[BatchEvent]: ...

    def cancel(self, request: int) -> None: ...

    def take_failures(self) -> list[tuple[int, Exception]]: ...

    @property
    def busy(self) -> bool: ...

    @property
    def queued(self) -> int: ...  # requests waiting for a row

    @property
    def running(self) -> int: ...  # requests in rows, not finished

    def take_timings(self) -> dict[str, float]: ...  # seconds per phase since the last call (a profiling engine)


@dataclass(frozen=True)
class TokenEvent:
    row: int  # which prompt of the batch
    token: int
    iterations: int  # core iterations run at the position whose logits chose this token
    logprob: float | None = None  # with GenerationConfig.logprobs: log p(token)
    top: tuple[tuple[int, float], ...] | None = None  # ... and the k most likely (token, log p), best first

    @property
    def steps(self) -> int:
        """Deprecated name of `iterations`."""
        _renamed("TokenEvent.steps", "TokenEvent.iterations")
        return self.iterations


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (stop token included, stop string not cut)
    iterations: list[list[int]]  # core iterations per new token
    finish_reasons: list[str]  # "stop_token", "stop_string" or "length"
    texts: list[str] | None = None  # decoded new text (cut before a stop string) when decode given
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    drafted: int = 0  # speculative decoding: drafted tokens ...
    accepted: int = 0  # ... and how many of them verification accepted
    cache_bytes: int = 0
    prompt_tokens: int = 0
    compile_seconds: float = 0.0  # capturing the static decode step (not in decode_seconds)
    core_passes: int = 0  # parallel sampler: core block calls after the prefill, each
    wave_steps: int = 0  # over a whole wave; and its wavefront steps
    logprobs: list[list[float]] | None = None  # with GenerationConfig.logprobs: log p of each new token

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_iterations(self) -> float:
        flat = [s for row in self.iterations for s in row]
        return sum(flat) / len(flat) if flat else 0.0

    @property
    def steps(self) -> list[list[int]]:
        """Deprecated name of `iterations`."""
        _renamed("GenerationResult.steps", "GenerationResult.iterations")
        return self.iterations

    @property
    def mean_steps(self) -> float:
        """Deprecated name of `mean_iterations`."""
        _renamed("GenerationResult.mean_steps", "GenerationResult.mean_iterations")
        return self.mean_iterations


def _renamed(old: str, new: str) -> None:
    """A public name renamed in 0.2 (a core iteration is an "iteration" everywhere): the old one still reads
    the same value, with a DeprecationWarning, until it is removed."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)
